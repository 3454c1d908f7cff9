"""What every pipeline executor shares: a stage's layer group as one function, the microbatch
split, and the small shard_map helpers (row specs, ring-buffer take/put, varying casts).

A *stage chunk* is ``k`` consecutive layers (one layer group); device ``s`` holds the groups
``s, s+p, s+2p, ...`` stacked as ``(v, k, ...)`` (``v`` chunks per device).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from .._vma import varying as varying  # re-exported: the schedules import it from here

REMAT = {"none": None, "full": "full", "dots": jax.checkpoint_policies.dots_saveable,
         "dots_saveable": jax.checkpoint_policies.dots_saveable}


def split(tree, m):
    """(B, ...) -> (m, B/m, ...) with microbatch i = rows i, i+m, ... (keeps data sharding)."""
    return jax.tree.map(
        lambda a: jnp.swapaxes(a.reshape((a.shape[0] // m, m) + a.shape[1:]), 0, 1), tree)


def merge(a):
    """Inverse of ``split`` for one array: (m, B/m, ...) -> (B, ...)."""
    return jnp.swapaxes(a, 0, 1).reshape((a.shape[0] * a.shape[1],) + a.shape[2:])


def mean_loss(loss_fn, loss_params, y_mb, targets_mb):
    """Mean over microbatches of ``loss_fn`` on each, in float32."""
    losses = jax.vmap(lambda y, t: loss_fn(loss_params, y, t))(y_mb, targets_mb)
    return jnp.mean(losses.astype(jnp.float32))


def layer_runner(stage_fn, k, has_extras, rng):
    """one(lp, h, j, group, mb, extras_mb) applies layer ``j`` of layer group ``group`` (its
    ``extras``, its ``rng`` folded with the global layer index, then the microbatch)."""

    def one(lp, h, j, group, mb, extras_mb):
        kw = {}
        if has_extras:
            kw["extras"] = extras_mb
        if rng is not None:
            kw["rng"] = jax.random.fold_in(jax.random.fold_in(rng, group * k + j), mb)
        return stage_fn(lp, h, **kw)

    return one


def chunk_runner(stage_fn, k, has_extras, rng, remat, own_remat=False):
    """chunk(params_l (v, k, ...), rep, h, group, mb, extras_mb) runs chunk ``rep``'s k layers
    (``group`` is its global layer-group index, for the rng fold). ``own_remat``: ``stage_fn``
    already checkpoints itself (``layer_facts``); see ``with_remat``."""

    one = layer_runner(stage_fn, k, has_extras, rng)

    def chunk(params_l, rep, h, group, mb, extras_mb):
        def layer(h, xs):
            lp, j = xs
            if k > 1:
                # Named for keep="lean" (LEAN_RESIDUALS): a remat'd layer scan keeps no carry
                # a policy does not name, and rebuilds layer j's input through layer j - 1's
                # matmuls. (One layer: its input is the chunk's, which the op has.)
                h = checkpoint_name(h, "layer_input")
            return one(lp, h, j, group, mb, extras_mb), None

        # The weights are the scan's xs: autodiff then reads them from the operand in the
        # backward (a residual that is an xs slice is forwarded, not stacked). Slicing them
        # inside the body instead makes every slice a saved residual — a copy of the stage's
        # weights per tick (GPipe) or per backward op (1F1B).
        weights = jax.tree.map(lambda a: a[rep], params_l)
        return lax.scan(layer, h, (weights, jnp.arange(k)))[0]

    return with_remat(chunk, remat, own_remat)


def layer_facts(stage_fn, *args) -> tuple[bool, frozenset[str]]:
    """``(own remat, checkpoint names)`` of ``stage_fn(*args)``, one trace: whether it runs
    under its own ``jax.checkpoint`` (a recipe's ``remat="full"`` layer: then the stage must
    not be wrapped again, ``with_remat``), and the names it gives values with
    ``jax.ad_checkpoint.checkpoint_name`` (what a names policy such as ``keep="lean"`` saves)."""
    from jax._src.ad_checkpoint import name_p, remat_p
    from jax.extend.core import jaxprs_in_params

    remat, names = [False], set()

    def walk(jaxpr) -> None:
        for e in jaxpr.eqns:
            remat[0] |= e.primitive is remat_p
            if e.primitive is name_p:
                names.add(e.params["name"])
            for j in jaxprs_in_params(e.params):
                walk(j)

    walk(jax.make_jaxpr(stage_fn)(*args).jaxpr)
    return remat[0], frozenset(names)


def stage_residuals(chunk, params_s, x_mb, extras_mb, n_data) -> list[tuple[tuple[int, ...], Any]]:
    """For ``explain()``: the residuals (shape, dtype) one device's layer group saves for one
    microbatch — what an explicit backward op rebuilds and holds while it runs. Shapes are
    local in the manual axes (pipe, data), global in the others. Traced while the step is
    traced (the stage may close over the step's values)."""
    from jax._src.ad_checkpoint import saved_residuals

    def local(a):
        return jax.ShapeDtypeStruct((a.shape[1] // n_data,) + tuple(a.shape[2:]), jnp.result_type(a))

    params_l = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], jnp.result_type(a)), params_s)
    h, extras = local(x_mb), jax.tree.map(local, extras_mb)
    res = saved_residuals(lambda P_, h, e: chunk(P_, 0, h, 0, 0, e), params_l, h, extras)
    weights = {tuple(a.shape[2:]) for a in jax.tree.leaves(params_s)}  # the group's (k, ...) stacks
    return [(tuple(a.shape), a.dtype) for a, where in res
            if "from the argument" not in where and tuple(a.shape) not in weights]


