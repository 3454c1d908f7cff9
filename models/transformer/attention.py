"""The recipe transformer's causal self-attention: rotary positions, grouped-query heads, the
attention kernels it can run (reference, XLA's, the flash kernels of ``sk.attention``) and
context parallelism when the mesh has a ``context`` axis.

Shape letters: B batch, T sequence, D d_model, H heads, K kv heads, G = H/K, Q head_dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import shardkit as sk

from .config import Config
from .layers import F32, Dots, _dot, _param, constrain, gather_output_gradient, gather_region_input


def rotary(T: int, Q: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables of shape (T, Q/2) for positions 0..T-1."""
    inv_freq = theta ** (-jnp.arange(0, Q, 2, dtype=F32) / Q)
    angle_TxQ2 = jnp.arange(T, dtype=F32)[:, None] * inv_freq[None, :]
    return jnp.cos(angle_TxQ2), jnp.sin(angle_TxQ2)


def apply_rotary(x_BxTxNxQ: jax.Array, cos_TxQ2: jax.Array, sin_TxQ2: jax.Array) -> jax.Array:
    """Rotates channel pairs (i, i + Q/2) by position-dependent angles (GPT-NeoX layout)."""
    x1, x2 = jnp.split(x_BxTxNxQ.astype(F32), 2, axis=-1)
    cos, sin = cos_TxQ2[None, :, None, :], sin_TxQ2[None, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxTxNxQ.dtype)


