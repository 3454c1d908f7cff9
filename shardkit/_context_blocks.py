"""The per-device blocks of ``sk.context_attention`` (``context.py``): the ring / all-gather
forward and backward bodies, the ``shard_map`` they run in (``sharded``), their online-softmax steps
(or a flash kernel's, ``kernels/flash_blocks.py``). See ``context.py``'s docstring for the
algorithm and its sources.

The same bodies run nested in an ``sk.pipeline`` stage: the ring's ``ppermute`` is
``_branches.ppermute``, which stays inside the stage when the stage runs in a branch of the
explicit schedules' per-tick switch, and the forward is one opaque primitive (``_opaque``)
that the stage's partial evaluation cannot split."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ._branches import even_switch, ppermute
from ._opaque import opaque
from ._vma import vary_like
from .kernels.blockwise import block_grads
from .kernels.kept import kept_output, kept_stats
from .mesh import block_shard_map

F32 = jnp.float32
_NEG = -1e30  # a finite "minus infinity": exp(_NEG - _NEG) = 1 is then masked, never NaN
# The part of a (queries, K/V block) pair a step computes (``_Config.diagonal`` and
# ``off_diagonal``): all of it, K/V's first half (zig-zag, source before me), the queries'
# second half (zig-zag, source after me), nothing (contiguous, after), or the diagonal pair,
# causal within itself (a flash kernel masks by position within the pair: in zig-zag order
# the diagonal pair's local positions order its tokens as the global ones do, chunk d before
# chunk 2c-1-d).
_FULL, _KV_FIRST, _Q_SECOND, _SKIP, _DIAG = range(5)

class _Config:
    """What one sharded call is specialised on (all static)."""

    def __init__(self, mesh, axis, c, causal, zigzag, scale, strategy, has_seg, blocks=None):
        self.mesh, self.axis, self.c, self.causal, self.zigzag = mesh, axis, c, causal, zigzag
        self.scale, self.strategy, self.has_seg = scale, strategy, has_seg
        self.blocks = blocks  # a flash kernel's blocks (kernels/flash_blocks.py), None: blockwise

    def positions(self, d, Tl):
        """Global positions of device ``d``'s ``Tl`` tokens (contiguous or zig-zag)."""
        if not self.zigzag:
            return d * Tl + jnp.arange(Tl)
        C = Tl // 2
        return jnp.concatenate([d * C + jnp.arange(C), (2 * self.c - 1 - d) * C + jnp.arange(C)])

    @property
    def diagonal(self):
        """The kind of step 0's pair, a device's own queries and K/V: causal within the pair."""
        return _DIAG if self.causal else _FULL

    @property
    def off_diagonal(self):
        """The kinds of the other steps' pairs (queries i, K/V block j != i), picked by
        ``j < i``: zig-zag's unmasked halves (K/V's first, the queries' second), contiguous
        order's whole or skipped block; one kind without a causal mask. Either way each kind
        is taken on half of the off-diagonal pairs over the devices (``even_switch``)."""
        if not self.causal:
            return (_FULL,)
        return (_KV_FIRST, _Q_SECOND) if self.zigzag else (_FULL, _SKIP)


def _mask(pq, pk, sq, sk, causal):
    """(B|1, Tq, 1, 1, Tk) bool, or None when nothing is masked."""
    m = (pq[:, None] >= pk[None, :])[None, :, None, None, :] if causal else None
    if sq is not None:
        seg = (sq[:, :, None] == sk[:, None, :])[:, :, None, None, :]
        m = seg if m is None else m & seg
    return m


# ---- per-device bodies ----------------------------------------------------------------------

