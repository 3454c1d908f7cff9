"""The program reader's liveness simulation (``reader._Reader`` mixes it in): which results XLA
materialises and which it fuses into their consumers, their per-device bytes, and the peak of
the bytes alive at once in program order, each equation's own working set (its nested jaxprs'
peak, a matmul's operand copies) added where it runs."""

from __future__ import annotations

import math

import numpy as np
from jax._src import core as jcore

from .op_kinds import (EXPENSIVE as _EXPENSIVE, FUSIBLE as _FUSIBLE, MATMUL as _MATMUL, REDUCE as _REDUCE, VIEW as _VIEW,
                       whole_slice)
from .walk import elementwise_output as _elementwise_output, nbytes as _bytes


class Pass:
    """The bookkeeping of the reader's liveness pass over one jaxpr (``reader._Reader.open``):
    ``frame`` is the walk's (``walker.Frame``: the jaxpr and its consumer table)."""

    def __init__(self, frame, outputs_live: bool, reduced: set):
        jaxpr = frame.jaxpr
        self.outputs_live = outputs_live
        self.reduced = reduced  # equations XLA:CPU materialises for a reduction's operand
        self.fused: set = set()  # vars that XLA would not materialise
        self.roots: dict = {}  # var -> the materialised vars it is computed from
        self.last: dict = {}
        self.size: dict = {}
        self.born: dict = {}
        self.flops = self.total = 0.0
        self.inner_peak: dict = {}
        self.kernel_roots: dict = {}  # kernel_traffic's fusion: a fused value -> the values in memory it reads
        self.widened: dict = {}  # kernel_traffic: an upcast a matmul folds in -> its width ratio
        self.narrow: dict = {}  # kernel_traffic: a matmul result XLA writes narrower -> the ratio
        self.reductions: set = set()  # kernel_traffic: the values each reduction so far read
        self.inline = False  # kernel_traffic: the body of a call XLA inlines
        self.consumers: dict = frame.consumers
        self.jaxpr_out = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
        if not outputs_live:
            # A value that only reaches a nested jaxpr's output through reshapes and casts is
            # written straight into the caller's buffer too.
            for e in reversed(jaxpr.eqns):
                if (e.primitive.name in _VIEW and e.outvars[0] in self.jaxpr_out and e.invars
                        and not isinstance(e.invars[0], jcore.Literal) and len(self.consumers[e.invars[0]]) == 1):
                    self.jaxpr_out.add(e.invars[0])


