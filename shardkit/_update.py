"""The body of ``TrainStep``'s compiled step: the loss of one (micro)batch, gradients
accumulated over microbatches, and the optimizer update on ZeRO's shards; with the checks of
the step's options and the global view of a multi-host batch.

Split from ``step.py`` (the ``TrainStep`` object: state layout, placement, dispatch) so each
reads alone; every function takes the ``TrainStep`` whose plan, optimizer and options it runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from . import _model, fp8, offload
from .plan import Plan, noted
from .precision import cast_floats, cast_like

constrain = jax.lax.with_sharding_constraint


def global_view(batch, plan: Plan):
    """Shapes of the global batch: on several hosts each passes the rows its devices hold, as
    host arrays — a share of the batch axes' blocks (all of them when the batch axes stay inside
    each host, e.g. a tensor axis spanning the hosts), as ``make_array_from_process_local_data``
    reads it."""
    if jax.process_count() == 1:
        return batch
    n = plan.batch_size_multiple
    spec = plan.batch_specs(jax.ShapeDtypeStruct((n,), jnp.float32))
    local = {idx[0].indices(n)[:2] for idx in plan.sharding(spec).addressable_devices_indices_map((n,)).values()}
    blocks = len({start for start, _ in local})
    grow = lambda x: (jax.ShapeDtypeStruct((x.shape[0] * n // blocks,) + x.shape[1:], x.dtype)  # noqa: E731
                      if not isinstance(x, jax.Array) and getattr(x, "ndim", 0) else x)
    return jax.tree.map(grow, batch)


def check_options(plan, optimizer, microbatches, clip_norm, max_nonfinite) -> None:
    if not isinstance(plan, Plan):
        raise ValueError(f"train_step needs an sk.Plan, got {type(plan).__name__}")
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise ValueError(f"train_step needs an Optax GradientTransformation, got {optimizer!r}")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be positive (or None), got {clip_norm!r}")
    if max_nonfinite is not None and (not isinstance(max_nonfinite, int) or max_nonfinite < 1):
        raise ValueError(f"max_nonfinite must be a positive integer (or None), got {max_nonfinite!r}")


def split_output(out, adapter: _model.Adapter, has_model_state: bool):
    """The loss function's return value → ``(loss, aux, collection_updates)``."""
    updates = None
    if isinstance(out, tuple):
        if adapter.kind == "linen" and has_model_state and len(out) == 3:
            loss, aux, updates = out
        elif len(out) == 2:
            loss, aux = out
        else:
            raise ValueError(
                f"the loss function returned a tuple of {len(out)}; return loss, (loss, aux), or "
                "for Linen models with mutable collections (loss, aux, updated_collections)")
    else:
        loss, aux = out, None
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise ValueError(f"the loss function must return a scalar loss, got shape {loss.shape}; reduce it (e.g. .mean())")
    return loss, aux, updates


def loss(step, params_g, model_state, batch, key, scale):
    """Loss (scaled under fp16) and ``(loss, aux, new_model_state)`` for one (micro)batch."""
    prec, adapter = step.plan.precision, step._adapter
    params = cast_floats(params_g, prec.compute)
    if step._overwrite is not None and step.plan.batch_axes:
        # sk.fp8's histories get a row grid: each tensor's amax is reduced per device where
        # it is computed and across devices once, after the layer loop (fp8.with_row_grid).
        axes = tuple(step.plan.batch_axes)
        grid = lambda p: step.plan.sharding(P(*[None] * (p.ndim - 1), axes))  # noqa: E731
        params = jax.tree.map(lambda p, o: fp8.with_row_grid(p, grid(p)) if o else p, params, step._overwrite)
    model = adapter.assemble(params, model_state)
    batch = cast_floats(batch, prec.compute)
    out = step.fn(model, batch, rng=key) if step._takes_rng else step.fn(model, batch)
    has_state = bool(jax.tree.leaves(model_state))
    value, aux, updates = split_output(out, adapter, has_state)
    if updates is not None:
        new_state = {**model_state, **updates}
    else:
        new_state = adapter.harvest(model, model_state)
    new_state = cast_like(new_state, model_state) if has_state else model_state
    value = value.astype(jnp.float32)
    return (value * scale if scale is not None else value), (value, aux, new_state)


