"""ResNet-18/50 in Flax NNX, written for sharded training.

* Kernels carry logical axis names (``conv_in``, ``conv_out``, ``classes``), so data
  parallelism, ZeRO-1/2/3 and channel sharding differ only in the ``AxisRules`` table
  (``models.resnet.train.make_plan``).
* BatchNorm statistics are batch means over ``(B, H, W)``. Under ``jax.jit`` with the batch
  sharded over the mesh, that mean is already a mean over the *global* batch: the SPMD
  partitioner inserts the all-reduce, so every layout computes the same numbers as one device
  (sync-BN without an ``axis_name``). The running averages are ``nnx.BatchStat`` variables:
  shardkit carries them in ``TrainState.model_state`` and checkpoints them with it.
* Convolutions run in the dtype of their (already cast) kernel and accumulate in f32, which
  is both what mixed precision wants and (asked for explicitly on XLA:CPU only) what keeps
  bf16 convolutions fast on CPU.

Blocks are a Python loop, not a ``lax.scan`` over stacked weights (the STYLE.md habit): the
four stages differ in shape and hold 2-6 identical blocks each (ResNet-18: one), so a scan
would save little compile time and cost readable per-layer paths (``layer3/1/conv2/kernel``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import shardkit as sk

from .config import Config

_he_normal = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")  # torchvision's init


class Conv(nnx.Module):
    """A bias-free 2-D convolution, NHWC x HWIO, symmetric ``k // 2`` padding."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, *, rngs: nnx.Rngs):
        self.stride, self.pad = stride, kernel // 2
        self.kernel = nnx.Param(_he_normal(rngs.params(), (kernel, kernel, c_in, c_out)),
                                out_sharding=(None, None, "conv_in", "conv_out"))

    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        k = self.kernel[...]
        # XLA:CPU is asked for the f32 result of a 16-bit convolution (its fast path, f32
        # sums) and it is cast back; cuDNN accumulates 16-bit convolutions in f32 by itself,
        # and asking it for an f32 result would double the bytes every convolution writes.
        cpu = sk.target_platform() == "cpu"
        y = jax.lax.conv_general_dilated(
            x_BxHxWxC.astype(k.dtype), k, (self.stride, self.stride), [(self.pad, self.pad)] * 2,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32 if cpu else None)
        return y.astype(k.dtype)


