"""The output projection and cross-entropy without the whole logits: ``chunked_cross_entropy``.

A language model's loss multiplies the final hidden states (B, T, D) by the (V, D) output
matrix and takes a softmax over V. Written plainly, the (B·T, V) float32 logits and their
cotangent are whole in memory (at Llama 3's 128,256 vocabulary, 4 GiB per 8K-token sequence,
twice). Here the tokens go through in ``n`` chunks under a ``lax.scan`` with a custom VJP
(the approach of Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models",
and of Liger Kernel's fused linear cross-entropy, in plain JAX): the forward keeps only each
token's log-sum-exp; the backward recomputes one chunk's logits at a time, turns them into
``softmax - one_hot`` and contracts them at once into the hidden states' gradient and the
output matrix's (a float32 (V, D) accumulator). The chunks are strided over the sequence
(chunk i holds positions i, i+n, i+2n, ...), so a sequence split over a mesh axis stays split
in every chunk; a vocabulary split over a mesh axis (tensor-parallel output layer) stays split
too: the compiler reduces the log-sum-exp and the hidden-state gradient over it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .._vma import vary_like  # scan carries typed like the inputs inside a shard_map

F32 = jnp.float32


def label_logits(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """``logits[..., labels]`` along the last axis, as a masked sum instead of a gather.

    The same values, bit for bit (one term is the logit, the rest are zeros), and the same
    gradient. Why not ``take_along_axis``: a gather from logits split over two compiler-owned
    mesh axes (the sequence over ``context`` or the batch over ``expert``, the vocabulary over
    ``tensor``) inside a ``shard_map`` manual over another axis (``sk.pipeline``'s stages)
    aborts XLA's SPMD partitioner (jax 0.10.2: ``spmd_partitioner_util.cc:497``;
    ``docs/upstream/xla_partitioner_gather_two_auto_axes.py``). A masked sum is elementwise
    work and a reduction over the vocabulary, which the partitioner splits as it splits the
    log-sum-exp.
    """
    hit = lax.broadcasted_iota(labels.dtype, logits.shape, logits.ndim - 1) == labels[..., None]
    return jnp.sum(jnp.where(hit, logits, jnp.zeros((), logits.dtype)), axis=-1)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy per position, ``logsumexp(logits) - logits[labels]`` over the last
    axis (``optax.softmax_cross_entropy_with_integer_labels``'s values), with the label's logit
    picked by ``label_logits``: no gather, so it partitions inside ``sk.pipeline``'s stages on
    any mesh.

    Args:
        logits: ``(..., V)`` floats.
        labels: ``(...)`` integers in ``[0, V)``.

    Returns:
        ``(...)`` losses in the logits' dtype.

    Raises:
        ValueError: ``labels`` not shaped like ``logits`` without its last axis, or not integers.
    """
    if labels.shape != logits.shape[:-1] or not jnp.issubdtype(labels.dtype, jnp.integer):
        raise ValueError(f"cross_entropy: logits (..., V) and integer labels (...); got logits "
                         f"{tuple(logits.shape)} {logits.dtype}, labels {tuple(labels.shape)} {labels.dtype}")
    return jax.nn.logsumexp(logits, axis=-1) - label_logits(logits, labels)


