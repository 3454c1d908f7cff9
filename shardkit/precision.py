"""Mixed-precision policy: which dtype each kind of array lives in, and fp16 loss scaling."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of a training run.

    Matmuls in a 16-bit compute dtype accumulate in f32: XLA does so on GPUs and TPUs by
    default (and writes the 16-bit result); XLA:CPU needs ``preferred_element_type=jnp.float32``
    on the dot, then a cast back. The recipes ask for it only where ``sk.target_platform()``
    is ``"cpu"``: on a GPU it would make every matmul write f32.

    Attributes:
        params: master parameters (what the optimizer updates and checkpoints hold).
        compute: parameters and float inputs are cast to this before the loss runs.
        grads: gradients are taken, reduced and accumulated in this dtype.
        opt_state: floating optimizer state (Adam moments).
        output: loss and float metrics.
        loss_scaling: dynamic loss scaling (for fp16): scale the loss up, unscale the
            gradients, skip steps whose gradients are not finite.
        init_scale, growth_interval, growth_factor, backoff_factor: the dynamic scale's knobs.
        fp8: the model's dense matmuls run in fp8 (``sk.fp8.Fp8Dot``: E4M3 forward, E5M2
            gradients, delayed scaling); the ``"fp8"`` preset is ``"bf16"`` with this on. The
            step cannot rewrite a model's matmuls: the model uses ``sk.fp8`` where this is on.
            Compiling for a target without fp8 matmuls (A100, TPU v5p) is refused.
    """

    params: Any = jnp.float32
    compute: Any = jnp.float32
    grads: Any = jnp.float32
    opt_state: Any = jnp.float32
    output: Any = jnp.float32
    loss_scaling: bool = False
    init_scale: float = 2.0 ** 15
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    fp8: bool = False

    PRESETS = ("fp32", "bf16", "bf16-pure", "fp16", "fp8")

    @classmethod
    def preset(cls, name: str) -> "Precision":
        """``"fp32"``, ``"bf16"`` (f32 master, bf16 compute), ``"bf16-pure"``, ``"fp16"``,
        ``"fp8"`` (``"bf16"`` with fp8 matmuls: ``sk.fp8``)."""
        f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
        table = {
            "fp32": cls(),
            "bf16": cls(compute=bf16),
            "bf16-pure": cls(params=bf16, compute=bf16, grads=bf16, opt_state=bf16, output=f32),
            "fp16": cls(compute=f16, loss_scaling=True),
            "fp8": cls(compute=bf16, fp8=True),
        }
        if name not in table:
            raise ValueError(f"unknown precision {name!r}; choose one of {list(table)} or pass sk.Precision(...)")
        del f32
        return table[name]

    @classmethod
    def resolve(cls, p: "Precision | str | None") -> "Precision":
        if p is None:
            return cls()
        if isinstance(p, Precision):
            return p
        if isinstance(p, str):
            return cls.preset(p)
        raise ValueError(f"precision must be a preset name {cls.PRESETS} or sk.Precision, got {p!r}")

    @property
    def name(self) -> str:
        for n in self.PRESETS:
            if Precision.preset(n) == self:
                return n
        return "custom"


def cast_floats(tree, dtype):
    """Casts floating leaves of ``tree`` to ``dtype``; integers, bools and keys pass through."""
    def one(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x
    return jax.tree.map(one, tree)


def cast_like(tree, like):
    """Casts each floating leaf of ``tree`` back to the dtype of the matching leaf in ``like``."""
    def one(x, ref):
        if hasattr(x, "dtype") and x.dtype != ref.dtype and jnp.issubdtype(ref.dtype, jnp.floating):
            return x.astype(ref.dtype)
        return x
    return jax.tree.map(one, tree, like)


def cast_input(x):
    """Host inputs: float64 NumPy arrays become float32 (JAX's default), others pass through."""
    if isinstance(x, np.ndarray) and x.dtype == np.float64:
        return x.astype(np.float32)
    return x


@struct.dataclass
class LossScale:
    """Dynamic loss scale state (fp16): current scale and the count of finite steps since growth."""

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def create(cls, p: Precision) -> "LossScale":
        return cls(jnp.asarray(p.init_scale, jnp.float32), jnp.zeros((), jnp.int32))

    def adjust(self, finite: jax.Array, p: Precision) -> "LossScale":
        """Grows the scale after ``growth_interval`` finite steps; backs off on a non-finite one."""
        grow = self.good_steps + 1 >= p.growth_interval
        scale = jnp.where(finite, jnp.where(grow, self.scale * p.growth_factor, self.scale),
                          jnp.maximum(self.scale * p.backoff_factor, 1.0))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0)
        return LossScale(scale.astype(jnp.float32), good.astype(jnp.int32))
