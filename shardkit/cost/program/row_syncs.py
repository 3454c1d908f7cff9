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

The reading is a walk over the traced ``value_and_grad`` jaxpr, through nested jaxprs (a loop
body's chain counts once per trip), with ``program``'s ``split_of`` saying which values the data
axes split (inside a ``shard_map`` manual over them, values are local: no all-reduce).
"""

from __future__ import annotations

import math

from jax._src import core as jcore

from .walk import nbytes, sub_jaxprs
from .op_kinds import REDUCE


class _Walk:
    """``depth``: waited-for syncs on the path to a var; ``pending``: the level of a reduced
    value that has not come back to the rows yet (a scalar, an expert count)."""

    def __init__(self, split_of):
        self.split_of = split_of
        self.manual: frozenset = frozenset()
        self.depth: dict = {}
        self.pending: dict = {}
        self.level_bytes: dict[int, float] = {}
        self._times = 1.0

    def split(self, aval) -> float:
        return self.split_of(aval, None, self.manual)[0]

    def run(self, jaxpr: jcore.Jaxpr) -> None:
        for e in jaxpr.eqns:
            ins = [u for u in e.invars if not isinstance(u, jcore.Literal)]
            depth = max((self.depth.get(u, 0) for u in ins), default=0)
            pending = max((self.pending.get(u, 0) for u in ins), default=0)
            subs = sub_jaxprs(e)
            if subs:
                self._nested(e, subs, depth, pending)
                continue
            reduced = (e.primitive.name in REDUCE and ins and self.split(ins[0].aval) > 1
                       and all(self.split(v.aval) <= 1 for v in e.outvars))
            for v in e.outvars:
                if isinstance(v, jcore.DropVar):
                    continue
                if reduced:  # an all-reduce over the data axes; it syncs once the rows read it
                    self.depth[v], self.pending[v] = depth, max(pending, depth + 1)
                    self.level_bytes.setdefault(depth + 1, 0.0)
                    self.level_bytes[depth + 1] += self._times * nbytes(v.aval)
                elif self.split(v.aval) > 1:  # back on the rows: it waited for the reduction
                    self.depth[v], self.pending[v] = max(depth, pending), 0
                else:
                    self.depth[v], self.pending[v] = depth, pending

    def _nested(self, e, subs, depth: float, pending: float) -> None:
        """A nested jaxpr's chain, through its trip count for a loop."""
        outer_manual, outer_times = self.manual, self._times
        if e.primitive.name == "shard_map":
            self.manual = self.manual | frozenset(e.params.get("newly_manual_axes", ()))
        out_depth = [depth] * len(e.outvars)
        out_pending = [pending] * len(e.outvars)
        for sub, outer, times in subs:
            times = 1.0 if math.isnan(times) else times
            self._times = outer_times * times
            for iv, ov in zip(sub.invars, outer):
                literal = isinstance(ov, jcore.Literal)
                self.depth[iv] = 0 if literal else self.depth.get(ov, 0)
                self.pending[iv] = 0 if literal else self.pending.get(ov, 0)
            self.run(sub)
            if len(sub.outvars) != len(e.outvars):
                continue
            for k, v in enumerate(sub.outvars):
                d = 0 if isinstance(v, jcore.Literal) else self.depth.get(v, 0)
                pd = 0 if isinstance(v, jcore.Literal) else self.pending.get(v, 0)
                # A loop runs its body's chain once per trip.
                out_depth[k] = max(out_depth[k], depth + (d - depth) * times if d > depth else d)
                out_pending[k] = max(out_pending[k], pd)
        self.manual, self._times = outer_manual, outer_times
        for v, d, pd in zip(e.outvars, out_depth, out_pending):
            if not isinstance(v, jcore.DropVar):
                self.depth[v], self.pending[v] = d, pd


def row_syncs(jaxpr: jcore.Jaxpr, split_of) -> tuple[int, float]:
    """(all-reduces over the data axes the pass waits for, their result bytes) of one
    microbatch's ``value_and_grad`` jaxpr (outputs: the loss, then the gradients).

    Args:
        jaxpr: the traced pass.
        split_of: ``program.read_program``'s: ``(aval, None, manual axes) -> (data split, _)``.
    """
    w = _Walk(split_of)
    w.run(jaxpr)
    grads = [v for v in jaxpr.outvars[1:] if not isinstance(v, jcore.Literal)]
    chain = int(max((w.depth.get(v, 0) for v in grads), default=0))
    return chain, sum(b for level, b in w.level_bytes.items() if level <= chain)
