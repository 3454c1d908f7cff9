"""Layouts, optimizer, loss and evaluation of the ResNet recipe.

A layout is a rules table: ``make_plan`` maps the model's logical axes (``batch``,
``conv_in``, ``conv_out``, ``classes``) to mesh axes and picks the ZeRO stage, so data
parallel, ZeRO-1/2/3 and channel-sharded runs share every other line.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit import explain
from shardkit.explain import shard_bytes

from ..common import schedules
from .config import Config
from .model import ResNet

_DATA_AXES = ("replica", "data", "fsdp")
OPTIMIZERS = ("sgd", "adamw")


def make_plan(mesh: Mesh, *, zero: int = 0, precision: str | sk.Precision = "fp32",
              channels: str | None = None) -> sk.Plan:
    """The plan for a ResNet on ``mesh``.

    The batch is split over the mesh's data-like axes (``replica``, ``data``, ``fsdp``), which
    ZeRO also shards state over. BatchNorm running statistics have no logical names (NNX's
    ``BatchStat`` carries none), so a path rule lays them out like their channels.

    Args:
        mesh: from ``sk.make_mesh``.
        zero: ZeRO stage 0 (data parallel) .. 3 (parameters sharded too).
        precision: ``"fp32"``, ``"bf16"`` or an ``sk.Precision``.
        channels: a mesh axis to shard every conv's output channels over (and the
            activations' channel dimension), e.g. ``"tensor"``; None replicates channels.

    Raises:
        ValueError: ``channels`` is not a mesh axis, or is one of the batch axes.
    """
    batch = tuple(a for a in mesh.axis_names if a in _DATA_AXES)
    if channels is not None:
        if channels not in mesh.axis_names:
            raise ValueError(f"channel axis {channels!r} is not in the mesh {dict(mesh.shape)}")
        if channels in batch:
            raise ValueError(f"channel axis {channels!r} already splits the batch; name a non-data axis such as 'tensor'")
    axis_rules = sk.AxisRules({"batch": batch, "conv_in": None, "conv_out": channels, "classes": None})
    rules = sk.PathRules([(r"(^|/)(mean|var)$", (channels,) if channels else ())])
    return sk.Plan(mesh, rules=rules, axis_rules=axis_rules, zero=zero, precision=precision, batch_axes=batch)


def decay_mask(params) -> dict:
    """True for weights that weight decay applies to: kernels, not BatchNorm scales or biases."""
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(name: str = "sgd", lr: float = 0.1, *, steps: int = 1000, weight_decay: float = 5e-4,
                   warmup: int | None = None, decay: str = "cosine", min_lr_ratio: float = 0.0,
                   no_decay: str | None = None) -> optax.GradientTransformation:
    """SGD with Nesterov momentum 0.9 or AdamW, linear warmup then (by default) cosine decay
    to zero (``models.common.schedules.Schedule``).

    Weight decay is masked to kernels (``decay_mask``, or the leaves whose path does not match
    the ``no_decay`` regex): decaying BatchNorm's scale and bias only fights the normalisation
    (Goyal et al. 2017, section 5.1).

    Raises:
        ValueError: an unknown optimizer name or a schedule setting out of range.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")
    if not lr > 0:
        raise ValueError(f"learning rate must be positive, got {lr!r}")
    warmup = max(1, steps // 10) if warmup is None else warmup
    schedule = schedules.Schedule(lr, max(steps, warmup + 1), warmup, decay, min_lr_ratio)()
    mask = decay_mask if no_decay is None else schedules.decay_mask(no_decay)
    if name == "adamw":
        return optax.adamw(schedule, weight_decay=weight_decay, mask=mask)
    return optax.chain(optax.add_decayed_weights(weight_decay, mask=mask),
                       optax.sgd(schedule, momentum=0.9, nesterov=True))


def loss_fn(model: ResNet, batch: dict) -> tuple[jax.Array, dict]:
    """Mean cross-entropy and accuracy; BatchNorm runs on (and updates from) the batch."""
    logits_BxK = model(batch["image"], train=True)
    labels_B = batch["label"]
    loss = optax.softmax_cross_entropy_with_integer_labels(logits_BxK, labels_B).mean()
    accuracy = (logits_BxK.argmax(-1) == labels_B).astype(jnp.float32).mean()
    return loss, {"accuracy": accuracy}


def make_step(plan: sk.Plan, optimizer: optax.GradientTransformation, *, microbatches: int = 1,
              clip_norm: float | None = None) -> sk.TrainStep:
    """The sharded train step (gradients clipped to global norm ``clip_norm`` when given). With
    ``microbatches > 1`` BatchNorm normalises each microbatch with that microbatch's (global)
    statistics, as gradient accumulation does everywhere."""
    return sk.train_step(plan, optimizer, microbatches=microbatches, clip_norm=clip_norm)(loss_fn)


def init_state(step: sk.TrainStep, cfg: Config, seed: int = 0) -> sk.TrainState:
    """A sharded ``TrainState``; the model is built under ``jit`` straight into its layout."""
    return step.init(lambda: ResNet(cfg, rngs=nnx.Rngs(seed)), seed=seed)


class Evaluator:
    """Test accuracy with BatchNorm's running averages, on the step's mesh and layout.

    Args:
        step: the initialised train step (its plan shards the eval batch).
        batch_size: images per eval call; rounded up to a multiple of the batch axes' size.
    """

    def __init__(self, step: sk.TrainStep, batch_size: int = 256):
        self.step, self.plan = step, step.plan
        n = self.plan.batch_size_multiple
        self.batch_size = max(n, math.ceil(batch_size / n) * n)
        self._fn: Callable | None = None

    def predict(self, state: sk.TrainState, images: np.ndarray) -> np.ndarray:
        """Class predictions for ``images`` (any count; the last call is padded)."""
        graphdef, variables = nnx.split(self.step.model(state))
        if self._fn is None:  # predictions replicated: every process reads them from its own devices
            self._fn = jax.jit(lambda v, x: nnx.merge(graphdef, v)(x, train=False).argmax(-1),
                               out_shardings=self.plan.sharding(P()))
        out = []
        for start in range(0, len(images), self.batch_size):
            x = images[start:start + self.batch_size]
            n = len(x)
            if n < self.batch_size:
                x = np.concatenate([x, np.zeros((self.batch_size - n,) + x.shape[1:], x.dtype)])
            x = jax.device_put(x, self.plan.batch_shardings(x))
            with self.plan.active():
                out.append(np.asarray(self._fn(variables, x).addressable_data(0))[:n])
        return np.concatenate(out) if out else np.zeros((0,), np.int32)

    def accuracy(self, state: sk.TrainState, images: np.ndarray, labels: np.ndarray) -> float:
        return float((self.predict(state, images) == labels).mean())


def state_bytes_per_device(state: sk.TrainState) -> dict[str, int]:
    """Persistent bytes one device holds, by part (``params``, ``opt_state``, ``model_state``),
    from each leaf's per-device shard shape."""
    return {part: shard_bytes(getattr(state, part)) for part in ("params", "opt_state", "model_state")}


def compiled_memory(step: sk.TrainStep, state: sk.TrainState, batch: dict) -> dict[str, int]:
    """Per-device memory of the compiled step (``peak``, ``temporaries``, ...: see
    ``shardkit.explain.compiled_memory``)."""
    return explain.compiled_memory(step.compile(state, batch))
