"""One trace of a loss's ``value_and_grad`` for every reading of it: the jaxpr the walk reads
(``walker``, ``reader``), and the residuals the forward pass saves for the backward as
``jax.ad_checkpoint``'s ``saved_residuals`` names them (``ProgramReading.saved``: the pipeline
memory model's residuals), read off the same trace instead of a second one.

The pass is traced as ``jax.value_and_grad`` builds it — ``jax.vjp`` of the loss in the
parameters, its VJP applied to the loss's unit cotangent — with the VJP's residuals as extra
outputs, which are dropped from the jaxpr the readings walk: its equations are those of
``jax.make_jaxpr(jax.value_and_grad(fn))``. The residuals are those of the gradient the step
takes (in the parameters; the batch is not differentiated).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax._src import core as jcore
# jax's own residual report and unit cotangent (private in jax 0.10: if they move, this fails
# loudly, at the first estimate).
from jax._src.ad_checkpoint import _saved_residuals
from jax._src.lax.lax import _one_vjp


def trace_pass(fn: Callable, params, batch) -> tuple[jcore.Jaxpr, list[tuple]]:
    """``(jaxpr, saved)``: the jaxpr of ``value_and_grad(fn)(params, batch)`` (outputs: the
    loss, then the gradients) and its saved residuals, ``[(aval, where)]`` as
    ``jax.ad_checkpoint.saved_residuals`` reports them."""

    def pass_and_residuals(p, b):
        loss, vjp = jax.vjp(lambda q: fn(q, b), p)
        grads, = vjp(_one_vjp(loss))
        return (loss, grads), jax.tree.leaves(vjp)

    closed, (out, _) = jax.make_jaxpr(pass_and_residuals, return_shape=True)(params, batch)
    jaxpr, n_out = closed.jaxpr, len(jax.tree.leaves(out))
    info = jaxpr.debug_info._replace(result_paths=None) if jaxpr.debug_info is not None else None
    saved = _saved_residuals(jaxpr.replace(outvars=jaxpr.outvars[n_out:], debug_info=info), ("",) * len(jaxpr.invars))
    return jaxpr.replace(outvars=jaxpr.outvars[:n_out], debug_info=info), saved
