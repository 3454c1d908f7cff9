"""The zero-bubble backward split without recompute: B keeps what W needs.

Zero-bubble schedules (Qi et al., ICLR 2024; their V-shaped variant, Qi et al. 2024,
"Pipeline Parallelism with Controllable Memory") split a chunk's backward into B, the input
gradient (on the critical path: it is sent upstream at once), and W, the weight gradient (run
later, in what would be the bubble). Done as two ``jax.vjp``s of the chunk, each recomputes
the chunk's forward, and W also carries the input cotangent through the layer scan again:
twice the layers' flops where 1F1B does 4/3.

Here B runs the chunk's forward once, layer by layer, keeping each layer's linearization (the
residual leaves of its ``jax.vjp``, without the layer's weights, which W reads from the stage
again), then walks the layers backwards through each layer's transpose. That transpose (a
jaxpr: residuals and output cotangent in, weight and input cotangents out) is cut in two:
the equations the input cotangent depends on run in B; the rest — those only the weight
cotangents need, the weight-gradient matmuls — run in W, from the values of B's part they
read (inside a layer: the cotangents arriving at each weight's matmul, and the residuals they
multiply). Nothing is computed twice: flops per microbatch are F (the F op) + F + B (the B
op) + W = 1F1B's. The price is memory: a pending W holds those values for its chunk's layers
from its B to its W; the schedule bounds how many are pending at once (``Schedule.pending_w``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core
from jax.extend.core import Literal


class SplitBackward:
    """``forward`` + ``input_grad`` (B) and ``weight_grad`` (W) of a chunk of ``k`` layers.

    ``layer(lp, h, j, group, mb, extras_mb)`` applies layer ``j`` of the chunk. A layer's
    linearization is stored as the leaves of its ``jax.vjp`` pullback minus the weights; the
    pullback's tree structure and the cut of its transpose (``_Cut``) are static, free of
    tracers, and recorded when B (or ``saved_shapes``) traces them; W reuses them.
    """

    def __init__(self, layer, k: int):
        self.layer, self.k = layer, k
        self._structure = None  # (treedef, ((leaf position, weight leaf index), ...))
        self._cut = None

    def _linearize(self, lp, h, j, ctx):
        y, pull = jax.vjp(lambda lp, h: self.layer(lp, h, j, *ctx), lp, h)
        leaves, treedef = jax.tree.flatten(pull)
        weight = {id(a): i for i, a in enumerate(jax.tree.leaves(lp))}
        self._structure = (treedef, tuple((n, weight[id(a)]) for n, a in enumerate(leaves) if id(a) in weight))
        return y, [a for a in leaves if id(a) not in weight]

    def _leaves(self, lp, kept):
        treedef, at = self._structure
        leaves, weights = list(kept), jax.tree.leaves(lp)
        for n, i in at:
            leaves.insert(n, weights[i])
        return treedef, leaves

    def forward(self, weights, h, ctx):
        """The chunk's output and its per-layer linearizations, stacked (k, ...)."""
        def step(h, xs):
            lp, j = xs
            return self._linearize(lp, h, j, ctx)

        return lax.scan(step, h, (weights, jnp.arange(self.k)))

    def input_grad(self, weights, kept, g):
        """B after ``forward``: the chunk's input cotangent, and what its W reads (per layer)."""
        def step(g, xs):
            lp, res = xs
            treedef, leaves = self._leaves(lp, res)
            transpose = _flat_jaxpr(lambda leaves, g: jax.tree.unflatten(treedef, leaves)(g), leaves, g)
            self._cut = _Cut(transpose, len(jax.tree.leaves(lp)), [n for n, _ in self._structure[1]])
            return self._cut.input_part(leaves, g)

        return lax.scan(step, g, (weights, kept), reverse=True)

    def weight_grad(self, weights, saved):
        """W: the chunk's weight gradient from what B left for it."""
        if self._cut is None:
            raise RuntimeError("SplitBackward.weight_grad traced before input_grad or saved_shapes")
        treedef = jax.tree.structure(weights)

        def step(_, xs):
            lp, reads = xs
            return None, jax.tree.unflatten(treedef, self._cut.weight_part(jax.tree.leaves(lp), reads))

        return lax.scan(step, None, (weights, saved))[1]

    def saved_shapes(self, weights, h, ctx):
        """Shapes and dtypes of what one pending W holds (for its ring buffer)."""
        def saved(weights, h):
            y, kept = self.forward(weights, h, ctx)
            return self.input_grad(weights, kept, jnp.zeros_like(y))[1]

        return jax.eval_shape(saved, weights, h)

    def saved_local(self, params_s, x_mb, extras_mb, n_data: int) -> list[tuple[tuple[int, ...], object]]:
        """For ``explain()``: (shape, dtype) of what one pending W holds on a device, shapes
        local in the manual axes (pipe, data) and global in the others (as
        ``stage.stage_residuals``). Traced while the step is traced."""
        def local(a):
            return jax.ShapeDtypeStruct((a.shape[1] // n_data,) + tuple(a.shape[2:]), jnp.result_type(a))

        weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], jnp.result_type(a)), params_s)
        saved = self.saved_shapes(weights, local(x_mb), (0, 0, jax.tree.map(local, extras_mb)))
        return [(tuple(a.shape), a.dtype) for a in jax.tree.leaves(saved)]

    def forwarded(self) -> list[bool]:
        """Per value a pending W holds (``saved_local``'s order): whether it is a residual of
        the layer's forward (a leaf of its linearization, which B's forward made anyway)
        rather than a value B's part of the transpose computed (a cotangent). Read after
        ``saved_local``."""
        if self._cut is None:
            raise RuntimeError("SplitBackward.forwarded read before saved_local")
        leaves = set(self._cut.invars[:-1])  # the pullback's leaves; the last invar is g
        return [v in leaves for v in self._cut.reads]