def _split_heads(q, Hkv):
    B, Tl, Hq, Dh = q.shape
    return q.reshape(B, Tl, Hkv, Hq // Hkv, Dh)


def _ring(cfg: _Config, turn: int):
    """The ring's pairs: each device sends to its neighbour ``turn`` (+1 or -1) along the axis.
    The forward turns +1, the backward -1: its first send (a device's own K/V) would otherwise
    be the forward's, same operands and pairs, which XLA merges where both sit in one
    computation (XLA:CPU drops an optimization barrier first), keeping the received block
    alive from forward to backward; either direction visits every block."""
    return [(d, (d + turn) % cfg.c) for d in range(cfg.c)]


def _source(cfg: _Config, i, s, turn: int):
    """The device whose K/V block device ``i`` holds at step ``s`` of a ring turning ``turn``."""
    return (i - turn * s) % cfg.c


def _fetcher(cfg: _Config, kv_local, i, turn: int):
    """``fetch(s, carried) -> block``: the K/V block a device works on at step ``s`` (from
    device ``_source``): the one the ring carried in, or read from the all-gathered copy (the
    same order, so both strategies sum in the same order)."""
    if cfg.strategy == "ring":
        return lambda s, carried: carried
    gathered = jax.tree.map(lambda a: lax.all_gather(a, cfg.axis), kv_local)  # (c, ...) each
    return lambda s, carried: jax.tree.map(
        lambda a: lax.dynamic_index_in_dim(a, _source(cfg, i, s, turn), 0, keepdims=False), gathered)


def _steps(cfg, carry, kv, step, turn: int):
    """Runs ``step(carry, kv_block, s)`` for s = 0..c-1 with the ring's ``c-1`` transfers:
    each step sends the block it holds before using it (the send overlaps the compute). Step
    0 (a device's own block, the diagonal pair) runs apart with ``s`` a Python 0, so its kind
    is static and the loop's steps are all off-diagonal."""
    if cfg.strategy == "allgather":
        return lax.fori_loop(1, cfg.c, lambda s, cr: step(cr, None, s), step(carry, None, 0))
    ring = _ring(cfg, turn)

    def body(state, s):
        carry, block = state
        nxt = ppermute(block, cfg.axis, ring)
        return (step(carry, block, s), nxt), None

    nxt = ppermute(kv, cfg.axis, ring)
    (carry, block), _ = lax.scan(body, (step(carry, kv, 0), nxt), jnp.arange(1, cfg.c - 1))
    return step(carry, block, cfg.c - 1)


def _sub(branch, C):
    """(query slice, kv slice) of the block that has work, for a static branch."""
    whole = slice(None)
    return {_FULL: (whole, whole), _DIAG: (whole, whole), _KV_FIRST: (whole, slice(0, C)),
            _Q_SECOND: (slice(C, None), whole)}[branch]


def _online(state, q5, kb, vb, mask, scale):
    """One block of the online softmax: running max ``m``, sum ``l`` and numerator ``acc``."""
    m, l, acc = state
    s = jnp.einsum("bqkgd,bskd->bqkgs", q5, kb, preferred_element_type=F32) * scale
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    acc = acc * corr[..., None] + jnp.einsum("bqkgs,bskd->bqkgd", p.astype(vb.dtype), vb,
                                             preferred_element_type=F32)
    return m_new, l, acc


def _kind_of(cfg: _Config, i, j, s, run):
    """``run(kind)`` for the (queries ``i``, K/V block ``j``) pair of step ``s``: the diagonal
    at step 0, else the off-diagonal kind ``j < i`` picks (an ``even_switch``)."""
    if isinstance(s, int) and s == 0:
        return run(cfg.diagonal)
    kinds = cfg.off_diagonal
    if len(kinds) == 1:
        return run(kinds[0])
    return even_switch(jnp.where(j < i, 0, 1), [lambda kd=kd: run(kd) for kd in kinds])


def _ring_loop(cfg: _Config, i, kv, state, update):
    """Runs ``update(state, block, j, kind)`` over the ``c`` K/V blocks (block ``j`` from device
    ``_source(cfg, i, s, 1)`` at step ``s``), ``kind`` the part of the pair with work."""
    fetch = _fetcher(cfg, kv, i, 1)

    def step(state, carried, s):
        block, j = fetch(s, carried), _source(cfg, i, s, 1)
        return _kind_of(cfg, i, j, s, lambda kd: update(state, block, j, kd))

    return _steps(cfg, state, kv, step, 1)


def _grad_loop(cfg: _Config, i, kv, dq, every, update):
    """The backward's ring: ``update(dq, (dk, dv), block, j, kind)`` over the blocks as
    ``_ring_loop``, each block's float32 dK/dV accumulators travelling with it (``ring``) or
    kept for the whole sequence and reduce-scattered after (``allgather``). Returns dq and this
    device's dK, dV (float32)."""
    k, v = kv[0], kv[1]
    if cfg.strategy == "ring":  # dK/dV accumulators travel with their block
        grads = vary_like((jnp.zeros(k.shape, F32), jnp.zeros(v.shape, F32)), every)
    else:  # all-gather: accumulate the whole sequence's dK/dV here, reduce-scatter after
        grads = vary_like((jnp.zeros((cfg.c,) + k.shape, F32), jnp.zeros((cfg.c,) + v.shape, F32)), every)
    fetch = _fetcher(cfg, kv, i, -1)
    ring = _ring(cfg, -1)  # the other way round (``_ring``)

    def step(carry, carried, s):
        dq, grads = carry
        block = fetch(s, carried)
        j = _source(cfg, i, s, -1)
        dkv = grads if cfg.strategy == "ring" else tuple(g[j] for g in grads)
        dq, dkv = _kind_of(cfg, i, j, s, lambda kd: update(dq, dkv, block, j, kd))
        if cfg.strategy == "ring":  # hand the block's gradient on with it
            return dq, ppermute(dkv, cfg.axis, ring)
        return dq, tuple(g.at[j].set(d) for g, d in zip(grads, dkv))

    dq, grads = _steps(cfg, (dq, grads), kv, step, -1)
    if cfg.strategy == "allgather":
        grads = tuple(lax.psum_scatter(g, cfg.axis, scatter_dimension=0, tiled=False) for g in grads)
    # After c steps the ring has carried each block's gradient back to the block's own device.
    return dq, grads[0], grads[1]


def _forward_body(cfg: _Config, q, k, v, seg=None):
    B, Tl, Hq, Dh = q.shape
    Hkv, C = k.shape[2], Tl // 2
    i = lax.axis_index(cfg.axis)
    q5, pq = _split_heads(q, Hkv), cfg.positions(i, Tl)
    kv = (k, v, seg) if cfg.has_seg else (k, v)
    m0 = jnp.full((B, Tl, Hkv, Hq // Hkv), _NEG, F32)
    state = vary_like((m0, jnp.zeros_like(m0), jnp.zeros(q5.shape, F32)), (q,) + kv)

    def update(state, block, j, kind):
        if kind == _SKIP:
            return state
        qs, ks = _sub(kind, C)
        kb, vb = block[0][:, ks], block[1][:, ks]
        mask = _mask(pq[qs], cfg.positions(j, Tl)[ks], seg[:, qs] if cfg.has_seg else None,
                     block[2][:, ks] if cfg.has_seg else None, cfg.causal)
        new = _online(tuple(a[:, qs] for a in state), q5[:, qs], kb, vb, mask, cfg.scale)
        return tuple(a.at[:, qs].set(b) for a, b in zip(state, new))

    m, l, acc = _ring_loop(cfg, i, kv, state, update)
    l_safe = jnp.where(l > 0, l, 1.0)
    # Both outputs come from arithmetic, last: a remat policy that recomputes reshapes and
    # casts (sk.pipeline's) then saves them instead of splitting this shard_map, which JAX
    # cannot yet do for a shard_map nested in another one (the residuals' specs would name the
    # outer manual axes). The cast to q's dtype happens outside.
    out = acc.reshape(B, Tl, Hq, Dh) * (1.0 / l_safe).reshape(B, Tl, Hq, 1)
    return out, m + jnp.log(l_safe)


def _backward_body(cfg: _Config, q, k, v, out, lse, dout, seg=None):
    B, Tl, Hq, Dh = q.shape
    Hkv, C = k.shape[2], Tl // 2
    i = lax.axis_index(cfg.axis)
    q5, do5, pq = _split_heads(q, Hkv), _split_heads(dout, Hkv), cfg.positions(i, Tl)
    delta = jnp.sum(do5.astype(F32) * _split_heads(out, Hkv).astype(F32), axis=-1)  # (B, Tl, K, G)
    kv = (k, v, seg) if cfg.has_seg else (k, v)
    every = (q, k, v, out, lse, dout) + ((seg,) if cfg.has_seg else ())
    dq = vary_like(jnp.zeros(q5.shape, F32), every)

    def update(dq, dkv, block, j, kind):
        if kind == _SKIP:
            return dq, dkv
        qs, ks = _sub(kind, C)
        kb, vb = block[0][:, ks], block[1][:, ks]
        mask = _mask(pq[qs], cfg.positions(j, Tl)[ks], seg[:, qs] if cfg.has_seg else None,
                     block[2][:, ks] if cfg.has_seg else None, cfg.causal)
        qb, dob = q5[:, qs], do5[:, qs]
        s = jnp.einsum("bqkgd,bskd->bqkgs", qb, kb, preferred_element_type=F32) * cfg.scale
        p = jnp.exp(s - lse[:, qs][..., None])
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        dq_b, dk, dv = block_grads(p, qb, dob, kb, vb, delta[:, qs], cfg.scale)
        return dq.at[:, qs].add(dq_b), (dkv[0].at[:, ks].add(dk), dkv[1].at[:, ks].add(dv))

    dq, dk, dv = _grad_loop(cfg, i, kv, dq, every, update)
    return dq.reshape(B, Tl, Hq, Dh).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- the same ring with a flash kernel per block (GPU and TPU targets) -----------------------

def _flash_forward_body(cfg: _Config, q, k, v):
    """The ring with ``cfg.blocks`` per step: each block's output and log-sum-exp, combined
    by their log-sum-exps. Returns the output (B, Tl, H, Dh) and log-sum-exp (B, Tl, H),
    float32."""
    B, Tl, Hq, Dh = q.shape
    C = Tl // 2
    i = lax.axis_index(cfg.axis)
    state = vary_like((jnp.zeros(q.shape, F32), jnp.full((B, Tl, Hq), _NEG, F32)), (q, k, v))

    def update(state, block, j, kind):
        if kind == _SKIP:
            return state
        qs, ks = _sub(kind, C)
        o_b, lse_b = cfg.blocks.forward(q[:, qs], block[0][:, ks], block[1][:, ks], kind == _DIAG)
        o, lse = state[0][:, qs], state[1][:, qs]
        new = jnp.logaddexp(lse, lse_b)
        o = o * jnp.exp(lse - new)[..., None] + o_b.astype(F32) * jnp.exp(lse_b - new)[..., None]
        return state[0].at[:, qs].set(o), state[1].at[:, qs].set(new)

    return _ring_loop(cfg, i, (k, v), state, update)


def _flash_backward_body(cfg: _Config, q, k, v, out, lse, dout):
    """The kernel's backward per block with the row's whole output and log-sum-exp (exact
    contributions; ``kernels/flash_blocks.py``), dK/dV travelling as in ``_grad_loop``."""
    C = q.shape[1] // 2
    i = lax.axis_index(cfg.axis)
    every = (q, k, v, out, lse, dout)
    dq = vary_like(jnp.zeros(q.shape, F32), every)

    def update(dq, dkv, block, j, kind):
        if kind == _SKIP:
            return dq, dkv
        qs, ks = _sub(kind, C)
        dq_b, dk_b, dv_b = cfg.blocks.backward(q[:, qs], block[0][:, ks], block[1][:, ks], out[:, qs],
                                               lse[:, qs], dout[:, qs], kind == _DIAG)
        return dq.at[:, qs].add(dq_b), (dkv[0].at[:, ks].add(dk_b), dkv[1].at[:, ks].add(dv_b))

    dq, dk, dv = _grad_loop(cfg, i, (k, v), dq, every, update)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ---- the shard_map around the bodies ---------------------------------------------------------

def sharded(cfg: _Config) -> Callable:
    """``f(q, k, v, seg) -> out`` with the ring (or all-gather) forward and backward."""
    seq = P(None, cfg.axis)
    smap = lambda body, n_in, n_out: block_shard_map(  # noqa: E731
        body, mesh=cfg.mesh, axis_names={cfg.axis}, in_specs=(seq,) * n_in,
        out_specs=(seq,) * n_out if n_out > 1 else seq)

    forward_body, backward_body = ((_flash_forward_body, _flash_backward_body) if cfg.blocks
                                   else (_forward_body, _backward_body))

    def forward(q, k, v, seg):
        args = (q, k, v) + ((seg,) if cfg.has_seg else ())
        # One primitive to partial evaluation (see _opaque): a layer scan under a remat
        # policy would otherwise split this shard_map and hoist its input-free part.
        return opaque(smap(lambda *a: forward_body(cfg, *a), len(args), 2))(*args)

    @jax.custom_vjp
    def attend(q, k, v, seg):
        return kept_output(forward(q, k, v, seg)[0].astype(q.dtype))

    # The residuals are the combined output returned (q's dtype, not the ring's float32
    # accumulator) and the row's log-sum-exp, named: a names policy keeps them (one buffer
    # for this backward and the caller's next matmul) and the backward never reruns the ring's
    # forward (kernels/kept.py).
    def fwd(q, k, v, seg):
        out, lse = forward(q, k, v, seg)
        out = kept_output(out.astype(q.dtype))
        return out, (q, k, v, seg, out, kept_stats(lse))

    def bwd(res, dout):
        q, k, v, seg, out, lse = res
        args = (q, k, v, out, lse, dout) + ((seg,) if cfg.has_seg else ())
        dq, dk, dv = smap(lambda *a: backward_body(cfg, *a), len(args), 3)(*args)
        return dq, dk, dv, None

    attend.defvjp(fwd, bwd)
    return attend
