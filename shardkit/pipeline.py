"""Pipeline parallelism over one mesh axis: GPipe, circular (interleaved) and 1F1B.

``pipeline(stage_fn, stage_params, x, microbatches=m, schedule=...)`` applies a stack of ``L``
identical layers (``stage_params`` leaves carry a leading ``L`` dimension) to ``x``, with the
layers split over the ``pipe`` axis and the batch split into ``m`` microbatches. The result
always equals the un-pipelined ``for l in range(L): x = stage_fn(params[l], x)``.

How it runs: a ``jax.shard_map`` that is manual over the pipe axis and the *data axes* (the
batch axes among ``replica``/``data``/``fsdp``: ``batch_axes=``, by default the active plan's),
while ``tensor`` (and any other axis) stays under the compiler, so TP inside a stage works as
before. Every schedule
is a numpy table (``_pipeline_schedules``) with one row per tick; a ``lax.scan`` walks the rows,
each device reads its own column, runs its layer group through ``lax.cond``/``lax.switch`` (an
idle device skips the compute) and hands activations on with ``lax.ppermute``.

* **GPipe** and **circular**: the forward schedule is scanned, the backward comes from
  autodiff (all forwards, then all backwards; every microbatch's residuals stay alive).
  Circular with ``repeats=v`` gives device ``s`` the layer groups ``s, s+p, s+2p, ...``; an
  activation leaving the last stage loops back to stage 0 for the next group. Microbatch ``i``
  is the rows ``i, i+m, i+2m, ...`` of the batch, so a batch sharded over data axes stays
  sharded inside every microbatch.
* **1F1B**: a ``jax.custom_vjp`` whose forward runs the whole 1F1B schedule (forwards,
  per-microbatch loss on the last stage, backwards through an explicit per-stage ``jax.vjp``
  that recomputes the stage from its saved input) and returns the gradients as residuals; the
  custom backward only scales them by the incoming cotangent. A stage keeps at most ~p stage
  inputs in a ring buffer, whatever ``m``. Without differentiation the primal runs GPipe.
  Gradients never flow to ``extras`` or ``targets``.

Why the data axes are manual: a stage's weight gradient is produced on every tick (GPipe,
circular) or every backward op (1F1B). With data compiler-managed, XLA all-reduces it over data
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
* 1F1B: the custom_vjp forward accumulates local gradients over the scan and ``psum``s them
  over data once. ``loss_fn`` runs on a device's rows of a microbatch, so it must be a mean
  over the microbatch rows (as MSE / cross-entropy means are): the global loss is then the
  mean of the local ones, and the backward seeds every local loss with ``1 / (m · n_data)``.

Dropout-like layers (``rng``) keep the data axes compiler-managed (the old behaviour and the
old traffic): a key drawn on a device's rows only would not reproduce the un-sharded masks.

Memory: autodiff of the tick loop saves activations only. A layer group's weights are its layer
scan's ``xs`` and ops that only move or re-type data (slices, reshapes, transposes, casts) are
recomputed in the backward rather than saved, so nothing derived from the weights — circular's
per-tick slice of its group included — is kept once per tick. 1F1B trades compute for memory:
a backward op recomputes its stage's forward (4/3 of the layers' flops) and only one
microbatch's residuals are alive at a time.

Bubble fractions of the tables (``bench/pipeline.py`` checks them): GPipe and 1F1B
(p-1)/(m+p-1) (1F1B counted in forward/backward slots of equal length), circular
(p-1)/(v·m+p-1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import _pipeline_schedules as sched
from .plan import note, noting

SCHEDULES = ("gpipe", "circular", "1f1b")
_REMAT = {"none": None, "full": "full", "dots": jax.checkpoint_policies.dots_saveable,
          "dots_saveable": jax.checkpoint_policies.dots_saveable}
_BATCH_AXES = ("replica", "data", "fsdp")  # as Plan's default batch axes


def pipeline(stage_fn: Callable[..., jax.Array], stage_params: Any, x: jax.Array, *,
             microbatches: int, schedule: str = "gpipe", repeats: int = 1, axis: str = "pipe",
             loss_fn: Callable[..., jax.Array] | None = None, loss_params: Any = None,
             targets: Any = None, extras: Any = None, rng: jax.Array | None = None,
             remat: str = "none", mesh: Any = None,
             batch_axes: str | tuple[str, ...] | None = None) -> jax.Array:
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
        schedule: ``"gpipe"``, ``"circular"`` (uses ``repeats``) or ``"1f1b"`` (needs
            ``loss_fn``).
        repeats: layer groups per device for ``"circular"``; 1 otherwise.
        axis: the mesh axis the layers are split over.
        loss_fn: optional ``loss_fn(loss_params, y_mb, targets_mb) -> scalar``.
        loss_params: pytree passed to ``loss_fn`` (e.g. the output head); differentiable.
        targets: pytree of ``(B, ...)`` leaves, split like ``x``.
        extras: pytree of ``(B, ...)`` leaves (masks, positions), split like ``x``.
        rng: a PRNG key for dropout-like layers.
        remat: recompute policy for a stage's layers: ``"none"``, ``"full"`` or ``"dots"``
            (save matmul outputs).
        mesh: the mesh; defaults to the ambient one (``jax.set_mesh``, as inside
            ``sk.train_step``).
        batch_axes: mesh axes the batch of ``x`` is split over, made manual inside the
            pipeline so the stage gradients are reduced over them once per step (see the
            module docstring); ``()`` keeps them compiler-managed. Default: the active plan's
            ``batch_axes`` (under ``sk.train_step``), else the mesh's ``replica``/``data``/
            ``fsdp`` axes; only data-like axes of size > 1 other than ``axis`` count, and none
            when ``rng`` is given. With data axes and ``"1f1b"``, ``loss_fn`` must be a mean
            over the microbatch's rows.

    Returns:
        ``y`` shaped like ``x`` without ``loss_fn``; with it the mean over microbatches of
        ``loss_fn`` (a float32 scalar).

    Raises:
        ValueError: unknown schedule or remat, no mesh or ``axis`` not in it, too few
            microbatches, indivisible batch or layer count, a shape-changing ``stage_fn``,
            ``"1f1b"`` without ``loss_fn``, or ``batch_axes`` naming non-data axes or given
            with ``rng``.
    """
    mesh = _resolve_mesh(mesh, axis)
    p = mesh.shape[axis]
    m, v = microbatches, repeats
    data = _data_axes(mesh, axis, batch_axes, rng)
    L = _check_args(stage_fn, stage_params, x, m, schedule, v, p, loss_fn, remat, mesh, axis,
                    extras, targets, rng)
    k = L // (p * v)
    chunk = _chunk_runner(stage_fn, k, m, p, extras is not None, rng, remat)
    # Stage-major layout (p, v, k, ...): device s holds groups s, s+p, ...; for v == 1 this is
    # a plain reshape of the contiguous layer sharding.
    params_s = jax.tree.map(
        lambda a: jnp.swapaxes(a.reshape((v, p, k) + a.shape[1:]), 0, 1), stage_params)
    x_mb, extras_mb, targets_mb = _split(x, m), _split(extras, m), _split(targets, m)
    info = {"microbatches": m, "schedule": schedule, "repeats": v, "stages": p, "axis": axis,
            "data_axes": data}
    if schedule == "1f1b" and rng is None and noting():
        try:
            info["stage_residuals"] = _stage_residuals(chunk, params_s, x_mb, extras_mb,
                                                       math.prod(mesh.shape[a] for a in data))
        except Exception:  # noqa: BLE001 - an estimate detail, never a reason to fail the step
            pass
    note("pipeline", info)
    if schedule == "1f1b":
        return _one_f_one_b(chunk, params_s, loss_fn, loss_params, x_mb, extras_mb, targets_mb,
                            rng, mesh=mesh, axis=axis, data=data, p=p, m=m)
    y_mb = _forward(chunk, params_s, x_mb, extras_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m, v=v)
    if loss_fn is None:
        return _merge(y_mb)
    return _mean_loss(loss_fn, loss_params, y_mb, targets_mb)


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


