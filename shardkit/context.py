"""Context parallelism: attention over a sequence split along a mesh axis.

``context_attention(q, k, v)`` computes softmax attention for ``q: (B, T, Hq, Dh)`` and
``k, v: (B, T, Hkv, Dh)`` whose sequence dimension is split over the ``context`` mesh axis, so
a device holds and computes on ``T/c`` tokens only. It runs a ``jax.shard_map`` that is manual
over that one axis; every other axis (data, fsdp, tensor on the heads, pipe when called inside
an ``sk.pipeline`` stage) stays with the compiler, as ``sk.pipeline`` does with its axis.

* ``strategy="ring"`` (Liu et al. 2023, "Ring Attention with Blockwise Transformers",
  arXiv:2310.01889): ``c`` steps; at each a device attends its queries to one K/V block with an
  online (log-sum-exp) softmax in float32 (Milakov & Gimelshein 2018; Dao et al. 2022,
  FlashAttention) and passes the block to its ring neighbour with ``ppermute``, sent before
  the block is used so the transfer can overlap the compute. The backward pass is a ring too
  (a custom VJP): K/V travel again with their float32 gradient accumulators, the blocks'
  scores are recomputed from the saved log-sum-exp, so a device keeps O(T/c) activations,
  never a (T, T) or (T/c, T) score matrix. Traffic per call and device: forward ``(c-1)``
  K/V blocks; backward ``(c-1)`` K/V blocks plus ``c`` dK/dV blocks in float32.
  On GPU and TPU targets (``sk.target_platform()``) each step runs the target's Pallas flash
  kernel on its (queries, K/V block) pair instead (``kernels/flash_blocks.py``): the forward
  returns the block's output and log-sum-exp, which the ring combines by log-sum-exp; the
  backward runs the kernel's backward per block with the row's final output and log-sum-exp,
  which gives each block's exact dQ/dK/dV (ring flash attention). No step then holds the
  (T/c)² float32 score block the blockwise form does.
* ``strategy="allgather"``: K/V are all-gathered once (forward, and again in the backward,
  whose dK/dV are reduce-scattered); the same blockwise loop then reads the gathered copy.
  More memory (the whole sequence's K/V per device), no ring steps on the critical path.
* Causal load balancing (``load_balance=True``): with a contiguous split, device ``c-1``
  attends to the whole prefix and device 0 to its own block only. In the zig-zag order
  (Brandon et al. 2023, "Striped Attention"; the zig-zag variant of Llama 3's context
  parallelism) the sequence is cut into ``2c`` chunks and device ``d`` holds chunks ``d`` and
  ``2c-1-d``; then every off-diagonal step is exactly half a block of unmasked work on every
  device, and this module computes only that half. The tokens must arrive in that order:
  ``context_shard`` reorders a batch (tokens, labels, positions, segment ids) once, before the
  model; position-wise layers do not care, RoPE takes the reordered positions, a mean loss
  over reordered tokens and labels is unchanged, and ``context_unshard`` restores the natural
  order of any per-token output. A causal, load-balanced call says which order its tokens
  are in (``order="zigzag"`` after ``context_shard``; ``order="natural"`` reorders q, k, v
  into zig-zag and the output back inside the call, at the cost of moving them once across
  the axis): the two orders hold the same tokens, so a wrong guess would be silently wrong.

Without the axis in the mesh (or at size 1) it is ordinary attention, so the same model code
runs on one device. Called inside another ``shard_map`` (an ``sk.pipeline`` stage, manual
over the pipe and data axes) the same ring runs in a ``shard_map`` nested in it: its forward
is one opaque primitive (``_opaque``), which a stage's remat or keep policy cannot split, and
in the explicit schedules' per-stage branches its permutes stay inside the stage
(``_branches.ppermute``: one permute per stage, switched on the stage; on XLA:CPU the block is
read off an all-gather over the axis, as XLA:CPU meets all of a program's permutes in one
rendezvous). XLA:TPU cannot partition the ring in such a branch: there the compiler moves
K/V for a blockwise form (``_context_tpu_nested``).

Usage (causal, load-balanced)::

    batch = sk.context_shard(batch)             # once: tokens, labels, segment ids (B, T, ...)
    cos, sin = sk.context_shard((cos, sin), seq_dim=0)   # RoPE tables follow the tokens
    ...                                         # in the model, per attention layer:
    q = sk.constrain(q, ("batch", "context", "heads", None))
    o = sk.context_attention(q, k, v, causal=True, order="zigzag")
    loss = mean_cross_entropy(logits, batch["labels"])   # unchanged by the reorder
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ._context_blocks import F32, _NEG, _Config, _mask, sharded
from ._axes import claim_axes
from ._branches import branching_axis
from ._context_tpu_nested import compiler_blockwise
from .mesh import block_shard_map
from .plan import active_plan, note
from .rules import ShardingError
from .xla import target_platform

STRATEGIES = ("ring", "allgather")
ORDERS = ("natural", "zigzag")
IMPLEMENTATIONS = ("auto", "blockwise", "triton", "mosaic")


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                      axis: str = "context", strategy: str = "ring", load_balance: bool = True,
                      order: str | None = None, scale: float | None = None,
                      segment_ids: jax.Array | None = None, mesh: Any = None,
                      implementation: str = "auto") -> jax.Array:
    """Softmax attention with the sequence split over the ``axis`` mesh axis.

    Args:
        q: queries ``(B, T, Hq, Dh)``; ``T`` split over ``axis`` (a plan puts it there through
            ``sk.constrain(x, ("batch", "context", ...))``; other layouts are resharded).
        k: keys ``(B, T, Hkv, Dh)``, ``Hq`` a multiple of ``Hkv`` (grouped-query attention:
            query head ``h`` reads kv head ``h // (Hq / Hkv)``).
        v: values, shaped like ``k``.
        causal: a token attends to itself and the tokens before it (by global position).
        axis: the mesh axis the sequence is split over.
        strategy: ``"ring"`` (K/V passed around the axis) or ``"allgather"``.
        load_balance: for ``causal``: every device does the same work, in ``context_shard``'s
            zig-zag order (see the module docstring); ``False``: the sequence in natural order,
            split contiguously (device ``c-1`` then does ``c`` times the work of device 0).
        order: the order the tokens of q, k, v (and ``segment_ids``) are in, required for a
            causal, load-balanced call: ``"zigzag"`` (they went through ``context_shard``;
            the output is in that order too) or ``"natural"`` (reordered into zig-zag and
            the output back inside this call: one more move of q, k, v and the output
            across the axis). Without the axis both give plain attention on the tokens as
            they are. Non-causal attention does not depend on the order.
        scale: score scale; default ``1/sqrt(Dh)``.
        segment_ids: optional ``(B, T)`` integers (packed documents): a token attends only to
            tokens with the same id. In the same (possibly reordered) order as ``q``.
        mesh: the mesh; default the ambient one (``jax.set_mesh``, as inside
            ``sk.train_step`` and ``sk.pipeline``), else the active plan's.
        implementation: what attends each (queries, K/V block) pair: ``"auto"`` picks by the
            platform compiled for (``sk.target_platform()``): the target's Pallas flash
            kernel on GPU (``"triton"``) and TPU (``"mosaic"``), per device over the batch and
            head axes the plan names (as ``sk.attention``), the blockwise online softmax
            (``"blockwise"``) on CPU, or where the kernel cannot take the block (segment ids,
            a block its tiles do not divide: a ``KernelFallbackWarning`` says why), nested in a
            pipeline stage too.

    Returns:
        ``(B, T, Hq, Dh)`` in ``q``'s dtype; float32 softmax and accumulation inside.

    Raises:
        ValueError: wrong ranks or shapes, ``Hq`` not a multiple of ``Hkv``, ``segment_ids``
            not ``(B, T)``, an unknown strategy or order, a causal load-balanced call
            without ``order``, or ``order="zigzag"`` with ``load_balance=False``, an unknown
            implementation or segment ids with a forced flash kernel.
        ShardingError: ``T`` not divisible by the axis size (twice it under causal load
            balancing).
    """
    _check(q, k, v, segment_ids, strategy)
    _check_order(causal, load_balance, order)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"context_attention: implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    mesh = _resolve_mesh(mesh)
    c = dict(mesh.shape).get(axis, 1) if mesh is not None else 1
    if c == 1:
        return plain_attention(q, k, v, causal=causal, scale=scale, segment_ids=segment_ids)
    zigzag = causal and load_balance
    T, n = q.shape[1], 2 * c if zigzag else c
    if T % n:
        why = f"2 x {axis}={c} zig-zag chunks (causal load balancing)" if zigzag else f"{axis}={c} shards"
        # A ShardingError (a ValueError): the layout does not fit the sequence.
        raise ShardingError(f"context_attention: sequence length {T} does not split into {n} equal "
                            f"parts ({why}); use a sequence length that is a multiple of {n}"
                            + (", or load_balance=False (needs a multiple of "
                               f"{c})" if zigzag else ", or a smaller context axis"))
    if zigzag and order == "natural":
        shard = lambda a, inverse=False: None if a is None else _exchange(a, axis, c, mesh, inverse)  # noqa: E731
        o = context_attention(shard(q), shard(k), shard(v), causal=True, axis=axis, strategy=strategy,
                              order="zigzag", scale=scale, segment_ids=shard(segment_ids), mesh=mesh,
                              implementation=implementation)
        return shard(o, inverse=True)
    claim_axes(axis)
    # XLA:TPU cannot partition the ring nested in a per-stage branch (_context_tpu_nested).
    tpu_branch = branching_axis() is not None and target_platform() == "tpu"
    blocks = None if tpu_branch else _ring_blocks(implementation, q, c, zigzag, segment_ids is not None, scale)
    note("context_attention", {"axis": axis, "size": c, "strategy": strategy, "causal": causal,
                               "load_balance": zigzag, "implementation": blocks.impl if blocks else "blockwise"})
    cfg = _Config(mesh, axis, c, causal, zigzag, scale, strategy, segment_ids is not None, blocks)
    if tpu_branch:
        return compiler_blockwise(cfg, q, k, v, segment_ids)
    return sharded(cfg)(q, k, v, segment_ids)


# XLA:TPU (jax 0.10.2's libtpu) fails to compile the Mosaic ring's causal zig-zag backward over
# 2 devices ("Can't deep copy instruction tuple", on a tuple of the step's dK/dV accumulators);
# the non-causal ring over 2 and the causal one over 4 and 8 compile.
_MOSAIC_ZIGZAG_TWO = ("XLA:TPU fails to compile the Mosaic kernel's zig-zag ring backward over a context axis of 2 "
                      "(\"Can't deep copy instruction tuple\"; 4 and more compile)")
_NO_SEGMENTS = ("the ring's flash blocks take no segment ids (Triton's kernel masks queries and keys by one id "
                "array, so not a pair from two places in the sequence; Mosaic's two arrays are not wired yet)")


def _ring_blocks(implementation: str, q, c: int, zigzag: bool, has_seg: bool, scale: float):
    """The flash kernel's blocks (``kernels/flash_blocks.py``) each ring step runs, or None for
    the blockwise online softmax; the sequence is cut into ``c`` blocks (``2c`` halves in
    zig-zag order)."""
    from .kernels.attention import KernelFallbackWarning, attention_implementation
    from .kernels.flash_blocks import FlashBlocks

    if implementation == "blockwise":
        return None
    if implementation != "auto":
        if has_seg:
            raise ValueError(f"context_attention: implementation={implementation!r} takes no segment_ids: "
                             f"{_NO_SEGMENTS}; use implementation='blockwise' or 'auto'")
        if implementation == "mosaic" and zigzag and c == 2:
            raise ValueError(f"context_attention: {_MOSAIC_ZIGZAG_TWO}; use implementation='blockwise' or 'auto'")
        return FlashBlocks(implementation, scale)
    B, T, H, Dh = q.shape
    # The non-causal choice: a ring's off-diagonal pairs run the kernel unmasked.
    choice = attention_implementation((B, T // (2 * c if zigzag else c), H, Dh), q.dtype, causal=False)
    impl = "triton" if choice.implementation == "cudnn" else choice.implementation  # cuDNN gives no lse
    reason = choice.reason
    if impl != "blockwise" and has_seg:
        reason = _NO_SEGMENTS
    elif impl == "mosaic" and zigzag and c == 2:
        reason = _MOSAIC_ZIGZAG_TWO
    if reason:
        warnings.warn(f"context_attention: the ring's blocks run the blockwise online softmax instead of the "
                      f"target's flash kernel: {reason} (q {tuple(q.shape)} {jnp.dtype(q.dtype).name}, "
                      f"context axis of {c})", KernelFallbackWarning, stacklevel=3)
        return None
    return None if impl == "blockwise" else FlashBlocks(impl, scale)


def plain_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    scale: float | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """The same attention on one device (float32 softmax): what ``context_attention`` computes
    without a context axis. Shapes as there; the sequence in natural order."""
    _check(q, k, v, segment_ids, "ring")
    B, T, Hq, Dh = q.shape
    Hkv = k.shape[2]
    scale = 1.0 / math.sqrt(Dh) if scale is None else float(scale)
    q5 = q.reshape(B, T, Hkv, Hq // Hkv, Dh)
    s = jnp.einsum("bqkgd,bskd->bqkgs", q5, k, preferred_element_type=F32) * scale
    pos = jnp.arange(T)
    mask = _mask(pos, pos, segment_ids, segment_ids, causal)
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bqkgs,bskd->bqkgd", p.astype(v.dtype), v, preferred_element_type=F32)
    return o.reshape(B, T, Hq, Dh).astype(q.dtype)


def context_shard(x: Any, *, axis: str = "context", seq_dim: int = 1, mesh: Any = None,
                  size: int | None = None) -> Any:
    """Puts every leaf's sequence dimension in the zig-zag order causal load balancing needs.

    The sequence is cut into ``2c`` chunks (``c`` = the axis size) and device ``d`` gets chunks
    ``d`` and ``2c-1-d``: reordered, a contiguous split over the axis gives each device one
    early and one late chunk, so every device does the same causal work. Apply it once to the
    batch — tokens, labels, positions (RoPE then rotates by the reordered positions), segment
    ids — and run the model on the result: position-wise layers are unaffected, a mean loss over
    reordered tokens and labels equals the original, and ``context_unshard`` restores the
    natural order of per-token outputs. Without the axis (or at size 1) it returns ``x``.

    Args:
        x: an array or a pytree of arrays (numpy leaves stay numpy, so a host data pipeline can
            reorder before ``device_put``).
        axis: the context mesh axis.
        seq_dim: the sequence dimension of every leaf (1 for ``(B, T, ...)``, 0 for a ``(T,
            ...)`` table of positions or rotary angles).
        mesh: the mesh; default the ambient one, else the active plan's.
        size: the axis size, instead of reading it from a mesh.

    Raises:
        ShardingError: a leaf's sequence length is not a multiple of ``2c``.
        ValueError: a leaf has no ``seq_dim``.
    """
    return _reorder(x, axis, seq_dim, mesh, size, inverse=False)


def context_unshard(x: Any, *, axis: str = "context", seq_dim: int = 1, mesh: Any = None,
                    size: int | None = None) -> Any:
    """The inverse of ``context_shard``: natural sequence order back (same arguments)."""
    return _reorder(x, axis, seq_dim, mesh, size, inverse=True)


# ---- checks and plumbing -------------------------------------------------------------------------

def _check_order(causal: bool, load_balance: bool, order: str | None) -> None:
    if order is not None and order not in ORDERS:
        raise ValueError(f"context_attention: unknown order {order!r}; the tokens are in {ORDERS[0]!r} "
                         f"order or in {ORDERS[1]!r} order (after sk.context_shard)")
    if causal and load_balance and order is None:
        # Both orders hold the same tokens: guessing either is silently wrong for the other.
        raise ValueError(
            "context_attention(causal=True) balances the causal work over the context axis and must know "
            "the order the tokens are in: pass order='zigzag' if q, k, v (and segment_ids) went through "
            "sk.context_shard (as the recipe's batch does; the output is in that order too), or "
            "order='natural' for tokens in their natural order (reordered inside the call), or "
            "load_balance=False (natural order, contiguous split, unbalanced work)")
    if causal and order == "zigzag" and not load_balance:
        raise ValueError("context_attention: order='zigzag' is the load-balanced layout; drop load_balance=False, "
                         "or pass tokens in natural order (sk.context_unshard) with load_balance=False")


def _check(q, k, v, segment_ids, strategy) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"context_attention: unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    for name, a in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(a) != 4:
            raise ValueError(f"context_attention: {name} has shape {jnp.shape(a)}; expected rank 4 "
                             "(batch, seq, heads, head_dim)")
    if k.shape != v.shape:
        raise ValueError(f"context_attention: k {k.shape} and v {v.shape} must have the same shape")
    (B, T, Hq, Dh), (Bk, Tk, Hkv, Dk) = q.shape, k.shape
    if (B, T, Dh) != (Bk, Tk, Dk):
        raise ValueError(f"context_attention: q {q.shape} and k/v {k.shape} must agree on batch, "
                         "sequence and head_dim (self-attention over one sequence)")
    if Hq % Hkv:
        raise ValueError(f"context_attention: {Hq} query heads are not a multiple of {Hkv} kv heads; "
                         f"grouped-query attention shares each kv head among Hq/Hkv query heads: "
                         f"use a number of query heads divisible by {Hkv}")
    if segment_ids is not None and tuple(jnp.shape(segment_ids)) != (B, T):
        raise ValueError(f"context_attention: segment_ids has shape {tuple(jnp.shape(segment_ids))} but "
                         f"q is {q.shape}; segment ids are one integer per token, shape (batch, seq) "
                         f"= {(B, T)}, in the same order as q")


def _resolve_mesh(mesh):
    if mesh is not None:
        return mesh
    ambient = jax.sharding.get_abstract_mesh()
    if ambient is not None and not ambient.empty:
        return ambient
    plan = active_plan()
    return plan.mesh if plan is not None else None


def _reorder(x, axis, seq_dim, mesh, size, inverse):
    if size is None:
        mesh = _resolve_mesh(mesh)
        size = dict(mesh.shape).get(axis, 1) if mesh is not None else 1
    c = int(size)
    if c == 1:
        return x
    order = np.array([i for d in range(c) for i in (d, 2 * c - 1 - d)])
    if inverse:
        order = np.argsort(order)

    def one(a):
        shape = tuple(np.shape(a))
        if len(shape) <= seq_dim:
            raise ValueError(f"context_shard: a leaf of shape {shape} has no sequence dimension "
                             f"{seq_dim}; pass seq_dim= (0 for a (T, ...) table)")
        T = shape[seq_dim]
        if T % (2 * c):
            raise ShardingError(f"context_shard: sequence length {T} (dim {seq_dim} of a {shape} leaf) "
                                f"does not split into 2 x {axis}={c} = {2 * c} zig-zag chunks; use a "
                                f"sequence length that is a multiple of {2 * c}")
        xp = np if isinstance(a, np.ndarray) else jnp
        chunks = xp.reshape(a, shape[:seq_dim] + (2 * c, T // (2 * c)) + shape[seq_dim + 1:])
        return xp.reshape(xp.take(chunks, order, axis=seq_dim), shape)

    return jax.tree.map(one, x)



def _exchange(x: jax.Array, axis: str, c: int, mesh: Any, inverse: bool) -> jax.Array:
    """``x`` (``(B, T, ...)``, ``T`` split contiguously over ``axis``) into ``context_shard``'s
    zig-zag order, or back with ``inverse``, moving each device's block once: two
    ppermutes of half a block (the even and the odd chunk), where a reorder of the
    global array compiles to an all-gather of the sequence. Nested in another shard_map (an
    ``sk.pipeline`` stage) the compiler moves the global array instead."""
    if getattr(mesh, "manual_axes", ()):
        return _reorder(x, axis, 1, mesh, c, inverse)
    home = lambda j: j if j < c else 2 * c - 1 - j  # noqa: E731  (device of chunk j in zig-zag order)

    def body(a):  # this device's block: two chunks of T / 2c
        d, h = jax.lax.axis_index(axis), a.shape[1] // 2
        lo, hi = a[:, :h], a[:, h:]
        if not inverse:  # device s holds chunks 2s, 2s+1; chunk j goes to home(j)
            even = jax.lax.ppermute(lo, axis, [(s, home(2 * s)) for s in range(c)])
            odd = jax.lax.ppermute(hi, axis, [(s, home(2 * s + 1)) for s in range(c)])
            first_even = d % 2 == 0  # device d holds chunks d, 2c-1-d: the even one first iff d is even
        else:  # device s holds chunks s, 2c-1-s (one even, one odd); chunk j goes to device j // 2
            swap = d % 2 == 1
            e_src, o_src = jnp.where(swap, hi, lo), jnp.where(swap, lo, hi)
            even = jax.lax.ppermute(e_src, axis, [(s, (s if s % 2 == 0 else 2 * c - 1 - s) // 2) for s in range(c)])
            odd = jax.lax.ppermute(o_src, axis, [(s, (2 * c - 1 - s if s % 2 == 0 else s) // 2) for s in range(c)])
            first_even = True  # device d holds chunks 2d, 2d+1
        first, second = jnp.where(first_even, even, odd), jnp.where(first_even, odd, even)
        return jnp.concatenate([first, second], axis=1)

    seq = P(None, axis)
    return block_shard_map(body, mesh=mesh, axis_names={axis}, in_specs=(seq,), out_specs=seq)(x)