class _Cut:
    """A layer's transpose ``(pullback leaves, g) -> (weight cotangents..., input cotangent)``
    cut in two: ``input_part`` runs what the input cotangent needs and returns it with every
    value the rest reads (but the weights, which ``weight_part`` gets again); ``weight_part``
    runs the rest."""

    def __init__(self, closed, n_weights: int, weight_at: list[int]):
        jaxpr = closed.jaxpr
        self.consts = dict(zip(jaxpr.constvars, closed.consts))
        self.invars = jaxpr.invars
        self.w_out, self.x_out = jaxpr.outvars[:n_weights], jaxpr.outvars[n_weights:]
        self.b_eqns = _cone(jaxpr.eqns, self.x_out)
        in_b = set(map(id, self.b_eqns))
        self.w_eqns = [e for e in _cone(jaxpr.eqns, self.w_out) if id(e) not in in_b]
        # The weights (pullback leaves at weight_at) are not stored: W reads the stage's.
        self.weight_vars = [self.invars[n] for n in weight_at]
        made = {v for e in self.w_eqns for v in e.outvars}
        reads = [v for e in self.w_eqns for v in e.invars] + list(self.w_out)
        self.reads = list(dict.fromkeys(v for v in reads if _is_var(v) and v not in made
                                        and v not in self.consts and v not in self.weight_vars))

    def input_part(self, leaves, g):
        env = {**self.consts, **dict(zip(self.invars, [*leaves, g]))}
        _run(self.b_eqns, env)
        return _read(env, self.x_out[0]), [_read(env, v) for v in self.reads]

    def weight_part(self, weight_leaves, reads):
        env = {**self.consts, **dict(zip(self.reads, reads))}
        # weight_vars are the pullback's weight leaves in leaf order of the layer's params.
        env.update(zip(self.weight_vars, weight_leaves))
        _run(self.w_eqns, env)
        return [_read(env, v) for v in self.w_out]


def _is_var(v) -> bool:
    return not isinstance(v, Literal)


def _read(env, v):
    return v.val if isinstance(v, Literal) else env[v]


def _cone(eqns, outs):
    """The equations ``outs`` depend on, in program order."""
    need = {v for v in outs if _is_var(v)}
    cone = []
    for e in reversed(eqns):
        if any(o in need for o in e.outvars):
            cone.append(e)
            need.update(v for v in e.invars if _is_var(v))
    return cone[::-1]


def _run(eqns, env) -> None:
    """Binds ``eqns`` in order, reading and writing ``env`` (``jax.core.eval_jaxpr``'s loop)."""
    for e in eqns:
        env.update(zip(e.outvars, _bind(e, [_read(env, v) for v in e.invars])))


def _bind(e, ins) -> list:
    """``e``'s primitive bound on ``ins``, its outputs as a list. A ``pvary`` (an invariant ->
    varying cast over manual axes) casts only over the axes its input does not vary over yet:
    the equations were recorded where a value was invariant (a table the layer closes over,
    e.g. RoPE's) and are re-bound on the value read back from a kept-residual ring, which
    varies over every manual axis (``explicit``)."""
    if e.primitive is core.pvary_p:
        (x,) = ins
        axes = tuple(a for a in e.params["axes"] if a not in jax.typeof(x).mat.varying)
        return [core.pvary_p.bind(x, axes=axes) if axes else x]
    out = e.primitive.bind(*ins, **e.primitive.get_bind_params(e.params))
    return out if e.primitive.multiple_results else [out]


# Calls whose body is inlined before the cut (a jitted or checkpointed layer's transpose is
# one such equation, which would land whole on the input side).
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "checkpoint": "jaxpr", "remat2": "jaxpr"}


def _flat_jaxpr(fn, *args):
    """``jax.make_jaxpr(fn)(*args)`` with the bodies of ``_CALLS`` inlined (recursively).
    Loops and conditionals stay whole: a layer whose input and weight cotangents come out of
    one loop computes both in B (the flops are unchanged; W then only adds them up)."""
    closed = jax.make_jaxpr(fn)(*args)

    def inline(*flat):
        return _eval_inlined(closed.jaxpr, closed.consts, flat)

    return jax.make_jaxpr(inline)(*jax.tree.leaves(args))


def _eval_inlined(jaxpr, consts, args):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for e in jaxpr.eqns:
        ins = [_read(env, v) for v in e.invars]
        body = e.params.get(_CALLS.get(e.primitive.name, ""))
        if body is not None:
            inner, inner_consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, [])
            out = _eval_inlined(inner, inner_consts, ins)
        else:
            out = _bind(e, ins)
        env.update(zip(e.outvars, out))
    return [_read(env, v) for v in jaxpr.outvars]
