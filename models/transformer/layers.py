"""The recipe transformer's building blocks: named weights and matmuls, RMSNorm, and the
layout constraints of a tensor-parallel region (Megatron's sequence-parallel gathers).

Shape letters as in ``models.transformer.model``: B batch, T sequence, D d_model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import shardkit as sk

from .config import Config

F32 = jnp.float32


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Activation layout by logical names (``sk.constrain``: a no-op outside a shardkit step;
    inside ``sk.pipeline``'s stages only the compiler-managed axes are constrained)."""
    return sk.constrain(x, names)


def gather_region_input(x_BxTxD: jax.Array) -> jax.Array:
    """A tensor-parallel region's input whole over ``tensor``: under sequence parallelism the
    residual stream arrives split over the sequence, and Megatron gathers it once per region
    (Korthikanti et al. 2022, sec. 4.2.2: the all-gather ``g``), not once per matmul that reads
    it — XLA's partitioner, left to itself, gathers it for each of q, k, v (gate, up) in the
    forward and again for each weight gradient in the backward. Without sequence parallelism
    the input is already whole over ``tensor`` and this is the layout it has. The norm's output
    is held split first: otherwise XLA moves the gather above the norm's cast and gathers its
    f32 value (twice the bytes, measured on XLA:GPU)."""
    x_BxTxD = constrain(x_BxTxD, ("batch", "seq", None))
    return constrain(x_BxTxD, ("batch", "context", None))


@jax.custom_vjp
def gather_output_gradient(y_BxTxD: jax.Array) -> jax.Array:
    """The identity on a region's (row-parallel) output whose gradient, in the backward, is
    gathered whole over ``tensor`` once: under sequence parallelism it arrives split over the
    sequence, and both matmuls of the region's last weight read it (its input gradient and its
    weight gradient). Megatron gathers it once (the transpose of the forward's
    reduce-scatter); XLA's partitioner, left to itself, gathers it for each."""
    return y_BxTxD


def _gather_output_gradient_fwd(y_BxTxD):
    return y_BxTxD, None


def _gather_output_gradient_bwd(_, g_BxTxD):
    return (constrain(g_BxTxD, ("batch", "context", None)),)


gather_output_gradient.defvjp(_gather_output_gradient_fwd, _gather_output_gradient_bwd)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str, ...], std: float | None):
    init = nnx.initializers.ones if std is None else nnx.initializers.normal(std)
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape, F32))


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum in the inputs' dtype, accumulating in f32. XLA:GPU/TPU accumulate 16-bit dots
    in f32 by default and write the 16-bit result; XLA:CPU is asked for the f32 result
    (``preferred_element_type``: its fast bf16 path, exact f32 sums), then it is cast back.
    Asking a GPU for it would make every matmul write f32 and add a convert pass."""
    if sk.target_platform() == "cpu":
        return jnp.einsum(spec, a, b, preferred_element_type=F32).astype(a.dtype)
    return jnp.einsum(spec, a, b)


class Dots(nnx.Module):
    """A layer's named weight matmuls: ``_dot`` (compute dtype), or with ``cfg.fp8`` one
    ``sk.fp8.Fp8Dot`` each, holding that matmul's amax histories."""

    def __init__(self, cfg: Config, names: tuple[str, ...]):
        self.fp8 = cfg.fp8
        for name in names if cfg.fp8 else ():
            setattr(self, name, sk.fp8.Fp8Dot())

    def __call__(self, name: str, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        return getattr(self, name)(spec, x, w) if self.fp8 else _dot(spec, x, w)


class RMSNorm(nnx.Module):
    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.scale = _param(rngs, (cfg.d_model,), ("embed",), None)
        self.eps = cfg.norm_eps

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        return rms_norm(x_BxTxD, self.scale[...], self.eps)


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, result in the input's dtype."""
    x = x_BxTxD.astype(F32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * scale_D.astype(F32)[None, None, :]).astype(x_BxTxD.dtype)