def chunk_backward(chunk, params_s, x_mb, extras_mb, n_data):
    """For ``explain()``: the jaxpr of what an explicit backward op runs for one microbatch —
    the chunk's forward (its recompute) and its VJP — with the chunk's ``(v, k, ...)`` weights
    first, then the stage input and the output cotangent; shapes as ``stage_residuals``. The
    estimate reads its working set with the step's liveness model (``cost.program.reader``). Traced
    while the step is traced."""
    def local(a):
        return jax.ShapeDtypeStruct((a.shape[1] // n_data,) + tuple(a.shape[2:]), jnp.result_type(a))

    params_l = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], jnp.result_type(a)), params_s)
    h, extras = local(x_mb), jax.tree.map(local, extras_mb)

    def op(P_, h, g):
        y, pull = jax.vjp(lambda P_, h: chunk(P_, 0, h, 0, 0, extras), P_, h)
        return pull(g.astype(y.dtype))

    return jax.make_jaxpr(op)(params_l, h, h)


# Ops that only move or re-type data: never saved for the backward (recomputed there, free of
# flops), so that nothing derived from a layer's weights — a reshape, a transpose, a cast, the
# circular schedule's per-tick slice of its layer group — is stacked once per tick.
_STRUCTURAL = frozenset({"dynamic_slice", "slice", "gather", "reshape", "squeeze", "expand_dims",
                         "broadcast_in_dim", "transpose", "convert_element_type", "copy", "name"})


def _save_all_but_structural(prim, *_, **__) -> bool:
    return prim.name not in _STRUCTURAL


def with_remat(fn, remat, own_remat=False):
    """``fn`` under the ``remat`` policy (a key of ``REMAT``, or a ``jax.checkpoint`` policy).

    ``remat="none"`` still wraps ``fn`` (saving all but the structural ops) — unless the
    layer checkpoints itself (``own_remat``): an outer checkpoint's policy reaches into a
    nested one (``jax.checkpoint`` partial-evaluates the inner body with the outer policy), so
    a ``remat="full"`` layer wrapped again saved every intermediate of every layer: the
    recipe's 1b model at 2 stages held 3.4x (1F1B) to 16x (GPipe) the temporaries of an
    un-pipelined layout on H100. Such a layer runs as it is: it saves its own inputs."""
    if remat == "none":
        return fn if own_remat else jax.checkpoint(fn, policy=_save_all_but_structural)
    if remat == "full":
        return jax.checkpoint(fn)
    return jax.checkpoint(fn, policy=remat if callable(remat) else REMAT[remat])


def row_spec(data, lead=1):
    """Spec of a (m, rows, ...) microbatch stack (``lead`` = dims before the rows)."""
    return P(*([None] * lead), data) if data else P()


def take(tree, i):
    """Row ``i`` of every leaf (a dynamic index)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def put(buf, val, i):
    """``buf`` with row ``i`` replaced by ``val`` (pytrees of the same structure)."""
    return jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, i, 0), buf, val)