class BatchNorm(nnx.BatchNorm):
    """``nnx.BatchNorm`` over the channel axis, statistics in f32, output in the input dtype."""

    def __init__(self, c: int, cfg: Config, *, zero_init: bool = False, rngs: nnx.Rngs):
        super().__init__(
            c, momentum=cfg.bn_momentum, epsilon=cfg.bn_eps,
            scale_init=nnx.initializers.zeros if zero_init else nnx.initializers.ones,
            scale_metadata={"out_sharding": ("conv_out",)}, bias_metadata={"out_sharding": ("conv_out",)},
            rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        # The statistics are f32 variables, so BatchNorm promotes to f32; cast back after.
        return super().__call__(x, use_running_average=not train).astype(x.dtype)


class Basic(nnx.Module):
    """ResNet-18/34 block: 3x3 → 3x3, identity or 1x1 projection shortcut."""

    def __init__(self, c_in: int, width: int, stride: int, cfg: Config, *, rngs: nnx.Rngs):
        c_out = width
        self.conv1, self.bn1 = Conv(c_in, width, 3, stride, rngs=rngs), BatchNorm(width, cfg, rngs=rngs)
        self.conv2 = Conv(width, c_out, 3, rngs=rngs)
        self.bn2 = BatchNorm(c_out, cfg, zero_init=cfg.zero_init_residual, rngs=rngs)
        self.proj = Projection(c_in, c_out, stride, cfg, rngs=rngs) if stride != 1 or c_in != c_out else None

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = jax.nn.relu(self.bn1(self.conv1(x), train))
        y = self.bn2(self.conv2(y), train)
        return jax.nn.relu(y + (self.proj(x, train) if self.proj is not None else x))


class Bottleneck(nnx.Module):
    """ResNet-50/101/152 block: 1x1 → 3x3 (strided, v1.5) → 1x1 expanding 4x."""

    def __init__(self, c_in: int, width: int, stride: int, cfg: Config, *, rngs: nnx.Rngs):
        c_out = width * 4
        self.conv1, self.bn1 = Conv(c_in, width, 1, rngs=rngs), BatchNorm(width, cfg, rngs=rngs)
        self.conv2, self.bn2 = Conv(width, width, 3, stride, rngs=rngs), BatchNorm(width, cfg, rngs=rngs)
        self.conv3 = Conv(width, c_out, 1, rngs=rngs)
        self.bn3 = BatchNorm(c_out, cfg, zero_init=cfg.zero_init_residual, rngs=rngs)
        self.proj = Projection(c_in, c_out, stride, cfg, rngs=rngs) if stride != 1 or c_in != c_out else None

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        y = jax.nn.relu(self.bn1(self.conv1(x), train))
        y = jax.nn.relu(self.bn2(self.conv2(y), train))
        y = self.bn3(self.conv3(y), train)
        return jax.nn.relu(y + (self.proj(x, train) if self.proj is not None else x))


class Projection(nnx.Module):
    """The shortcut when shape changes: strided 1x1 conv + BatchNorm."""

    def __init__(self, c_in: int, c_out: int, stride: int, cfg: Config, *, rngs: nnx.Rngs):
        self.conv, self.bn = Conv(c_in, c_out, 1, stride, rngs=rngs), BatchNorm(c_out, cfg, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        return self.bn(self.conv(x), train)


class Stem(nnx.Module):
    """CIFAR stem (3x3/1) for small images, ImageNet stem (7x7/2 + max-pool 3x3/2) for 224x224."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        c = cfg.stage_width(0)
        self.pool = cfg.stem == "imagenet"
        self.conv = Conv(cfg.in_channels, c, 7 if self.pool else 3, 2 if self.pool else 1, rngs=rngs)
        self.bn = BatchNorm(c, cfg, rngs=rngs)

    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = jax.nn.relu(self.bn(self.conv(x), train))
        if self.pool:
            x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        return x


class Head(nnx.Module):
    """Global average pool → linear classifier, logits in f32."""

    def __init__(self, c_in: int, num_classes: int, *, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (c_in, num_classes)),
                                out_sharding=("conv_in", "classes"))
        self.bias = nnx.Param(jnp.zeros((num_classes,)), out_sharding=("classes",))

    def __call__(self, x_BxHxWxC: jax.Array) -> jax.Array:
        k = self.kernel[...]
        pooled_BxC = x_BxHxWxC.astype(jnp.float32).mean(axis=(1, 2)).astype(k.dtype)
        logits_BxK = jnp.dot(pooled_BxC, k, preferred_element_type=jnp.float32)
        return logits_BxK + self.bias[...].astype(jnp.float32)[None, :]


class ResNet(nnx.Module):
    """ResNet-18/34/50/101/152 (``Config.depth``) for NHWC images.

    Paths follow torchvision (``stem``, ``layer1`` .. ``layer4``, ``head``), so a rule like
    ``layer4/.*/conv2/kernel`` reads the way the architecture does.

    Args:
        cfg: the model's shape.
        rngs: ``nnx.Rngs`` with a ``params`` stream.
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # The names on the variables are logical ones for shardkit's AxisRules, not mesh axes:
        # keep Flax from trying to shard them eagerly (it would fail outside a matching mesh).
        with nnx.use_eager_sharding(False):
            self.stem = Stem(cfg, rngs=rngs)
            block = Bottleneck if cfg.block == "bottleneck" else Basic
            c_in = cfg.stage_width(0)
            for i, n in enumerate(cfg.stage_sizes):
                width = cfg.stage_width(i)
                blocks = []
                for j in range(n):
                    stride = 2 if i > 0 and j == 0 else 1
                    blocks.append(block(c_in, width, stride, cfg, rngs=rngs))
                    c_in = width * cfg.expansion
                setattr(self, f"layer{i + 1}", nnx.List(blocks))
            self.head = Head(c_in, cfg.num_classes, rngs=rngs)

    def __call__(self, images_BxHxWxC: jax.Array, train: bool = False) -> jax.Array:
        """Logits ``(B, num_classes)`` in f32.

        Args:
            images_BxHxWxC: a batch of normalised images.
            train: normalise with (and update the running averages from) the batch's
                statistics; otherwise use the running averages.
        """
        if images_BxHxWxC.ndim != 4 or images_BxHxWxC.shape[-1] != self.cfg.in_channels:
            raise ValueError(f"ResNet expects (batch, height, width, {self.cfg.in_channels}) images, "
                             f"got shape {images_BxHxWxC.shape}")
        x = sk.constrain(self.stem(images_BxHxWxC, train), ("batch", None, None, "conv_out"))
        for i in range(len(self.cfg.stage_sizes)):
            for blk in getattr(self, f"layer{i + 1}"):
                x = sk.constrain(blk(x, train), ("batch", None, None, "conv_out"))
        return self.head(x)


def param_count(model: nnx.Module) -> int:
    """Number of trainable parameters (Ψ in the ZeRO paper, Rajbhandari et al. 2020)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