def _data_axes(mesh, axis, batch_axes, rng) -> tuple[str, ...]:
    """The data-like axes of size > 1 the batch is split over: made manual in the pipeline."""
    if batch_axes is None:
        if rng is not None:
            return ()
        from .plan import active_plan

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
    return tuple(a for a in mesh.axis_names
                 if a in batch_axes and a in _BATCH_AXES and a != axis and mesh.shape[a] > 1)


def _check_args(stage_fn, stage_params, x, m, schedule, v, p, loss_fn, remat, mesh, axis,
                extras, targets, rng) -> int:
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if remat not in _REMAT:
        raise ValueError(f"unknown remat {remat!r}; choose one of {tuple(_REMAT)}")
    if schedule == "1f1b" and loss_fn is None:
        raise ValueError("schedule='1f1b' needs loss_fn (and loss_params/targets): its backward "
                         "runs inside the pipeline, interleaved with the forward. Pass loss_fn, or "
                         "use schedule='gpipe' or 'circular' to get y back")
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"repeats must be a positive integer, got {v!r}")
    if v > 1 and schedule != "circular":
        raise ValueError(f"repeats={v} needs schedule='circular' (got {schedule!r}); "
                         "or use repeats=1")
    if not isinstance(m, int) or m < p:
        raise ValueError(f"microbatches={m!r} but the {axis!r} axis has {p} stages; a pipeline "
                         f"needs microbatches >= stages: use microbatches >= {p}")
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
    data = math.prod(mesh.shape[a] for a in _BATCH_AXES if a in mesh.axis_names and a != axis)
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
    out = jax.eval_shape(lambda lp, h, kw: stage_fn(lp, h, **kw), layer0, x_mb, kw)
    if not hasattr(out, "shape") or (out.shape, out.dtype) != (x_mb.shape, x_mb.dtype):
        got = (out.shape, out.dtype) if hasattr(out, "shape") else type(out).__name__
        raise ValueError(f"stage_fn must keep the microbatch shape and dtype {x_mb.shape} "
                         f"{x_mb.dtype}, but returned {got}; the pipeline hands each layer's "
                         "output to the next layer, so project to another width outside "
                         "pipeline() (before it, or in loss_fn)")
    return L


