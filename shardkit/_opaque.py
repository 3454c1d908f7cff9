"""``opaque(fn)``: ``fn`` run as one primitive that JAX's partial evaluation cannot split.

Why: linearizing a ``lax.scan`` (a model's layer scan) partially evaluates its body with the
loop-invariant values known, and a ``shard_map`` in it is cut in two: the piece that depends
on none of its inputs (masks built from ``axis_index``, zero inits, the empty index arrays
of ``x.at[:, :].set``) becomes a ``shard_map`` of its own, hoisted out of the loop. In jax
0.10.2 the compiler's import rejects that piece when its only operands are empty constants
("expected at least one operand of @xla.sdy.manual_computation_body to be produced by a
xla.sdy.GlobalToLocalShape CustomCallOp", docs/upstream/shardy_scan_shard_map_empty_operands.py),
and where it compiles it keeps every such value for the whole loop (a ring's masked score
blocks). ``sk.context_attention``'s ring met it under every remat policy: its custom VJP
(``optimize_remat=True``) bound the forward as one primitive, but once the policy recomputes
the forward in the backward, the forward pass no longer uses that primitive's residuals and
JAX replaces it there by the plain primal, a ``shard_map`` the scan then splits.

A primitive with no partial-evaluation rule is kept whole: run when its inputs are known,
staged (and recomputed under remat) when they are not. ``opaque`` is that primitive for any
function of arrays that closes over no traced value; it lowers to exactly ``fn``'s program
and is differentiated by the custom VJP around it (it has no JVP of its own), batched by
vmapping ``fn`` (``sk.DiLoCo``'s replicas).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jcore
from jax.interpreters import batching, mlir

_opaque_p = jcore.Primitive("shardkit_opaque")
_opaque_p.multiple_results = True


def opaque(fn: Callable) -> Callable:
    """``fn`` (a function of arrays, pytrees in and out, ``None`` leaves allowed) as one
    primitive equation; see the module docstring. ``fn`` must not close over traced values
    (pass them as arguments)."""

    def call(*args):
        flat, tree = jax.tree.flatten(args)
        closed, out_shape = jax.make_jaxpr(lambda *a: fn(*jax.tree.unflatten(tree, a)),
                                           return_shape=True)(*flat)
        if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
            raise TypeError(f"opaque({getattr(fn, '__name__', fn)}): the function closes over a traced "
                            "value; pass every array it reads as an argument")
        out = _opaque_p.bind(*flat, jaxpr=closed)
        return jax.tree.unflatten(jax.tree.structure(out_shape), out)

    return call


def _impl(*args, jaxpr):
    return jcore.jaxpr_as_fun(jaxpr)(*args)


def _abstract_eval(*args, jaxpr):
    del args
    return jaxpr.out_avals, jaxpr.effects


def _batch(axis_data, args, dims, *, jaxpr):
    """vmaps ``fn`` (its shard_maps batch with the vmap's spmd axis) and keeps it opaque."""
    fn = jax.vmap(jcore.jaxpr_as_fun(jaxpr), in_axes=tuple(dims), axis_size=axis_data.size,  # None: unbatched
                  axis_name=axis_data.name, spmd_axis_name=axis_data.spmd_name)
    return opaque(fn)(*args), [0] * len(jaxpr.out_avals)


_opaque_p.def_impl(_impl)
_opaque_p.def_effectful_abstract_eval(_abstract_eval)
mlir.register_lowering(_opaque_p, mlir.lower_fun(_impl, multiple_results=True))
batching.fancy_primitive_batchers[_opaque_p] = _batch