def reference_cross_entropy(x_BxTxD: jax.Array, w_VxD: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """The plain form: whole float32 logits, then the mean softmax cross-entropy."""
    logits = jnp.einsum("btd,vd->btv", x_BxTxD, w_VxD, preferred_element_type=F32)
    return jnp.mean(cross_entropy(logits, targets_BxT))


def chunked_cross_entropy(x_BxTxD: jax.Array, w_VxD: jax.Array, targets_BxT: jax.Array, *,
                          chunk: int = 512) -> jax.Array:
    """Mean cross-entropy of ``softmax(x @ w.T)`` against integer ``targets``, computed in
    token chunks so that at most one chunk's (B, chunk, V) float32 logits exist at a time,
    forward and backward. Equal to ``reference_cross_entropy`` (and its gradients) up to float
    rounding.

    Args:
        x_BxTxD: final hidden states (any float dtype; the logits accumulate in float32).
        w_VxD: the output matrix (vocabulary rows).
        targets_BxT: integer labels in ``[0, V)``.
        chunk: positions per sequence per chunk (T is cut into ``ceil(T / chunk)`` strided
            chunks, padded with masked positions when they do not divide it).

    Returns:
        The scalar mean loss (float32).

    Raises:
        ValueError: shapes that do not line up, or ``chunk < 1``.
    """
    B, T, D = x_BxTxD.shape
    V = w_VxD.shape[0]
    if w_VxD.shape != (V, D) or targets_BxT.shape != (B, T):
        raise ValueError(f"chunked_cross_entropy: x (B, T, D), w (V, D), targets (B, T); got x "
                         f"{tuple(x_BxTxD.shape)}, w {tuple(w_VxD.shape)}, targets {tuple(targets_BxT.shape)}")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk={chunk!r} must be a positive int")
    n = -(-T // chunk)
    C = -(-T // n)  # positions per chunk; T padded to n * C

    def chunks(a):  # (B, T, ...) -> (n, B, C, ...): chunk i = positions i, i + n, ...
        a = jnp.pad(a, ((0, 0), (0, n * C - T)) + ((0, 0),) * (a.ndim - 2))
        return jnp.moveaxis(a.reshape((B, C, n) + a.shape[2:]), 2, 0)

    def unchunk(a):
        return jnp.moveaxis(a, 0, 2).reshape((B, n * C) + a.shape[3:])[:, :T]

    def valid():  # (n, 1, C): real positions (made inside the rules: no traced closures)
        return (jnp.arange(n * C).reshape(C, n).T < T)[:, None, :]

    def logits_of(xc, w):
        return jnp.einsum("bcd,vd->bcv", xc, w, preferred_element_type=F32)

    def forward(x, w, t):
        def step(total, xs):
            xc, tc, ok = xs
            logits = logits_of(xc, w)
            lse = jax.nn.logsumexp(logits, axis=-1)
            picked = label_logits(logits, tc)
            return total + jnp.sum(jnp.where(ok, lse - picked, 0.0)), lse

        total0 = vary_like(jnp.zeros((), F32), (x, w))
        total, lse = lax.scan(step, total0, (chunks(x), chunks(t), valid()))
        return total / (B * T), lse

    @jax.custom_vjp
    def loss(x, w, t):
        return forward(x, w, t)[0]

    def fwd(x, w, t):
        value, lse = forward(x, w, t)
        return value, (x, w, t, lse)

    def bwd(res, g):
        x, w, t, lse = res
        scale = g / (B * T)

        def step(dw, xs):
            xc, tc, ok, lse_c = xs
            p = jnp.exp(logits_of(xc, w) - lse_c[..., None])
            d_logits = (p - jax.nn.one_hot(tc, V, dtype=F32)) * jnp.where(ok, scale, 0.0)[..., None]
            dx = jnp.einsum("bcv,vd->bcd", d_logits.astype(w.dtype), w, preferred_element_type=F32)
            dw = dw + jnp.einsum("bcv,bcd->vd", d_logits.astype(xc.dtype), xc, preferred_element_type=F32)
            return dw, dx.astype(x.dtype)

        dw0 = vary_like(jnp.zeros(w.shape, F32), (x, w, g))
        dw, dx = lax.scan(step, dw0, (chunks(x), chunks(t), valid(), lse))
        return unchunk(dx), dw.astype(w.dtype), None

    loss.defvjp(fwd, bwd)
    # Named so the program reader takes its scans for chunks of one loss, not a recurrence
    # (``cost.program.flash``): forward and backward carry the scope in their name stacks.
    with jax.named_scope(CHUNKED_LOSS_SCOPE):
        return loss(x_BxTxD, w_VxD, targets_BxT)


CHUNKED_LOSS_SCOPE = "sk_chunked_cross_entropy"
