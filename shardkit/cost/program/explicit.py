"""The collectives a program writes itself: inside a ``shard_map`` (``sk.context_attention``'s
ring, ``sk.moe``'s all-to-alls, a user's own), read off the jaxpr with their mesh axes and result
bytes, through loop trip counts, instead of being modelled. A visitor of the program reader's
one walk (``walker``)."""

from __future__ import annotations

import math

from jax._src import core as jcore

from .flash import kernel_call
from .op_kinds import COLLECTIVES
from .walk import nbytes
from .walker import Frame, Scope, Visitor, scopes


# XLA:TPU lays arrays out in tiles whose rows are 128 lanes of 32 bits (a vector register's
# row): it pads a ragged-all-to-all's rows to whole tile rows before sending them (sk.moe's
# 64-wide f32 rows go as 128 in a v5p compile, ``pad(...), padding=0_0x0_64``; 32-wide bf16 rows
# as 256, ``bf16[..,2,128]``), so they travel at that width.
TPU_ROW_BYTES = 128 * 4


class ExplicitCollectives(Visitor):
    """``explicit``: ``{(collective kind, mesh axes): [executions, result bytes]}`` per device
    (``ProgramReading.explicit``); ``ragged``: a ragged-all-to-all was seen.

    Args:
        split_of: ``read_program``'s: ``(aval, None, manual axes) -> (data split, tensor split)``.
        ragged_row_bytes: what a ragged-all-to-all's rows are padded to a multiple of, in bytes
            (``read_program``'s).
    """

    def __init__(self, split_of, ragged_row_bytes: int = 1):
        self.split_of = split_of
        self.ragged_row_bytes = ragged_row_bytes
        self.explicit: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        self.ragged = False

    def _bytes(self, aval, scope: Scope) -> float:
        d, t = self.split_of(aval, None, scope.manual)
        return nbytes(aval) / (d * t)

    def equation(self, state, frame: Frame, i: int, e, subs: list):
        if e.primitive.name not in COLLECTIVES:
            return None
        axes = e.params.get("axis_name", e.params.get("axes", ()))
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        key = (COLLECTIVES[e.primitive.name], tuple(a for a in axes if isinstance(a, str)))
        got = self.explicit.setdefault(key, [0.0, 0.0])
        got[0] += frame.scope.times
        size = sum(self._bytes(v.aval, frame.scope) for v in e.outvars if not isinstance(v, jcore.DropVar))
        if e.primitive.name == "ragged_all_to_all":
            # The routed side, as hlo.traffic_from_hlo counts it: the smaller of the rows sent
            # and the buffer they land in (sk.moe's static receive buffer, or the rows home).
            size = min(size, self._bytes(e.invars[0].aval, frame.scope))
            row = e.invars[0].aval.shape[-1] * e.invars[0].aval.dtype.itemsize
            size *= math.ceil(row / self.ragged_row_bytes) * self.ragged_row_bytes / row
            self.ragged = True
        got[1] += frame.scope.times * size
        return None

    def enter(self, state, frame: Frame, token, e, sub, outer: list, times: float, inner: Scope) -> bool:
        return kernel_call(e, scopes(e, frame.scope.stack)) is None  # a kernel's body holds tiles
