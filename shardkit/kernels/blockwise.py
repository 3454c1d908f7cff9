"""Attention in plain JAX: the (T, T) reference, and the blockwise (flash-style) form that is
the CPU path of ``sk.attention`` and the fallback where a target's kernel does not fit.

The blockwise form scans over key/value blocks with an online softmax in float32 (Milakov &
Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2022,
"FlashAttention"): a running max, sum and numerator per query, rescaled as each block comes
in. Its backward pass (a custom VJP) recomputes each block's probabilities from the saved
log-sum-exp, as FlashAttention's does (the output and log-sum-exp named for a names policy to
keep, ``kept.py``), so forward and backward hold (T, block) scores per head,
never (T, T). Shapes: q (B, T, H, Q); k, v (B, S, K, Q) with H a multiple of K (grouped-query:
query head h reads kv head h // (H/K)).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .._vma import vary_like  # scan carries typed like the inputs inside a shard_map
from .kept import kept_output, kept_stats

F32 = jnp.float32
_NEG = -1e30  # a finite "minus infinity": masked scores never make exp(-inf + inf) = NaN


def visible(q_pos: jax.Array, k_pos: jax.Array, causal: bool, window: int | None) -> jax.Array | None:
    """(Tq, Tk) bool: which keys each query may attend to (None: all of them). ``window``
    keeps keys less than ``window`` positions away (behind only, when causal)."""
    d = q_pos[:, None] - k_pos[None, :]
    mask = (d >= 0) if causal else None
    if window is not None:
        near = (d < window) & (d > -window)
        mask = near if mask is None else mask & near
    return mask


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                        window: int | None = None, scale: float | None = None) -> jax.Array:
    """Plain softmax attention: the whole (T, S) f32 score matrix, softmax, then values. The
    form every kernel is tested against. Result (B, T, H, Q) in q's dtype."""
    B, T, H, Q = q.shape
    K = k.shape[2]
    scale = 1.0 / math.sqrt(Q) if scale is None else scale
    q5 = q.reshape(B, T, K, H // K, Q)
    s = jnp.einsum("btkgq,bskq->bkgts", q5, k, preferred_element_type=F32) * scale
    mask = visible(jnp.arange(T), jnp.arange(k.shape[1]), causal, window)
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgts,bskq->btkgq", p.astype(v.dtype), v, preferred_element_type=F32)
    return o.reshape(B, T, H, Q).astype(q.dtype)


def block_grads(p, q5, do5, kb, vb, delta, scale: float):
    """One (query block, key/value block) pair's share of FlashAttention's backward (Dao et
    al. 2022, alg. 4) from its probabilities ``p`` (B, Tq, K, G, Tk) float32, rebuilt from the
    saved log-sum-exp and masked: ``(dq, dk, dv)`` float32, dq (B, Tq, K, G, Q) to add to the
    queries' gradient, dk and dv (B, Tk, K, Q) the block's. ``delta`` (B, Tq, K, G) is
    rowsum(dO * O). Shared by this backward, the context ring's and its XLA:TPU nested form."""
    dv = jnp.einsum("btkgs,btkgq->bskq", p.astype(do5.dtype), do5, preferred_element_type=F32)
    dp = jnp.einsum("btkgq,bskq->btkgs", do5, vb, preferred_element_type=F32)
    ds = p * (dp - delta[..., None]) * scale
    dq = jnp.einsum("btkgs,bskq->btkgq", ds.astype(kb.dtype), kb, preferred_element_type=F32)
    dk = jnp.einsum("btkgs,btkgq->bskq", ds.astype(q5.dtype), q5, preferred_element_type=F32)
    return dq, dk, dv


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                        window: int | None = None, scale: float | None = None,
                        block: int = 512) -> jax.Array:
    """Softmax attention scanned over key/value blocks of ``block`` positions (the last one
    padded and masked when ``block`` does not divide S); equal to ``reference_attention`` up
    to float rounding, holding (T, block) scores per head in forward and backward."""
    B, T, H, Q = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(Q) if scale is None else scale
    block = min(block, S)
    n = -(-S // block)

    def blocks(a):  # (B, S, K, Q) -> (n, B, block, K, Q), padded past S
        a = jnp.pad(a, ((0, 0), (0, n * block - S), (0, 0), (0, 0)))
        return jnp.moveaxis(a.reshape(B, n, block, K, Q), 1, 0)

    def unblock(a):
        return jnp.moveaxis(a, 0, 1).reshape(B, n * block, K, Q)[:, :S]

    # Positions are made inside the rules: a custom VJP's rules may not close over traced values.
    def xs(k, v):
        return blocks(k), blocks(v), jnp.arange(n * block).reshape(n, block)

    def mask_of(kp):  # (1, T, 1, 1, block)
        m = visible(jnp.arange(T), kp, causal, window)
        pad = kp < S
        m = pad[None, :] if m is None else m & pad[None, :]
        return m[None, :, None, None, :]

    def scores(q5, kb, kp):
        s = jnp.einsum("btkgq,bskq->btkgs", q5, kb, preferred_element_type=F32) * scale
        return s, mask_of(kp)

    def forward(q, k, v):
        q5 = q.reshape(B, T, K, H // K, Q)

        def step(state, x):
            m, l, acc = state
            kb, vb, kp = x
            s, mask = scores(q5, kb, kp)
            s = jnp.where(mask, s, _NEG)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            corr = jnp.exp(m - m_new)
            acc = acc * corr[..., None] + jnp.einsum("btkgs,bskq->btkgq", p.astype(vb.dtype), vb,
                                                     preferred_element_type=F32)
            return (m_new, l * corr + p.sum(-1), acc), None

        m0 = jnp.full(q5.shape[:-1], _NEG, F32)
        init = vary_like((m0, jnp.zeros_like(m0), jnp.zeros(q5.shape, F32)), (q, k, v))
        (m, l, acc), _ = lax.scan(step, init, xs(k, v))
        l_safe = jnp.where(l > 0, l, 1.0)
        return acc / l_safe[..., None], m + jnp.log(l_safe)  # (B, T, K, G, Q), (B, T, K, G)

    @jax.custom_vjp
    def attend(q, k, v):
        return kept_output(forward(q, k, v)[0].reshape(B, T, H, Q).astype(q.dtype))

    # The residual is the output returned (q's dtype), named, not a float32 copy: a names
    # policy keeps one buffer for this backward and the caller's next matmul (kept.py).
    def fwd(q, k, v):
        out5, lse = forward(q, k, v)
        out = kept_output(out5.reshape(B, T, H, Q).astype(q.dtype))
        return out, (q, k, v, out, kept_stats(lse))

    def bwd(res, dout):
        q, k, v, out, lse = res
        q5, do5 = q.reshape(B, T, K, H // K, Q), dout.reshape(B, T, K, H // K, Q)
        delta = jnp.sum(do5.astype(F32) * out.reshape(B, T, K, H // K, Q).astype(F32), axis=-1)

        def step(dq, x):
            kb, vb, kp = x
            s, mask = scores(q5, kb, kp)
            p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
            dq_b, dk, dv = block_grads(p, q5, do5, kb, vb, delta, scale)
            return dq + dq_b, (dk, dv)

        dq0 = vary_like(jnp.zeros(q5.shape, F32), (q, k, v, dout))
        dq, (dk, dv) = lax.scan(step, dq0, xs(k, v))
        return (dq.reshape(B, T, H, Q).astype(q.dtype), unblock(dk).astype(k.dtype),
                unblock(dv).astype(v.dtype))

    attend.defvjp(fwd, bwd)
    return attend(q, k, v)
