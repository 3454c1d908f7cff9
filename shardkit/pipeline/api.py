"""Pipeline parallelism over one mesh axis: GPipe, circular, 1F1B, interleaved 1F1B, ZB-H1, ZB-V.

``pipeline(stage_fn, stage_params, x, microbatches=m, schedule=...)`` applies a stack of ``L``
identical layers (``stage_params`` leaves carry a leading ``L`` dimension) to ``x``, with the
layers split over the ``pipe`` axis and the batch split into ``m`` microbatches. The result
always equals the un-pipelined ``for l in range(L): x = stage_fn(params[l], x)``.

How it runs: a ``jax.shard_map`` that is manual over the pipe axis and the *data axes* (the
batch axes among ``replica``/``data``/``fsdp``: ``batch_axes=``, by default the active plan's),
while ``tensor`` (and any other axis) stays under the compiler, so TP inside a stage works as
before. Every schedule
is a numpy table (``schedules``) with one row per tick; a ``lax.scan`` walks the rows,
each device reads its own column, runs its layer group through ``lax.cond``/``lax.switch`` (an
idle device skips the compute) and hands activations on with ``lax.ppermute``.

* **GPipe** and **circular**: the forward schedule is scanned, the backward comes from
  autodiff (all forwards, then all backwards; every microbatch's residuals stay alive).
  Circular with ``repeats=v`` gives device ``s`` the layer groups ``s, s+p, s+2p, ...``; an
  activation leaving the last stage loops back to stage 0 for the next group. Microbatch ``i``
  is the rows ``i, i+m, i+2m, ...`` of the batch, so a batch sharded over data axes stays
  sharded inside every microbatch.
* **1F1B**, **interleaved 1F1B** (``repeats=v`` chunks per device, Narayanan et al. 2021),
  **ZB-H1** (Qi et al., ICLR 2024: backward split into an input-gradient op B and a
  weight-gradient op W that fills the bubble) and **ZB-V** (Qi et al. 2024: two chunks per
  device in a V): a ``jax.custom_vjp`` whose forward runs the
  whole table (``sk.pipeline_schedule``: forwards, per-microbatch loss on the last layer
  group, backward ops through explicit per-chunk ``jax.vjp``s that recompute the chunk from
  its saved input — ZB's B once, keeping what W reads, ``split``; see ``explicit``) and returns the gradients as residuals; the custom
  backward only scales them by the incoming cotangent. Stage inputs and waiting cotangents sit
  in ring buffers sized from the table, whatever ``m``. Without differentiation the primal
  runs GPipe / circular. Gradients never flow to ``extras`` or ``targets``.

Why the data axes are manual: a stage's weight gradient is produced on every tick (GPipe,
circular) or every backward op (explicit schedules). With data compiler-managed, XLA all-reduces it over data
right where it is produced, inside the loop: ~m times the traffic of a data-parallel step.
Manual data axes give each device its own rows of every microbatch (``in_specs``
``P(None, data)`` on the microbatch rows) and the parameters replicated over data (ZeRO-1/2
params are; ZeRO-3 shards are all-gathered by XLA at the shard_map boundary, once per step).
The gradients then stay local in the loop and are reduced over data once, after it:

* GPipe / circular: the body casts the stage weights to data-varying (``lax.pcast(...,
  to="varying")``) once, before the scan; autodiff transposes that cast into ONE ``psum``
  over data after the backward scan. (Left implicit, the cast would sit at the point of use,
  inside the tick, and the psum with it.) The loss is computed outside the shard_map on the
  merged output, so any ``loss_fn`` stays exact.
* Explicit schedules: the custom_vjp forward accumulates local gradients over the scan and ``psum``s them
  over data once. ``loss_fn`` runs on a device's rows of a microbatch, so it must be a mean
  over the microbatch rows (as MSE / cross-entropy means are): the global loss is then the
  mean of the local ones, and the backward seeds every local loss with ``1 / (m · n_data)``.

Several compiler-owned axes beside the pipe axis (``pipe × context × tensor``, ``pipe × expert
× tensor``) compile with every schedule. XLA's partitioner (jax 0.10.2) aborts on a *gather*
there whose operand is split over two of them (``docs/upstream/
xla_partitioner_gather_two_auto_axes.py``): shardkit's own blocks avoid it
(``sk.kernels.cross_entropy`` picks the label's logit without one; ``sk.moe`` nested in a stage
keeps its slot buffers and its routing whole). Keep a stage's activations constrained (``sk.constrain``, as the
recipe's layers are): left free, XLA may move them between the two axes with a
collective-permute inside the explicit schedules' per-stage branch, which the other stages never
reach, and the program hangs (``docs/upstream/xla_partitioner_two_auto_axes.py``).

Dropout-like layers (``rng``) keep the data axes compiler-managed (the old behaviour and the
old traffic): a key drawn on a device's rows only would not reproduce the un-sharded masks.

Memory: autodiff of the tick loop saves activations only. A layer group's weights are its layer
scan's ``xs`` and ops that only move or re-type data (slices, reshapes, transposes, casts) are
recomputed in the backward rather than saved, so nothing derived from the weights — circular's
per-tick slice of its group included — is kept once per tick. A layer that checkpoints itself
(``jax.checkpoint``, a recipe's ``remat="full"``) is not wrapped again (``stage.with_remat``).
The explicit schedules trade compute for memory as ``keep=`` says: with ``"input"`` (the
default) a backward op recomputes its chunk's forward (4/3 of the layers' flops,
``cost.analytic.pipeline_cost.recompute_factor``) and only one microbatch's residuals are alive at a time;
with ``"all"`` or a checkpoint policy each in-flight chunk-microbatch keeps its residuals (or
the policy's saved set) from its F to its B/BW (``keep``) — but ZB's pending W's, each holding what its W reads
(``Schedule.pending_w``).

Bubble fractions of the tables (``bench/pipeline.py`` checks them; ``Schedule.formula_bubble``):
GPipe and 1F1B (p-1)/(m+p-1) (1F1B counted in forward/backward slots of equal length), circular
and interleaved 1F1B (p-1)/(v·m+p-1), ZB-H1 (p-1)/(3m+p-1) in unit F = B = W slots, ZB-V
(p-1)/(6m+p-1) in its half-stage slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..mesh import vmapped_axes
from .._axes import claim_axes
from ..plan import note, noting
from .explicit import explicit_pipeline, kept_shapes
from .forward import forward
from .keep import Kept, check_named, keep_policy
from .schedules import EXPLICIT, SCHEDULES, SPLIT, check_schedule, pipeline_schedule
from .order import LAYER_ORDERS
from .split import SplitBackward
from .stage import (REMAT, chunk_backward, chunk_runner, layer_facts, layer_runner, mean_loss, merge, split,
                    stage_residuals, with_remat)

_BATCH_AXES = ("replica", "data", "fsdp")  # as Plan's default batch axes


def pipeline(stage_fn: Callable[..., jax.Array], stage_params: Any, x: jax.Array, *,
             microbatches: int, schedule: str = "gpipe", repeats: int = 1, axis: str = "pipe",
             loss_fn: Callable[..., jax.Array] | None = None, loss_params: Any = None,
             targets: Any = None, extras: Any = None, rng: jax.Array | None = None,
             remat: str = "none", keep: str | Callable = "input", mesh: Any = None,
             batch_axes: str | tuple[str, ...] | None = None, layer_order: str = "natural") -> jax.Array:
    """Runs a stack of layers as a pipeline over the ``axis`` mesh axis.

    Args:
        stage_fn: ``stage_fn(layer_params, x_mb, **kw) -> y_mb`` applies ONE layer and keeps
            the shape and dtype. ``kw`` holds ``extras=`` (this microbatch's slice of
            ``extras``) when ``extras`` is given and ``rng=`` (a key folded with the global
            layer index, then the microbatch index) when ``rng`` is given.
        stage_params: pytree whose leaves have a leading layer dimension ``L``, a multiple of
            ``stages * repeats``; layers run in order 0..L-1.
        x: activations ``(B, ...)``; ``B`` a multiple of ``microbatches`` (times the size of
            the data axes that shard the batch).
        microbatches: ``m >= stages``.
        schedule: ``"gpipe"``, ``"circular"`` (uses ``repeats``), or one of the explicit-
            backward schedules, which need ``loss_fn``: ``"1f1b"``, ``"interleaved-1f1b"``
            (uses ``repeats``; ``m`` a multiple of the stages), ``"zb-h1"``, ``"zb-v"`` (2
            chunks per device: layer groups s and 2p-1-s; ``repeats`` 1 or 2).
        repeats: layer groups per device for ``"circular"`` / ``"interleaved-1f1b"``; 1
            otherwise.
        axis: the mesh axis the layers are split over.
        loss_fn: optional ``loss_fn(loss_params, y_mb, targets_mb) -> scalar``.
        loss_params: pytree passed to ``loss_fn`` (e.g. the output head); differentiable.
        targets: pytree of ``(B, ...)`` leaves, split like ``x``.
        extras: pytree of ``(B, ...)`` leaves (masks, positions), split like ``x``.
        rng: a PRNG key for dropout-like layers.
        remat: recompute policy for a stage's layers: ``"none"``, ``"full"`` or ``"dots"``
            (save matmul outputs).
        keep: what an explicit schedule's F keeps for its chunk-microbatch's backward op
            (``keep``): ``"input"`` (the stage input only: the backward op recomputes the
            chunk's forward), ``"all"`` (every residual, as Megatron-LM: no recompute, the most
            memory), ``"lean"`` (the values a layer names as one of ``sk.LEAN_RESIDUALS`` with
            ``jax.ad_checkpoint.checkpoint_name``: its matmul outputs and mid-layer residual
            stream; norms, activations and sequence-parallel gathers are recomputed), or a
            ``jax.checkpoint`` policy (``"dots"`` or e.g.
            ``jax.checkpoint_policies.save_only_these_names(...)``: its saved set is kept, the
            rest recomputed). Kept residuals wait in rings sized from the schedule table
            (``Schedule.res_ring``). Not ``"input"``: ``remat`` must be ``"none"``.
        mesh: the mesh; defaults to the ambient one (``jax.set_mesh``, as inside
            ``sk.train_step``).
        batch_axes: mesh axes the batch of ``x`` is split over, made manual inside the
            pipeline so the stage gradients are reduced over them once per step (see the
            module docstring); ``()`` keeps them compiler-managed. Default: the active plan's
            ``batch_axes`` (under ``sk.train_step``), else the mesh's ``replica``/``data``/
            ``fsdp`` axes; only data-like axes of size > 1 other than ``axis`` count, and none
            when ``rng`` is given. With data axes and an explicit schedule, ``loss_fn`` must be a mean
            over the microbatch's rows.
        layer_order: ``"natural"`` (``stage_params`` rows are layers 0..L-1) or
            ``"stage-major"``: the rows are stored in the order the schedule reads them
            (``sk.pipeline_layer_order``), so with several chunks per device (circular,
            interleaved 1F1B, ZB-V) the step moves no weights (``order``).

    Returns:
        ``y`` shaped like ``x`` without ``loss_fn``; with it the mean over microbatches of
        ``loss_fn`` (a float32 scalar).

    Raises:
        ValueError: unknown schedule or remat, no mesh or ``axis`` not in it, too few
            microbatches, indivisible batch or layer count, a shape-changing ``stage_fn``,
            an explicit schedule without ``loss_fn``, ``batch_axes`` naming non-data axes or given
            with ``rng``, ``keep`` other than ``"input"`` with ``remat`` or a GPipe/circular
            schedule, or ``keep="lean"`` with a ``stage_fn`` that names none of ``LEAN_RESIDUALS``.
    """
    mesh = _resolve_mesh(mesh, axis)
    claim_axes(axis)
    p = mesh.shape[axis]
    m, v = microbatches, (2 if schedule == "zb-v" else repeats)
    data = _data_axes(mesh, axis, batch_axes, rng)
    _check_vmapped(mesh, axis, data)
    L, own_remat = _check_args(stage_fn, stage_params, x, m, schedule, v, p, loss_fn, remat, mesh, axis,
                               extras, targets, rng, keep)
    k = L // (p * v)
    policy = _check_keep(keep, schedule, remat)
    if policy is not None:  # the chunk runs under the keep policy; F keeps what it saves
        remat = policy
    if own_remat and remat == "none" and v > 1 and schedule not in EXPLICIT:
        # Circular under autodiff with a self-checkpointing layer: unwrapped, the per-tick
        # slice of the stage's groups would be saved once per tick; the chunk recomputes instead.
        remat = "full"
    chunk = chunk_runner(stage_fn, k, extras is not None, rng, remat, own_remat)
    params_s = _stage_major(stage_params, layer_order, schedule, p, v, k)
    x_mb, extras_mb, targets_mb = split(x, m), split(extras, m), split(targets, m)
    info = {"microbatches": m, "schedule": schedule, "repeats": v, "stages": p, "axis": axis,
            "data_axes": data, "keep": keep if isinstance(keep, str) else "policy"}
    split_ops = None
    if schedule in SPLIT:  # B and W apart: B keeps what W needs (no recompute)
        layer = layer_runner(stage_fn, k, extras is not None, rng)
        split_ops = SplitBackward(with_remat(layer, remat, own_remat), k)  # per layer: what W keeps
    # keep="lean": a loss names no layer residuals; it keeps its matmul outputs (Kept's docstring).
    # The executor's Kept and the note's (which sizes the estimate) must run the same loss.
    loss_policy = REMAT["dots"] if keep == "lean" else None
    kept = None if policy is None else (Kept(loss_fn, policy, loss_policy), loss_params, targets_mb)
    _note_for_estimates(info, chunk, split_ops, kept, params_s, x_mb, extras_mb, rng,
                        math.prod(mesh.shape[a] for a in data))
    note("pipeline", info)
    if schedule in EXPLICIT:
        tab = pipeline_schedule(schedule, p, m, v)
        return explicit_pipeline(tab, chunk, params_s, loss_fn, loss_params, x_mb, extras_mb, targets_mb,
                                 rng, mesh=mesh, axis=axis, data=data, split=split_ops,
                                 keep=None if policy is None else Kept(loss_fn, policy, loss_policy))
    y_mb = forward(chunk, params_s, x_mb, extras_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m, v=v)
    if loss_fn is None:
        return merge(y_mb)
    return mean_loss(loss_fn, loss_params, y_mb, targets_mb)


def _stage_major(stage_params, layer_order: str, schedule: str, p: int, v: int, k: int):
    """The layers as ``(p, v, k, ...)``: device s holds groups s, s+p, ... (ZB-V: s and
    2p-1-s); for v == 1, or weights stored stage-major, a plain reshape of the contiguous
    layer sharding."""
    if layer_order not in LAYER_ORDERS:
        raise ValueError(f"unknown layer_order {layer_order!r}; choose one of {LAYER_ORDERS}")
    if layer_order == "stage-major":
        return jax.tree.map(lambda a: a.reshape((p, v, k) + a.shape[1:]), stage_params)
    if schedule == "zb-v":  # the second half of the groups in reverse (a gather here made
        # XLA reduce the stage gradients over data twice)
        def vee(a):
            a = a.reshape((2, p, k) + a.shape[1:])
            return jnp.stack([a[0], jnp.flip(a[1], 0)], axis=1)
        return jax.tree.map(vee, stage_params)
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape((v, p, k) + a.shape[1:]), 0, 1), stage_params)


def _note_for_estimates(info: dict, chunk, split_ops, kept, params_s, x_mb, extras_mb, rng, n_data: int) -> None:
    """What the memory estimate of a traced step reads off the pipeline, into ``info`` (traced
    only while an estimate is noting: ordinary traces pay nothing). ``kept``: ``(Kept,
    loss_params, targets_mb)`` where F keeps residuals (``keep``), else None."""
    schedule = info["schedule"]
    if schedule in EXPLICIT and rng is None and noting():
        try:
            info["stage_residuals"] = stage_residuals(chunk, params_s, x_mb, extras_mb, n_data)
            if split_ops is not None:  # what one pending W holds (the estimate's W ring)
                info["w_saved"] = split_ops.saved_local(params_s, x_mb, extras_mb, n_data)
                info["w_forwarded"] = split_ops.forwarded()
            if kept is not None:  # one slot of each kept-residual ring (chunk, loss)
                info["kept"], info["loss_kept"] = _kept_local(chunk, split_ops, *kept, params_s, x_mb,
                                                              extras_mb, n_data)
        except Exception:  # noqa: BLE001 - an estimate detail, never a reason to fail the step
            pass
    if rng is None and noting(detail=True):  # a GPU/TPU target's estimate (cost.analytic.from_step)
        try:
            # One backward op (explicit) or one tick of the transposed scan (GPipe/circular).
            info["chunk_backward"] = chunk_backward(chunk, params_s, x_mb, extras_mb, n_data)
            if "stage_residuals" not in info:  # GPipe/circular: what each tick saves
                info["stage_residuals"] = stage_residuals(chunk, params_s, x_mb, extras_mb, n_data)
        except Exception:  # noqa: BLE001 - an estimate detail, never a reason to fail the step
            pass


def _kept_local(chunk, split_ops, keep: Kept, loss_params, targets_mb, params_s, x_mb, extras_mb, n_data: int):
    """(shape, dtype) of one slot of the kept-residual rings on a device (``explicit.kept_shapes``),
    shapes local in the manual axes (pipe, data) and global in the others (as
    ``stage.stage_residuals``)."""
    def local(a):
        return jax.ShapeDtypeStruct((a.shape[1] // n_data,) + tuple(a.shape[2:]), jnp.result_type(a))

    weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct((1,) + a.shape[2:], jnp.result_type(a)), params_s)
    shapes = kept_shapes(chunk, split_ops, keep, weights, loss_params, local(x_mb), jax.tree.map(local, extras_mb),
                         jax.tree.map(local, targets_mb))
    return tuple([(tuple(a.shape), a.dtype) for a in jax.tree.leaves(t)] for t in shapes)


def _resolve_mesh(mesh, axis):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            raise ValueError(
                "pipeline() found no mesh: pass mesh=..., or call it under jax.set_mesh(mesh) "
                "(sk.train_step does that for you)")
    if axis not in mesh.axis_names:
        raise ValueError(f"pipeline axis {axis!r} is not in the mesh axes {tuple(mesh.axis_names)} "
                         f"(shape {dict(mesh.shape)}); add it, e.g. make_mesh('data=2,{axis}=4'), "
                         "or pass axis=<one of those>")
    return mesh


def _compiler_axes(mesh, axis: str, data) -> list[str]:
    """Axes of size > 1 the stages leave to the compiler: not the pipe axis, not the manual
    data axes, not a vmap's spmd axis (``sk.DiLoCo``'s replicas)."""
    mapped = vmapped_axes()
    return [a for a in mesh.axis_names if a != axis and a not in data and a not in mapped and mesh.shape[a] > 1]


def _check_vmapped(mesh, axis: str, data) -> None:
    """Inside ``sk.DiLoCo``'s replicas (a ``vmap`` with ``spmd_axis_name``) jax 0.10.2 adds the
    replica axis to every sharding constraint traced in the stages, where that axis is manual,
    and lowering then fails ("pspec P('replica', ..., 'tensor') contains a manual axes"). Only
    constraints over compiler-owned axes (tensor, fsdp) trip it: refuse that combination
    before tracing, naming the layouts that work."""
    mapped, auto = vmapped_axes(), _compiler_axes(mesh, axis, data)
    if mapped and auto:
        raise ValueError(
            f"sk.pipeline inside sk.DiLoCo's replicas (over {sorted(mapped)}) with the compiler-owned "
            f"axes {auto} of size > 1 is not supported with jax {jax.__version__}: vmap adds the replica "
            "axis to the stages' sharding constraints, where it is manual. Use the pipeline with data "
            f"axes only inside the replicas (e.g. replica=2,{axis}=2,data=2), or tensor parallelism "
            "without a pipe axis (replica=2,data=2,tensor=2)")


def _check_keep(keep, schedule: str, remat: str):
    """The keep policy (``keep.keep_policy``); None for the stage input only."""
    policy = keep_policy(keep)
    if policy is not None and schedule not in EXPLICIT:
        raise ValueError(f"keep={keep!r} is for the explicit schedules {EXPLICIT}; schedule={schedule!r} "
                         "keeps what autodiff keeps (set that with remat=), so leave keep='input'")
    if policy is not None and remat != "none":
        raise ValueError(f"keep={keep!r} with remat={remat!r}: both say what the backward recomputes. "
                         "Pass remat='none' with keep (keep='dots' keeps what remat='dots' saves, from "
                         "the F op to its backward), or keep='input' with remat")
    return policy


def _data_axes(mesh, axis, batch_axes, rng) -> tuple[str, ...]:
    """The data-like axes of size > 1 the batch is split over: made manual in the pipeline."""
    if batch_axes is None:
        if rng is not None:
            return ()
        from ..plan import active_plan

        plan = active_plan()
        same = plan is not None and tuple(plan.mesh.axis_names) == tuple(mesh.axis_names)
        batch_axes = plan.batch_axes if same else _BATCH_AXES
    else:
        batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        bad = [a for a in batch_axes if a not in mesh.axis_names or a not in _BATCH_AXES or a == axis]
        if bad:
            raise ValueError(f"batch_axes {bad} must be data-like mesh axes {_BATCH_AXES} other than "
                             f"the pipeline axis {axis!r}; the mesh has {dict(mesh.shape)}. Pass some "
                             "of those, or () to keep the batch axes compiler-managed")
        if batch_axes and rng is not None:
            raise ValueError(f"batch_axes={batch_axes} with rng: a key drawn on a device's rows would "
                             "not reproduce the un-sharded masks; leave batch_axes unset (or ()) "
                             "when passing rng")
    mapped = vmapped_axes()  # a vmap's spmd axis (sk.DiLoCo's replicas) is not the batch's here
    return tuple(a for a in mesh.axis_names if a in batch_axes and a in _BATCH_AXES and a != axis
                 and a not in mapped and mesh.shape[a] > 1)


def _check_args(stage_fn, stage_params, x, m, schedule, v, p, loss_fn, remat, mesh, axis,
                extras, targets, rng, keep) -> tuple[int, bool]:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if remat not in REMAT:
        raise ValueError(f"unknown remat {remat!r}; choose one of {tuple(REMAT)}")
    if schedule in EXPLICIT and loss_fn is None:
        raise ValueError(f"schedule={schedule!r} needs loss_fn (and loss_params/targets): its "
                         "backward runs inside the pipeline, interleaved with the forward. Pass "
                         "loss_fn, or use schedule='gpipe' or 'circular' to get y back")
    if not isinstance(m, int) or m < p:
        raise ValueError(f"microbatches={m!r} but the {axis!r} axis has {p} stages; a pipeline "
                         f"needs microbatches >= stages: use microbatches >= {p}")
    check_schedule(schedule, p, m, v)
    leaves = jax.tree.leaves(stage_params)
    if not leaves:
        raise ValueError("stage_params has no arrays; pass the stacked layer params")
    sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError("every stage_params leaf needs the same leading layer dimension, got "
                         f"leading sizes {sorted(map(str, sizes))}")
    L = sizes.pop()
    if L % (p * v):
        raise ValueError(f"{L} layers do not split into {p} stages x {v} repeats = {p * v} equal "
                         f"groups; use a layer count that is a multiple of {p * v}, or change "
                         "the stages/repeats")
    B = x.shape[0] if x.ndim else 0
    data = math.prod(mesh.shape[a] for a in _BATCH_AXES
                     if a in mesh.axis_names and a != axis and a not in vmapped_axes())
    if B % m or (B // m) % data:
        raise ValueError(f"batch {B} does not split into {m} microbatches of a size divisible by "
                         f"the data axes ({data} devices): need batch % (microbatches * {data}) "
                         f"== 0; use a batch that is a multiple of {m * data}, or change "
                         "microbatches")
    for name, tree in (("extras", extras), ("targets", targets)):
        bad = [jnp.shape(a) for a in jax.tree.leaves(tree) if not jnp.ndim(a) or jnp.shape(a)[0] != B]
        if bad:
            raise ValueError(f"{name} leaves need the batch {B} as leading dimension, got shapes {bad}")
    kw = {}
    if extras is not None:
        kw["extras"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct((B // m,) + a.shape[1:], a.dtype), extras)
    if rng is not None:
        kw["rng"] = rng
    x_mb = jax.ShapeDtypeStruct((B // m,) + x.shape[1:], x.dtype)
    layer0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stage_params)
    layer = lambda lp, h, kw: stage_fn(lp, h, **kw)  # noqa: E731
    out = jax.eval_shape(layer, layer0, x_mb, kw)
    if not hasattr(out, "shape") or (out.shape, out.dtype) != (x_mb.shape, x_mb.dtype):
        got = (out.shape, out.dtype) if hasattr(out, "shape") else type(out).__name__
        raise ValueError(f"stage_fn must keep the microbatch shape and dtype {x_mb.shape} "
                         f"{x_mb.dtype}, but returned {got}; the pipeline hands each layer's "
                         "output to the next layer, so project to another width outside "
                         "pipeline() (before it, or in loss_fn)")
    own_remat, names = layer_facts(layer, layer0, x_mb, kw)
    check_named(keep, names)
    return L, own_remat