class Liveness:
    """The liveness rules of ``reader._Reader``; they read the reader's state (splits, the
    values known whole) and write one ``Pass`` per jaxpr."""

    def _buffer(self, p: Pass, i: int, e, origin: dict) -> None:
        """Whether ``e``'s results are materialised or fused into their consumers, and if
        materialised, their per-device bytes and birth; the uses that keep their inputs alive."""
        name = e.primitive.name
        if (name in _FUSIBLE or name in _REDUCE) and any(u in self.unsplit for u in e.invars
                                                         if not isinstance(u, jcore.Literal)) and all(
                u in self.unsplit or self.split(u, origin)[1] <= 1 for u in e.invars
                if not isinstance(u, jcore.Literal)):
            self.unsplit.update(e.outvars)  # elementwise math of whole values stays whole
        outs = [v for v in e.outvars if not isinstance(v, jcore.DropVar)]
        consumers = p.consumers
        materialise = name not in _FUSIBLE or any(
            c not in _FUSIBLE and c not in _REDUCE for v in outs for c in consumers.get(v, ())) or (
            name in _EXPENSIVE and any(len(consumers.get(v, ())) > 1 for v in outs)) or i in p.reduced
        if not materialise and not any(v in p.jaxpr_out for v in outs):
            for v in e.outvars:
                p.fused.add(v)
                p.roots[v] = set().union(*[p.roots.get(u, {u}) for u in e.invars
                                           if not isinstance(u, jcore.Literal)]) if e.invars else set()
            return
        for u in e.invars:
            if isinstance(u, jcore.Literal):
                continue
            for r in p.roots.get(u, {u}):
                p.last[r] = i
        for v in e.outvars:
            if isinstance(v, jcore.DropVar):
                continue
            p.size[v] = self._result_bytes(p, e, v, origin)
            p.born[v] = i
            p.last.setdefault(v, i)
        _carry_in_place(p, e)


    def _masked_copies(self, p: Pass, i: int, e, origin: dict, operands: tuple[int, ...]) -> None:
        """The masked copies a ``ragged_dot_general`` run as a dense product reads
        (``walk.ragged_dot_masked``): ``G`` times each such operand's bytes, materialised as the
        dot's operand. The mask depends on the operand and the group sizes alone, so XLA makes
        one copy for every ragged dot of the jaxpr that reads the same operand with the same
        group sizes (common subexpressions: the forward's rows and the weights' gradient; the
        cotangent of the input gradient and of the weights' gradient): one buffer, alive from
        the first such dot through the last. Which copies XLA keeps from the forward into the
        backward (rather than re-making them there) is its fusion's choice: noted as unseen."""
        sizes = e.invars[2]
        groups = sizes.aval.shape[-1]
        if operands and groups > 1:
            self.unseen.setdefault("masked", f"lax.ragged_dot run as a dense product over {groups} groups: "
                                             "which of its masked row copies XLA keeps from the forward for "
                                             "the weights' gradient")
        for k in operands:
            u = e.invars[k]
            if isinstance(u, jcore.Literal):
                continue
            key = ("masked", u, sizes)
            if key not in p.size:
                p.size[key] = groups * self.size_of(u.aval, self.whole(origin, u), u)
                p.born[key] = i
            p.last[key] = i

    def _result_bytes(self, p: Pass, e, v, origin: dict) -> float:
        """Per-device bytes of the materialised result ``v`` of ``e``."""
        name = e.primitive.name
        view = (name in _VIEW or whole_slice(e)) and self.whole(origin, v) is not None
        # A nested jaxpr's outputs are written into its caller's buffers (a scan's
        # stacked outputs, a call's results): counted there, not here.
        inner_out = not p.outputs_live and v in p.jaxpr_out
        nbytes = 0.0 if (view and name != "convert_element_type") or inner_out else \
            self.size_of(v.aval, self.whole(origin, v), v)
        if name == "shard_map" and nbytes and _elementwise_output(e, e.outvars.index(v)):
            # A residual the body computes elementwise from values it keeps anyway:
            # once XLA has partitioned the shard_map away, it fuses the op into the
            # backward's consumers instead of storing it (as it does outside one).
            nbytes = 0.0
        elif name == "shard_map" and nbytes:
            # Its outputs (residuals for the backward included) are split as its
            # out_specs say over the axes it made manual.
            spec = e.params["out_specs"][e.outvars.index(v)]
            shape = dict(e.params["mesh"].shape)
            split = math.prod(shape[a] for entry in spec if entry is not None
                              for a in ((entry,) if isinstance(entry, str) else entry))
            if split > 1:
                nbytes = _bytes(v.aval) / split
        if self.canonical_dots and name in _MATMUL and np.dtype(v.aval.dtype).itemsize == 2:
            nbytes *= 2  # XLA:CPU computes 16-bit matmuls in f32 and keeps the f32 result
        return nbytes / self.held.get(v, 1.0)  # a loop's stacked weights or gradients (loop_stacks)

    def _sweep(self, p: Pass, jaxpr: jcore.Jaxpr, outputs_live: bool) -> float:
        """The peak of the live bytes: a buffer is live from its producing equation through its
        last use, plus each equation's own working set (``inner_peak``)."""
        end = len(jaxpr.eqns)
        for v in jaxpr.outvars:
            if isinstance(v, jcore.Literal):
                continue
            for r in p.roots.get(v, {v}):
                p.last[r] = end if outputs_live else max(p.last.get(r, 0), end - 1)
        delta = np.zeros(end + 2)
        for v, b in p.size.items():
            delta[p.born[v]] += b
            delta[p.last.get(v, p.born[v]) + 1] -= b
        live = np.cumsum(delta)[:end + 1]
        peak = 0.0
        for i in range(end + 1):
            peak = max(peak, live[i] + p.inner_peak.get(i, 0.0))
        self._live, self._born = live, p.born
        return float(peak)


def _carry_in_place(p: Pass, e) -> None:
    """A loop's carry written in place: where a ``scan``/``while`` carry's initial value is a
    buffer nothing reads after the loop, XLA hands that buffer to the loop and the carry's
    final value comes out in it (one buffer, not two: the chunked loss's f32 (vocab, d_model)
    gradient accumulator, started from zeros, held twice before)."""
    name = e.primitive.name
    if name == "scan":
        first, n = e.params["num_consts"], e.params["num_carry"]
    elif name == "while":
        first, n = e.params["cond_nconsts"] + e.params["body_nconsts"], len(e.outvars)
    else:
        return
    for u, v in zip(e.invars[first:first + n], e.outvars[:n]):
        if (isinstance(u, jcore.Literal) or isinstance(v, jcore.DropVar) or u not in p.size
                or len(p.consumers.get(u, ())) != 1 or u.aval.shape != v.aval.shape
                or u.aval.dtype != v.aval.dtype or v in p.jaxpr_out):
            continue
        p.size[v] = 0.0  # its uses keep the initial value's buffer alive instead
        p.roots[v] = p.roots.get(u, {u})