def _split(tree, m):
    """(B, ...) -> (m, B/m, ...) with microbatch i = rows i, i+m, ... (keeps data sharding)."""
    return jax.tree.map(
        lambda a: jnp.swapaxes(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 0, 1), tree)


def _merge(a):
    return jnp.swapaxes(a, 0, 1).reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def _mean_loss(loss_fn, loss_params, y_mb, targets_mb):
    losses = jax.vmap(lambda y, t: loss_fn(loss_params, y, t))(y_mb, targets_mb)
    return jnp.mean(losses.astype(jnp.float32))


def _chunk_runner(stage_fn, k, m, p, has_extras, rng, remat):
    """chunk(params_l (v, k, ...), rep, h, group, mb, extras_mb) runs group ``rep``'s k layers."""

    def chunk(params_l, rep, h, group, mb, extras_mb):
        def layer(h, xs):
            lp, j = xs
            kw = {}
            if has_extras:
                kw["extras"] = extras_mb
            if rng is not None:
                kw["rng"] = jax.random.fold_in(jax.random.fold_in(rng, group * k + j), mb)
            return stage_fn(lp, h, **kw), None

        # The weights are the scan's xs: autodiff then reads them from the operand in the
        # backward (a residual that is an xs slice is forwarded, not stacked). Slicing them
        # inside the body instead makes every slice a saved residual — a copy of the stage's
        # weights per tick (GPipe) or per backward op (1F1B).
        weights = jax.tree.map(lambda a: a[rep], params_l)
        return lax.scan(layer, h, (weights, jnp.arange(k)))[0]

    return _remat(chunk, remat)


def _stage_residuals(chunk, params_s, x_mb, extras_mb, n_data) -> list[tuple[tuple[int, ...], Any]]:
    """For ``explain()``: the residuals (shape, dtype) one device's layer group saves for one
    microbatch — what a 1F1B backward op rebuilds and holds while it runs. Shapes are local in
    the manual axes (pipe, data), global in the others. Traced here, while the step is traced
    (the stage may close over the step's values)."""
    from jax._src.ad_checkpoint import saved_residuals

    def local(a):
        return jax.ShapeDtypeStruct((a.shape[1] // n_data,) + tuple(a.shape[2:]), jnp.result_type(a))

    params_l = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], jnp.result_type(a)), params_s)
    h, extras = local(x_mb), jax.tree.map(local, extras_mb)
    res = saved_residuals(lambda P_, h, e: chunk(P_, 0, h, 0, 0, e), params_l, h, extras)
    weights = {tuple(a.shape[2:]) for a in jax.tree.leaves(params_s)}  # the group's (k, ...) stacks
    return [(tuple(a.shape), a.dtype) for a, where in res
            if "from the argument" not in where and tuple(a.shape) not in weights]


# Ops that only move or re-type data: never saved for the backward (recomputed there, free of
# flops), so that nothing derived from a layer's weights — a reshape, a transpose, a cast, the
# circular schedule's per-tick slice of its layer group — is stacked once per tick.
_STRUCTURAL = frozenset({"dynamic_slice", "slice", "gather", "reshape", "squeeze", "expand_dims",
                         "broadcast_in_dim", "transpose", "convert_element_type", "copy", "name"})


def _save_all_but_structural(prim, *_, **__) -> bool:
    return prim.name not in _STRUCTURAL


