"""One expert function run as grouped matmuls: ``grouped_expert(expert_fn, params_ExP, rows_MxD,
group_sizes_E)`` applies expert ``e`` to the ``group_sizes[e]`` consecutive rows of its group.

``sk.moe``'s user writes ``expert_fn(params_of_one_expert, rows)``. Its dropless ragged path
holds every device's received rows sorted by expert in one buffer, where a ``vmap`` over experts
would need a padded ``(E, rows, D)`` buffer again. So the function is traced once for one
expert's parameter shapes and the buffer's rows, and its program re-evaluated with the stacked
weights: a matmul of the rows by a weight becomes a grouped matmul (``kernels.grouped``: a
Mosaic grouped GEMM on TPU and, where it fits, on H100s), work on the weights alone (casts,
transposes) runs per expert (``vmap``), and work on the
rows alone (activations, ``sk.constrain``) runs as traced. Anything else that mixes rows with a
weight (a bias added per expert, a weight used elementwise) is refused with ``NotGroupable``,
naming the operation; ``sk.moe`` then runs its padded form and says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.extend import core as jcore

from .kernels.grouped import grouped_matmul

_PARAM, _ROW, _CONST = "param", "row", "const"


class NotGroupable(ValueError):
    """The expert function mixes the token rows with a weight other than through a matmul."""


def grouped_expert(expert_fn: Callable[[Any, jax.Array], jax.Array], params: Any, rows_MxD: jax.Array,
                   group_sizes: jax.Array) -> jax.Array:
    """``expert_fn`` on each expert's group of rows; rows past ``sum(group_sizes)`` give zeros
    through ``lax.ragged_dot`` (and are not to be read: the GPU kernel leaves them unwritten).

    Args:
        expert_fn: ``expert_fn(params_of_one_expert, rows_RxD) -> rows_RxDo``.
        params: pytree of stacked weights, leading dimension ``E``.
        rows_MxD: the rows, sorted by expert.
        group_sizes: ``(E,)`` int32 rows per expert, in order.

    Raises:
        NotGroupable: ``expert_fn`` combines the rows with a weight other than by a matmul.
    """
    # Traced on values (not shapes) so that, inside a shard_map, the program carries the manual
    # axes the rows and weights vary over (constants get their casts to varying).
    one = jax.tree.map(lambda a: a[0], params)
    closed = jax.make_jaxpr(expert_fn)(one, rows_MxD)
    leaves = jax.tree.leaves(params)
    args = [(_PARAM, a) for a in leaves] + [(_ROW, rows_MxD)]
    (kind, out), = _eval(closed.jaxpr, [(_CONST, c) for c in closed.consts], args, group_sizes)
    if kind != _ROW:
        raise NotGroupable("expert_fn's output does not depend on its token rows")
    return out


def _eval(jaxpr, consts, args, group_sizes):
    env = {}

    def read(v):
        return (_CONST, v.val) if isinstance(v, jcore.Literal) else env[v]

    for v, val in zip(jaxpr.constvars, consts):
        env[v] = val
    for v, val in zip(jaxpr.invars, args):
        env[v] = val
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        kinds = {k for k, _ in ins}
        outs = _apply(eqn, ins, kinds, group_sizes)
        for v, val in zip(eqn.outvars, outs):
            env[v] = val
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, vals):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _apply(eqn, ins, kinds, group_sizes):
    vals = [v for _, v in ins]
    if _PARAM not in kinds:  # the rows' own work (or constants): as traced
        kind = _ROW if _ROW in kinds else _CONST
        return [(kind, o) for o in _bind(eqn, vals)]
    if _ROW not in kinds:  # the weights' own work (casts, transposes): once per expert
        axes = [0 if k == _PARAM else None for k, _ in ins]
        outs = jax.vmap(lambda *a: tuple(_bind(eqn, a)), in_axes=axes)(*vals)
        return [(_PARAM, o) for o in outs]
    if eqn.primitive.name == "dot_general":
        return [(_ROW, _ragged(eqn, ins, group_sizes))]
    inner = _inner_jaxpr(eqn)
    if inner is not None:  # jit-wrapped helpers (jnp.einsum), remat, custom derivatives: look inside
        jaxpr, consts = inner
        return _eval(jaxpr, [(_CONST, c) for c in consts], ins, group_sizes)
    raise NotGroupable(f"expert_fn applies {eqn.primitive.name} to the token rows and an expert "
                       f"weight together ({eqn.source_info.name_stack or 'top level'}); only matmuls "
                       "of the rows by a weight run grouped")


def _inner_jaxpr(eqn):
    """``(jaxpr, consts)`` of a call-like equation whose inputs are its body's."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        j = eqn.params.get(name)
        if isinstance(j, jcore.ClosedJaxpr):
            return j.jaxpr, j.consts
        if isinstance(j, jcore.Jaxpr) and len(j.invars) == len(eqn.invars):  # remat's body
            return j, []
    return None


def _ragged(eqn, ins, group_sizes):
    """``rows @ weight`` (either operand order, the weight either way round), grouped."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    (k0, a), (k1, b) = ins
    rows_first = k0 == _ROW
    rows, w, rows_c, w_c = (a, b, lc, rc) if rows_first else (b, a, rc, lc)
    if lb or rb or rows.ndim != 2 or w.ndim != 3 or tuple(rows_c) != (1,) or {k0, k1} != {_ROW, _PARAM}:
        raise NotGroupable(f"expert_fn's matmul {eqn.params['dimension_numbers']} of rows {rows.shape} "
                           f"and an expert weight {w.shape[1:]} is not a (rows, K) x (K, N) product")
    w_ExKxN = w if tuple(w_c) == (0,) else w.swapaxes(1, 2)
    out = grouped_matmul(rows, w_ExKxN, group_sizes, precision=eqn.params["precision"],
                         preferred_element_type=eqn.params["preferred_element_type"])
    return out if rows_first else out.T
