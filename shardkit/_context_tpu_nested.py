"""``sk.context_attention`` in an ``sk.pipeline`` stage's per-stage branch on XLA:TPU: the
blockwise attention on global arrays, the compiler moving K/V (``compiler_blockwise``).

Why: jax 0.10.2's libtpu (0.0.42.1) cannot partition the ring's ``shard_map`` nested in a
branch of the explicit schedules' per-tick switch: it refuses the ring's ``lax.axis_index``
("UNIMPLEMENTED: PartitionId instruction is not supported for SPMD partitioning"; 1F1B on
``pipe=2,context=2,data=2`` and ``pipe=2,context=2,tensor=2``, 2026-11-28; earlier forms of the
ring aborted in "spmd_partitioner.cc:560 Check failed: target.IsManualSubgroup() ==
sharding().IsManualSubgroup()"; GPipe's stages, outside a switch, compile). Held by
``tests/test_targets_tpu.py::test_xla_tpu_still_refuses_the_context_ring_nested_in_a_pipeline_branch``.
XLA:GPU and XLA:CPU run the ring there (``context.py``). This form computes every (query
block, K/V block) pair masked and lets the compiler all-gather K/V per block and reduce each
block's dK/dV over the axis, so it costs the flops and traffic the ring saves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ._context_blocks import F32, _NEG, _Config, _mask, _online, _split_heads
from ._vma import vary_like
from .kernels.blockwise import block_grads
from .kernels.kept import kept_output, kept_stats


def all_positions(cfg: _Config, Tl: int) -> np.ndarray:
    """Every device's ``cfg.positions`` in device order, ``(c·Tl,)``: a constant (numpy), so
    the compiler slices it per device with no communication (built from iotas and a
    concatenate, XLA:TPU permuted its pieces between devices)."""
    C = Tl // 2 if cfg.zigzag else Tl
    starts = ([(d, 2 * cfg.c - 1 - d) for d in range(cfg.c)] if cfg.zigzag else [(d,) for d in range(cfg.c)])
    return np.concatenate([b * C + np.arange(C) for blocks in starts for b in blocks]).astype(np.int32)


def compiler_blockwise(cfg: _Config, q, k, v, seg):
    """The blockwise attention and its recomputing backward (a custom VJP) on global arrays
    (see the module docstring). The queries and the softmax state are kept split over the
    axis by sharding constraints, and the compiler moves the K/V blocks (it gathers K/V, and
    reduces each block's dK/dV over the axis), so a device holds (T/c, T/c) score blocks only,
    under any remat policy of the stage."""
    B, T, Hq, Dh = q.shape
    Hkv, c = k.shape[2], cfg.c
    Tl = T // c
    split = jax.sharding.NamedSharding(cfg.mesh, P(None, cfg.axis))
    keep = lambda tree: jax.tree.map(lambda a: lax.with_sharding_constraint(a, split), tree)  # noqa: E731
    blocks = lambda a: jnp.moveaxis(a.reshape((B, c, Tl) + a.shape[2:]), 1, 0)  # noqa: E731
    unblock = lambda a: jnp.moveaxis(a, 0, 1).reshape((B, T) + a.shape[3:])  # noqa: E731

    # Built inside fwd and bwd: a custom VJP's rules may not close over traced values.
    def positions():
        return jnp.asarray(all_positions(cfg, Tl))

    def xs_of(k, v, seg, pos):
        return (blocks(k), blocks(v), pos.reshape(c, Tl)) + ((blocks(seg),) if cfg.has_seg else ())

    def mask_of(x, seg, pos):
        return _mask(pos, x[2], seg, x[3] if cfg.has_seg else None, cfg.causal)

    def forward(q, k, v, seg):
        q5, pos = keep(_split_heads(q, Hkv)), positions()

        def step(state, x):
            return keep(_online(state, q5, x[0], x[1], mask_of(x, seg, pos), cfg.scale)), None

        m0 = jnp.full(q5.shape[:-1], _NEG, F32)
        state = vary_like((m0, jnp.zeros_like(m0), jnp.zeros(q5.shape, F32)), (q, k, v))
        (m, l, acc), _ = lax.scan(step, state, xs_of(k, v, seg, pos))
        l_safe = jnp.where(l > 0, l, 1.0)
        return acc / l_safe[..., None], m + jnp.log(l_safe)  # (B, T, K, G, Dh), (B, T, K, G)

    @jax.custom_vjp
    def attend(q, k, v, seg):
        return kept_output(forward(q, k, v, seg)[0].reshape(B, T, Hq, Dh).astype(q.dtype))

    def fwd(q, k, v, seg):  # the output returned and the log-sum-exp kept, named (kernels/kept.py)
        out5, lse = forward(q, k, v, seg)
        out = kept_output(out5.reshape(B, T, Hq, Dh).astype(q.dtype))
        return out, (q, k, v, seg, out, kept_stats(lse))

    def bwd(res, dout):
        q, k, v, seg, out, lse = res
        q5, do5, pos = keep(_split_heads(q, Hkv)), keep(_split_heads(dout, Hkv)), positions()
        delta = jnp.sum(do5.astype(F32) * keep(_split_heads(out, Hkv)).astype(F32), axis=-1)

        def step(dq, x):
            kb, vb = x[0], x[1]
            s = jnp.einsum("bqkgd,bskd->bqkgs", q5, kb, preferred_element_type=F32) * cfg.scale
            p = jnp.exp(s - lse[..., None])
            mask = mask_of(x, seg, pos)
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            dq_b, dk, dv = block_grads(p, q5, do5, kb, vb, delta, cfg.scale)
            return keep(dq + dq_b), (dk, dv)

        dq0 = vary_like(jnp.zeros(q5.shape, F32), (q, k, v, dout))
        dq, (dk, dv) = lax.scan(step, dq0, xs_of(k, v, seg, pos))
        return (dq.reshape(B, T, Hq, Dh).astype(q.dtype), unblock(dk).astype(k.dtype),
                unblock(dv).astype(v.dtype), None)

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, seg)