def _remat(fn, remat):
    if remat == "none":
        return jax.checkpoint(fn, policy=_save_all_but_structural)
    if remat == "full":
        return jax.checkpoint(fn)
    return jax.checkpoint(fn, policy=_REMAT[remat])


def _varying(tree, axes):
    """Marks values as varying over ``axes`` (scan carries and switch inputs need it)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def cast(a):
        missing = tuple(x for x in axes if x not in jax.typeof(a).mat.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def _row_spec(data, lead=1):
    """Spec of a (m, rows, ...) microbatch stack (``lead`` = dims before the rows)."""
    return P(*([None] * lead), data) if data else P()


def _take(tree, i):
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _put(buf, val, i):
    return lax.dynamic_update_index_in_dim(buf, val, i, 0)


def _forward(chunk, params_s, x_mb, extras_mb, rng, *, mesh, axis, data, p, m, v):
    """GPipe / circular forward; returns y as (m, B/m, ...). Backward via autodiff."""
    tab = sched.forward_table(p, m, v)
    shift = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
    # Idle ticks compute too (on real activations; the result is discarded): a lax.cond here
    # would hide from the scan that the weights are loop-invariant, so autodiff would save a
    # copy of the stage's weights per tick. In lockstep SPMD the idle stage waits anyway.

    def body(params_l, x_mb, extras_mb, rng):
        stage = lax.axis_index(axis)
        # Data-varying here, once: its transpose is the one psum over data after the loop.
        params_l = _varying(jax.tree.map(lambda a: a[0], params_l), data)  # (v, k, ...)
        x_mb, extras_mb = _varying((x_mb, extras_mb), (axis, *data))
        zero_h = jnp.zeros_like(x_mb[0])
        rows = tuple(jnp.asarray(a) for a in (tab.item, tab.loop_slot, tab.out_slot))

        def tick(carry, row):
            recv_h, loop_buf, out_buf = carry
            item, loop_slot, out_slot = (r[stage] for r in row)
            it = jnp.maximum(item, 0)
            # A static rep for v == 1 keeps the weights loop-invariant: autodiff then saves
            # them once, not once per tick.
            mb, rep = it % m, (it // m if v > 1 else 0)
            if v > 1:  # stage 0 parks the activation coming back from the last stage
                loop_buf = _put(loop_buf, recv_h, loop_slot)
                first_h = jnp.where(rep == 0, _take(x_mb, mb), _take(loop_buf, mb))
            else:
                first_h = _take(x_mb, mb)
            h = jnp.where(stage == 0, first_h, recv_h)
            y = chunk(params_l, rep, h, rep * p + stage, mb, _take(extras_mb, mb))
            out_buf = _put(out_buf, y, out_slot)
            recv_h = lax.ppermute(y, axis, shift) if shift else y
            return (recv_h, loop_buf, out_buf), None

        bufs = jnp.zeros((m + 1,) + zero_h.shape, zero_h.dtype)
        loop_buf = bufs if v > 1 else jnp.zeros((), zero_h.dtype)
        init = _varying((zero_h, loop_buf, bufs), (axis, *data))
        _, _, out_buf = lax.scan(tick, init, rows)[0]
        return out_buf[None, :m]

    spec, rows = P(axis), _row_spec(data)
    out = jax.shard_map(
        body, mesh=mesh, axis_names={axis, *data},
        in_specs=(jax.tree.map(lambda _: spec, params_s), rows, jax.tree.map(lambda _: rows, extras_mb),
                  None if rng is None else P()),
        out_specs=P(axis, None, data) if data else spec)(params_s, x_mb, extras_mb, rng)
    return out[p - 1]  # only the last stage's buffer holds the outputs


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def _one_f_one_b(chunk, params_s, loss_fn, loss_params, x_mb, extras_mb, targets_mb, rng, *,
                 mesh, axis, data, p, m):
    from ._pipeline_1f1b import one_f_one_b_grads

    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                         (extras_mb, targets_mb, rng))

    def primal(params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
        y_mb = _forward(chunk, params_s, x_mb, extras_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m, v=1)
        return _mean_loss(loss_fn, loss_params, y_mb, targets_mb)

    def fwd(params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
        loss, grads = one_f_one_b_grads(chunk, loss_fn, params_s, loss_params, x_mb, extras_mb,
                                        targets_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m)
        return loss, grads

    def bwd(grads, g):
        scaled = jax.tree.map(lambda d: (d * g).astype(d.dtype), grads)
        return (*scaled, *jax.tree.map(_zero_cotangent, avals))

    run = jax.custom_vjp(primal)
    run.defvjp(fwd, bwd)
    return run(params_s, loss_params, x_mb, extras_mb, targets_mb, rng)
