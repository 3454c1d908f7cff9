"""Reductions over the batch rows that the backward pass waits for: all-reduces over the data
axes that cannot join the gradients' reduction.

A reduction over a dimension the data axes split (a sum over the tokens) is an all-reduce over
those axes. Most such reductions in a training step are harmless to the op count: the loss's
mean reaches only the loss value, and a bias's gradient is a gradient like the others; XLA's
combiners fold them into the gradients' all-reduce. But where the reduced value comes back to
the rows — Switch's load-balancing loss (the share of tokens routed to each expert scales
every token's router gradient), BatchNorm's batch statistics — the rest of the pass waits for
it: one all-reduce of its own, before the gradients are even made. Independent ones run as one
op (the combiner again: two MoE layers' expert counts), a chain of them (one BatchNorm's
statistics feeding the next) one op per link. What is counted is the longest such chain behind
the gradients: the ops a step executes beside the gradients' reduction (measured on H100
compiles of the ``moe`` test family: one all-reduce of its two blocks' expert counts beside the
gradients', ``bench/cost_ranking.py``).

The reading is a visitor of the one walk of the traced ``value_and_grad`` jaxpr (``walker``),
through nested jaxprs (a loop body's chain counts once per trip), with ``program``'s
``split_of`` saying which values the data axes split (inside a ``shard_map`` manual over them,
values are local: no all-reduce).
"""

from __future__ import annotations

import math

from jax._src import core as jcore

from .walk import nbytes
from .walker import Frame, Scope, Visitor, Walker
from .op_kinds import REDUCE


class RowSyncs(Visitor):
    """The ``Walker`` visitor that finds them. ``depth``: waited-for syncs on the path to a var;
    ``pending``: the level of a reduced value that has not come back to the rows yet (a scalar,
    an expert count)."""

    def __init__(self, split_of):
        self.split_of = split_of
        self.depth: dict = {}
        self.pending: dict = {}
        self.level_bytes: dict[int, float] = {}

    def _split(self, aval, scope: Scope) -> float:
        return self.split_of(aval, None, scope.manual)[0]

    def equation(self, state, frame: Frame, i: int, e, subs: list):
        ins = [u for u in e.invars if not isinstance(u, jcore.Literal)]
        depth = max((self.depth.get(u, 0) for u in ins), default=0)
        pending = max((self.pending.get(u, 0) for u in ins), default=0)
        if subs:  # the nested jaxprs' chains decide (``leave``, ``after``)
            return depth, pending, [depth] * len(e.outvars), [pending] * len(e.outvars)
        split = lambda aval: self._split(aval, frame.scope)  # noqa: E731
        reduced = (e.primitive.name in REDUCE and ins and split(ins[0].aval) > 1
                   and all(split(v.aval) <= 1 for v in e.outvars))
        for v in e.outvars:
            if isinstance(v, jcore.DropVar):
                continue
            if reduced:  # an all-reduce over the data axes; it syncs once the rows read it
                self.depth[v], self.pending[v] = depth, max(pending, depth + 1)
                self.level_bytes.setdefault(depth + 1, 0.0)
                self.level_bytes[depth + 1] += frame.scope.times * nbytes(v.aval)
            elif split(v.aval) > 1:  # back on the rows: it waited for the reduction
                self.depth[v], self.pending[v] = max(depth, pending), 0
            else:
                self.depth[v], self.pending[v] = depth, pending
        return None

    def enter(self, state, frame: Frame, token, e, sub, outer: list, times: float, inner: Scope) -> bool:
        for iv, ov in zip(sub.invars, outer):
            literal = isinstance(ov, jcore.Literal)
            self.depth[iv] = 0 if literal else self.depth.get(ov, 0)
            self.pending[iv] = 0 if literal else self.pending.get(ov, 0)
        return True

    def leave(self, state, frame: Frame, token, e, sub, outer: list, times: float, result) -> None:
        """A nested jaxpr's chain, through its trip count for a loop."""
        if len(sub.outvars) != len(e.outvars):
            return
        times = 1.0 if math.isnan(times) else times
        depth, _, out_depth, out_pending = token
        for k, v in enumerate(sub.outvars):
            d = 0 if isinstance(v, jcore.Literal) else self.depth.get(v, 0)
            pd = 0 if isinstance(v, jcore.Literal) else self.pending.get(v, 0)
            # A loop runs its body's chain once per trip.
            out_depth[k] = max(out_depth[k], depth + (d - depth) * times if d > depth else d)
            out_pending[k] = max(out_pending[k], pd)

    def after(self, state, frame: Frame, token, i: int, e) -> None:
        if token is None:
            return
        for v, d, pd in zip(e.outvars, token[2], token[3]):
            if not isinstance(v, jcore.DropVar):
                self.depth[v], self.pending[v] = d, pd

    def found(self, jaxpr: jcore.Jaxpr) -> tuple[int, float]:
        """(all-reduces over the data axes the pass waits for, their result bytes) of one
        microbatch's ``value_and_grad`` jaxpr (outputs: the loss, then the gradients), once
        it has been walked."""
        grads = [v for v in jaxpr.outvars[1:] if not isinstance(v, jcore.Literal)]
        chain = int(max((self.depth.get(v, 0) for v in grads), default=0))
        return chain, sum(b for level, b in self.level_bytes.items() if level <= chain)


def row_syncs(jaxpr: jcore.Jaxpr, split_of) -> tuple[int, float]:
    """``RowSyncs`` alone on a traced pass (``read_program`` runs it in its one walk, beside the
    other readings): (all-reduces over the data axes the pass waits for, their result bytes).

    Args:
        jaxpr: one microbatch's ``value_and_grad`` jaxpr (outputs: the loss, then the gradients).
        split_of: ``reader.read_program``'s: ``(aval, None, manual axes) -> (data split, _)``.
    """
    syncs = RowSyncs(split_of)
    Walker([syncs], 0).walk(jaxpr)
    return syncs.found(jaxpr)