def _mean_over_microbatches(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x.mean(axis=0)
    return x.sum(axis=0)


def gradients(step, state, batch, key, scale):
    """``(grads, loss, aux, model_state)``: gradients in the grads layout, averaged over the
    step's microbatches (accumulated in f32 with ``lax.scan``), still scaled under fp16."""
    plan, prec, m = step.plan, step.plan.precision, step.microbatches
    grad_sh = step._param_shardings("grads")
    params_g = cast_floats(state.params, prec.grads)
    grad_fn = jax.value_and_grad(step._loss, has_aux=True)
    if m == 1:
        # No accumulator to keep: the reduced gradient feeds the update only, so it is reduced
        # straight into the optimizer's shard — one reduce-scatter under ZeRO-1 as under ZeRO-2
        # (the grads layout keeping it whole would all-reduce it: twice the wire bytes). Not
        # after sk.pipeline, which reduced its stages' gradients inside its shard_map already.
        (_, (value, aux, model_state)), grads = grad_fn(params_g, state.model_state, batch, key, scale)
        into = "grads" if noted("pipeline") is not None else "update"
        return constrain(grads, step._param_shardings(into)), value, aux, model_state
    # Microbatch i takes rows i, i+m, i+2m, ...: every device keeps its own rows, so splitting
    # needs no communication (a contiguous split would move data).
    mb_sh = plan.sharding(plan.microbatch_spec())
    split = lambda x: constrain(jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1), mb_sh) if x.ndim else x  # noqa: E731
    batches = jax.tree.map(split, batch)
    row_sh = plan.sharding(P(plan.batch_axes)) if plan.batch_axes else plan.sharding(P())
    acc_dtype = jnp.promote_types(prec.grads, jnp.float32)

    # sk.fp8's amax histories: each microbatch's "gradient" is the new history; their max is
    # the step's (the same rolled history, the largest amax in front).
    overwrite = step._overwrite if step._overwrite is not None else jax.tree.map(lambda _: False, state.params)
    add = lambda a, b, o: jnp.maximum(a, b.astype(acc_dtype)) if o else a + b.astype(acc_dtype)  # noqa: E731

    def body(carry, xs):
        acc, ms = carry
        mb, i = xs
        mb = jax.tree.map(lambda x: constrain(x, row_sh) if x.ndim else x, mb)
        k = jax.random.fold_in(key, i) if key is not None else None
        (_, (value, aux, ms)), g = grad_fn(params_g, ms, mb, k, scale)
        acc = jax.tree.map(add, acc, constrain(g, grad_sh), overwrite)
        return (constrain(acc, grad_sh), ms), (value, aux)

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, acc_dtype), state.params)
    scalars = jax.tree.map(lambda x: x if x.ndim else jnp.broadcast_to(x, (m,)), batches)
    (grads, model_state), (losses, auxs) = jax.lax.scan(
        body, (constrain(zeros, grad_sh), state.model_state), (scalars, jnp.arange(m)))
    grads = jax.tree.map(lambda g, o: g if o else g / m, grads, overwrite)
    return grads, losses.mean(), jax.tree.map(_mean_over_microbatches, auxs), model_state


def step_body(step, state, batch):
    """One training step: ``(new_state, metrics)``."""
    prec = step.plan.precision
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step) if step._takes_rng else None
    scale = state.loss_scale.scale if state.loss_scale is not None else None
    grads, value, aux, model_state = gradients(step, state, batch, key, scale)
    overwrite = None
    if step._overwrite is not None:  # new values (sk.fp8), kept apart from the gradients proper
        overwrite = grads
        grads = jax.tree.map(lambda g, o: jnp.zeros_like(g) if o else g, grads, step._overwrite)
    if "opt_state" in step.plan.offload:  # from host memory, once the gradients exist
        grads, opt_state = offload.to_device(state.opt_state, step._opt_shardings(state.params, memory=False), grads)
        state = state.replace(opt_state=opt_state)
    if scale is not None:
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
    finite = jnp.isfinite(value)
    if step.skip_nonfinite:
        finite = finite & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    grad_norm = optax.tree.norm(grads)
    if step.clip_norm is not None:
        # As optax.clip_by_global_norm: no epsilon (it would leave every clipped gradient
        # short of clip_norm by 1e-6/norm); a zero norm gives clip/0 = inf, a factor of 1.
        factor = jnp.minimum(1.0, step.clip_norm / grad_norm)
        grads = jax.tree.map(lambda g: g * factor.astype(g.dtype), grads)
    new_params, opt_state = apply_gradients(step, state, grads)
    if overwrite is not None:
        new_params = jax.tree.map(lambda p, g, o: g.astype(p.dtype) if o else p, new_params, overwrite, step._overwrite)
    if step.skip_nonfinite:
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        new_params, opt_state = keep(new_params, state.params), keep(opt_state, state.opt_state)
        model_state = keep(model_state, state.model_state)
    bad = (~finite).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1, params=new_params, opt_state=opt_state, model_state=model_state,
        skipped=state.skipped + bad, streak=(state.streak + bad) * bad,
        loss_scale=None if state.loss_scale is None else state.loss_scale.adjust(finite, prec))
    metrics = {"loss": value.astype(prec.output), "grad_norm": grad_norm.astype(jnp.float32)}
    if aux is not None:
        metrics["aux"] = cast_floats(aux, prec.output)
    if step.skip_nonfinite:
        metrics["skipped"] = new_state.skipped
        metrics["finite"] = finite
    if step.max_nonfinite is not None:
        metrics["nonfinite_streak"] = new_state.streak  # not donated: read a step later
    if state.loss_scale is not None:
        metrics["loss_scale"] = scale
    return new_state, metrics


def apply_gradients(step, state, grads):
    """``(new_params, new_opt_state)``: the Optax update on the optimizer's shard (ZeRO-1/2:
    each device updates only its shard; the all-gather back to the parameter layout happens
    once, on the new parameters)."""
    upd_sh = step._param_shardings("update")
    grads, params = constrain(grads, upd_sh), constrain(state.params, upd_sh)
    updates, opt_state = step.tx.update(grads, state.opt_state, params)
    new_params = cast_like(optax.apply_updates(params, updates), state.params)
    new_params = constrain(new_params, step._param_shardings("params"))
    return new_params, cast_like(opt_state, state.opt_state)
