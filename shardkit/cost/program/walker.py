"""One walk of a traced jaxpr, handing each equation to the readings that need it.

The program reader's readings (``reader``: liveness, flops, parameter uses, tensor splits, head
splits, explicit collectives; ``row_syncs``; ``gather_or_move``) all need the same things of
an equation: how many times it runs (the trip counts of the loops around it), which mesh axes
a ``shard_map`` around it made manual, which parameter leaf a value is a view of, and which
equations read a value. ``Walker`` works these out once, descending through every nested
jaxpr (``walk.sub_jaxprs``: loop bodies, a ``cond``'s branches, a ``shard_map``'s body, calls),
and hands each equation to small visitors (``Visitor``), in program order:

* ``open(frame)`` when a jaxpr is entered (its per-jaxpr state), ``close(state, frame)`` when
  it is left (what the jaxpr comes to, handed to the caller's ``leave``);
* ``equation(state, frame, i, e, subs)`` before an equation's nested jaxprs;
* per nested jaxpr ``enter(...)`` (False: this visitor does not read inside it, e.g. a
  kernel's body, which holds tiles rather than the program's values) and ``leave(...)``;
* ``after(state, frame, token, i, e)`` once its nested jaxprs are read.

A visitor keeps its own state; the walker's is ``Frame`` (the jaxpr, its ``Scope``, the
parameter origin of its vars and its consumer table).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax._src import core as jcore

from .op_kinds import SLICE, VIEW
from .walk import sub_jaxprs

_LOOPS = ("scan", "while")


def scopes(eqn, enclosing: str) -> str:
    """The name stacks along the path to ``eqn``: ``enclosing`` (those of the equations the
    walk descended through) and its own (a nested jaxpr's equations carry theirs relative
    to the equation holding it)."""
    return f"{enclosing}/{eqn.source_info.name_stack}"


@dataclasses.dataclass(frozen=True)
class Scope:
    """Where a jaxpr being walked sits in the program.

    Attributes:
        times: how many times it runs per pass (the trip counts of the loops around it; a
            ``while`` of unknown trip count counts once).
        manual: the mesh axes the ``shard_map``\\ s around it made manual (values are local
            over them).
        manual_devices: the devices those axes span.
        stack: the name stacks of the equations holding it (``scopes``).
        loops: how many loops (``scan``, ``while``) hold it.
    """
    times: float = 1.0
    manual: frozenset = frozenset()
    manual_devices: int = 1
    stack: str = ""
    loops: int = 0

    def inside(self, eqn, times: float) -> "Scope":
        """The scope of a jaxpr nested in ``eqn`` that runs ``times`` per execution of it (NaN:
        unknown, counted once)."""
        name = eqn.primitive.name
        manual, devices = self.manual, self.manual_devices
        if name == "shard_map":  # inside, values are local over these axes
            new = frozenset(eqn.params.get("newly_manual_axes", ()))
            manual = manual | new
            devices *= math.prod(dict(eqn.params["mesh"].shape).get(a, 1) for a in new)
        return Scope(self.times * (1.0 if math.isnan(times) else times), manual, devices,
                     scopes(eqn, self.stack), self.loops + (name in _LOOPS))


class Frame:
    """One jaxpr being walked.

    Attributes:
        jaxpr: the jaxpr.
        scope: where it sits (``Scope``).
        origin: var -> the parameter leaf it is a view of (a reshape, cast, transpose or slice
            of one; a nested jaxpr's inputs fed by one), for every var of the walk so far.
        consumers: var -> the primitive names of the equations of this jaxpr that read it.
    """

    def __init__(self, jaxpr: jcore.Jaxpr, scope: Scope, origin: dict):
        self.jaxpr, self.scope, self.origin = jaxpr, scope, origin
        self.consumers: dict = {}
        for e in jaxpr.eqns:
            for u in e.invars:
                if not isinstance(u, jcore.Literal):
                    self.consumers.setdefault(u, []).append(e.primitive.name)

    def source(self, e) -> list:
        """The parameter leaf each operand of ``e`` views (None: not a parameter's)."""
        return [None if isinstance(u, jcore.Literal) else self.origin.get(u) for u in e.invars]


class Visitor:
    """A reading ``Walker`` hands equations to (see the module docstring); every hook may be
    left as is."""

    def open(self, frame: Frame) -> Any:
        return None

    def equation(self, state, frame: Frame, i: int, e, subs: list) -> Any:
        return None

    def enter(self, state, frame: Frame, token, e, sub: jcore.Jaxpr, outer: list, times: float,
              inner: Scope) -> bool:
        return True

    def leave(self, state, frame: Frame, token, e, sub: jcore.Jaxpr, outer: list, times: float, result) -> None:
        pass

    def after(self, state, frame: Frame, token, i: int, e) -> None:
        pass

    def close(self, state, frame: Frame) -> Any:
        return None


class Walker:
    """Walks a jaxpr once for several visitors (see the module docstring).

    Args:
        visitors: the readings, in the order they are handed each equation.
        n_params: the jaxpr's first ``n_params`` inputs are parameter leaves (``Frame.origin``).
    """

    def __init__(self, visitors: list[Visitor], n_params: int):
        self.visitors = list(visitors)
        self.n_params = n_params

    def walk(self, jaxpr: jcore.Jaxpr) -> list:
        """Walks ``jaxpr``; returns each visitor's ``close`` of it."""
        origin = {v: i for i, v in enumerate(jaxpr.invars[:self.n_params])}
        return self._walk(jaxpr, Scope(), origin, self.visitors)

    def _walk(self, jaxpr: jcore.Jaxpr, scope: Scope, origin: dict, visitors: list[Visitor]) -> list:
        frame = Frame(jaxpr, scope, origin)
        states = [v.open(frame) for v in visitors]
        for i, e in enumerate(jaxpr.eqns):
            src = frame.source(e)
            if (e.primitive.name in VIEW or e.primitive.name in SLICE) and src and src[0] is not None:
                for v in e.outvars:
                    origin[v] = src[0]
            subs = sub_jaxprs(e)
            tokens = [v.equation(st, frame, i, e, subs) for v, st in zip(visitors, states)]
            for sub, outer, times in subs:
                inner = scope.inside(e, times)
                going = [k for k, v in enumerate(visitors)
                         if v.enter(states[k], frame, tokens[k], e, sub, outer, times, inner)]
                if not going:
                    continue
                inner_origin = {iv: origin[ov] for iv, ov in zip(sub.invars, outer)
                                if not isinstance(ov, jcore.Literal) and ov in origin}
                results = self._walk(sub, inner, inner_origin, [visitors[k] for k in going])
                for k, r in zip(going, results):
                    visitors[k].leave(states[k], frame, tokens[k], e, sub, outer, times, r)
            for v, st, tok in zip(visitors, states, tokens):
                v.after(st, frame, tok, i, e)
        return [v.close(st, frame) for v, st in zip(visitors, states)]