class Attention(nnx.Module):
    """Causal self-attention; heads split Megatron-style (q/k/v by heads, o by rows)."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        D, H, K, Q = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
        out_std = cfg.init_std / math.sqrt(2 * cfg.layers)
        self.q = _param(rngs, (D, H, Q), ("embed", "heads", "head_dim"), cfg.init_std)
        self.k = _param(rngs, (D, K, Q), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.v = _param(rngs, (D, K, Q), ("embed", "kv_heads", "head_dim"), cfg.init_std)
        self.o = _param(rngs, (H, Q, D), ("heads", "head_dim", "embed"), out_std)
        self.attention = cfg.attention
        self.context_strategy = cfg.context_strategy
        self.dots = Dots(cfg, ("q", "k", "v", "o"))

    def __call__(self, x_BxTxD, cos_TxQ2, sin_TxQ2):
        x_BxTxD = gather_region_input(x_BxTxD)
        q_BxTxHxQ = self.dots("q", "btd,dhq->bthq", x_BxTxD, self.q[...])
        k_BxTxKxQ = self.dots("k", "btd,dkq->btkq", x_BxTxD, self.k[...])
        v_BxTxKxQ = self.dots("v", "btd,dkq->btkq", x_BxTxD, self.v[...])
        q_BxTxHxQ = constrain(q_BxTxHxQ, ("batch", "context", "heads", None))
        k_BxTxKxQ = constrain(k_BxTxKxQ, ("batch", "context", "kv_heads", None))
        v_BxTxKxQ = constrain(v_BxTxKxQ, ("batch", "context", "kv_heads", None))
        # Named for keep="lean" / remat="lean" (sk.LEAN_RESIDUALS): what only a matmul gives again.
        q_BxTxHxQ = checkpoint_name(apply_rotary(q_BxTxHxQ, cos_TxQ2, sin_TxQ2), "attention_q")
        k_BxTxKxQ = checkpoint_name(apply_rotary(k_BxTxKxQ, cos_TxQ2, sin_TxQ2), "attention_k")
        v_BxTxKxQ = checkpoint_name(v_BxTxKxQ, "attention_v")

        if context_size() > 1:  # the sequence stays split: attention over "context"
            # the loss put the batch in sk.context_shard's zig-zag order (_context_order)
            o_BxTxHxQ = sk.context_attention(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ, causal=True, order="zigzag",
                                             strategy=self.context_strategy)
        else:
            o_BxTxHxQ = causal_attention(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ, self.attention)
        # Named "attention_out" by the attention that computed it (sk.attention's and
        # sk.context_attention's kernels keep that same value for their backward): not again.
        o_BxTxHxQ = constrain(o_BxTxHxQ, ("batch", "context", "heads", None))
        return gather_output_gradient(self.dots("o", "bthq,hqd->btd", o_BxTxHxQ, self.o[...]))


def context_size() -> int:
    """The size of the ``context`` axis of the mesh being traced for (1 without one)."""
    return dict(jax.sharding.get_abstract_mesh().shape).get("context", 1)


def attention_impl(choice: str, dtype, q_shape: tuple[int, ...] | None = None) -> str:
    """The attention that runs for ``Config.attention`` in ``dtype`` on the platform being
    compiled for: ``"reference"`` (``reference_attention``), ``"xla"``
    (``jax.nn.dot_product_attention``'s), or one of ``sk.attention``'s kernels (``"cudnn"``,
    ``"triton"``, ``"mosaic"``, ``"blockwise"``). ``"auto"`` takes the target's flash kernel
    (``sk.kernels.attention_implementation``: cuDNN on a GPU in 16-bit, Pallas Triton in a
    deviceless GPU compile or in f32, Pallas Mosaic on TPU; the blockwise form where the
    kernel does not take ``q_shape``) and the reference on CPU (XLA:CPU has no fused kernel;
    at CPU sizes the plain form is the cheaper program)."""
    if choice != "auto":
        return choice
    if sk.target_platform() == "cpu":
        return "reference"
    if q_shape is None:  # the kernel the platform has, before any shape check (a shape every kernel takes)
        return sk.kernels.attention_implementation((1, 128, 1, 64), dtype, causal=True).implementation
    return sk.kernels.attention_implementation(q_shape, dtype, causal=True).implementation


def causal_attention(q_BxTxHxQ: jax.Array, k_BxTxKxQ: jax.Array, v_BxTxKxQ: jax.Array,
                     impl: str = "reference") -> jax.Array:
    """Causal softmax attention with grouped-query heads (H a multiple of K), scaled by
    1/sqrt(Q); ``impl`` a ``Config.attention`` choice (``"auto"`` as ``attention_impl``
    says). Result (B, T, H, Q) in the inputs' dtype, named ``"attention_out"``."""
    if impl == "auto" and sk.target_platform() == "cpu":
        impl = "reference"
    # Result named "attention_out" (sk.LEAN_RESIDUALS), as sk.attention names its kernels'.
    if impl == "reference":
        return checkpoint_name(reference_attention(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ), "attention_out")
    if impl == "xla":  # XLA's masks the (T, T) scores like the reference
        return checkpoint_name(jax.nn.dot_product_attention(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ, is_causal=True,
                                                            implementation="xla"), "attention_out")
    # The flash kernels (and "auto": sk.attention picks, and says why when it falls back).
    return sk.attention(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ, causal=True, implementation=impl)


def reference_attention(q_BxTxHxQ: jax.Array, k_BxTxKxQ: jax.Array, v_BxTxKxQ: jax.Array) -> jax.Array:
    """The plain jnp path: f32 scores and softmax, matmuls accumulating in f32."""
    B, T, H, Q = q_BxTxHxQ.shape
    Kh = k_BxTxKxQ.shape[2]
    # Grouped-query: head h = kv*G + g reads kv head kv, so a split of H into
    # contiguous chunks lines up with the same split of K.
    q_BxTxKxGxQ = q_BxTxHxQ.reshape(B, T, Kh, H // Kh, Q) * jnp.asarray(
        1.0 / math.sqrt(Q), q_BxTxHxQ.dtype)
    s_BxKxGxTxS = jnp.einsum("btkgq,bskq->bkgts", q_BxTxKxGxQ, k_BxTxKxQ,
                             preferred_element_type=F32)
    causal_TxS = jnp.tril(jnp.ones((T, k_BxTxKxQ.shape[1]), dtype=bool))
    s_BxKxGxTxS = jnp.where(causal_TxS[None, None, None], s_BxKxGxTxS, jnp.finfo(F32).min)
    p_BxKxGxTxS = jax.nn.softmax(s_BxKxGxTxS, axis=-1).astype(v_BxTxKxQ.dtype)
    o_BxTxKxGxQ = _dot("bkgts,bskq->btkgq", p_BxKxGxTxS, v_BxTxKxQ)
    return o_BxTxKxGxQ.reshape(B, T, H, Q)
