"""The jaxpr walking ``cost.program``'s reader is built on: the nested jaxprs of an equation
with their trip counts, a ``shard_map`` output that needs no buffer of its own, an equation's
matmul flops, and the bookkeeping of one liveness pass."""

from __future__ import annotations

import math

import numpy as np
from jax._src import core as jcore

from .primitives import FUSIBLE as _FUSIBLE, VIEW as _VIEW


def sub_jaxprs(eqn) -> list[tuple[jcore.Jaxpr, list, float]]:
    """Nested jaxprs of an equation with the outer vars feeding their inputs and how many times
    each runs (``scan``: its length; a ``cond``: each branch once, the caller takes the max)."""
    p, name = eqn.params, eqn.primitive.name
    if name == "scan":
        return [(p["jaxpr"].jaxpr, list(eqn.invars), float(p["length"]))]
    if name == "cond":
        return [(b.jaxpr, list(eqn.invars[1:]), 1.0) for b in p["branches"]]
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        body = p["body_jaxpr"].jaxpr
        return [(body, list(eqn.invars[nc:nc + nb]) + list(eqn.invars[nc + nb:]), float("nan"))]
    out = []
    for sub in jcore.jaxprs_in_params(p):
        sub = getattr(sub, "jaxpr", sub)
        if _combiner(sub, eqn):
            continue  # a scatter's, reduce's or sort's scalar computation: not a region of the program
        if len(sub.invars) == len(eqn.invars):
            out.append((sub, list(eqn.invars), 1.0))
        elif len(sub.invars) < len(eqn.invars):  # custom_vjp: consts first
            out.append((sub, list(eqn.invars[len(eqn.invars) - len(sub.invars):]), 1.0))
    return out


def _combiner(sub: jcore.Jaxpr, eqn) -> bool:
    """Whether ``sub`` is the scalar function an array op applies element by element (a
    scatter's update, a reduction's or a sort's comparison): all its inputs are scalars
    while the op's are arrays. Its inputs and outputs do not correspond to the op's."""
    return all(not getattr(v.aval, "shape", ()) for v in sub.invars) and any(
        getattr(getattr(u, "aval", None), "shape", ()) for u in eqn.invars)


def elementwise_output(eqn, index: int) -> bool:
    """Whether a ``shard_map``'s output ``index`` needs no buffer of its own once XLA has
    partitioned the shard_map away: one of its inputs passed through (a weight saved for the
    backward: the caller's buffer), or a fusible elementwise op of values it keeps anyway."""
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    out = body.outvars[index]
    if isinstance(out, jcore.Literal) or out in body.invars:
        return True
    for e in body.eqns:
        if out in e.outvars:
            if e.primitive.name in _VIEW:
                return bool(e.invars) and e.invars[0] in body.invars
            return e.primitive.name in _FUSIBLE
    return False


def nbytes(aval) -> float:
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def dot_flops(eqn) -> float:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)
    rhs = eqn.invars[1].aval  # conv: rhs = (out_features, in_features / groups, *window)
    dn = eqn.params["dimension_numbers"]
    rhs_spec = dn.rhs_spec if dn is not None else tuple(range(rhs.ndim))
    window = math.prod(rhs.shape[d] for d in rhs_spec[2:])
    # A strided convolution's input gradient is a convolution of the gradient dilated by the
    # stride (lhs_dilation): the inserted zeros are not multiplied (cuDNN, XLA:GPU's count).
    dilated = math.prod(eqn.params.get("lhs_dilation") or (1,))
    return 2.0 * math.prod(out.shape) * rhs.shape[rhs_spec[1]] * window / dilated


class Pass:
    """The bookkeeping of one reading of one jaxpr (``program._Reader.run``)."""

    def __init__(self, jaxpr: jcore.Jaxpr, outputs_live: bool, reduced: set):
        self.outputs_live = outputs_live
        self.reduced = reduced  # equations XLA:CPU materialises for a reduction's operand
        self.fused: set = set()  # vars that XLA would not materialise
        self.roots: dict = {}  # var -> the materialised vars it is computed from
        self.last: dict = {}
        self.size: dict = {}
        self.born: dict = {}
        self.flops = self.total = 0.0
        self.inner_peak: dict = {}
        self.consumers: dict = {}
        self.jaxpr_out = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
        for e in jaxpr.eqns:
            for u in e.invars:
                if not isinstance(u, jcore.Literal):
                    self.consumers.setdefault(u, []).append(e.primitive.name)
        if not outputs_live:
            # A value that only reaches a nested jaxpr's output through reshapes and casts is
            # written straight into the caller's buffer too.
            for e in reversed(jaxpr.eqns):
                if (e.primitive.name in _VIEW and e.outvars[0] in self.jaxpr_out and e.invars
                        and not isinstance(e.invars[0], jcore.Literal) and len(self.consumers[e.invars[0]]) == 1):
                    self.jaxpr_out.add(e.invars[0])
