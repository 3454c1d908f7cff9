"""The kernels the traced pass launches, each with its flops and the device-memory bytes it
moves: the program reader's side of the step-time roofline (``steptime.roofline_excess``), as
``compiled.kernels`` is the compiled program's.

XLA:GPU's fusion as a rule, on the jaxpr: an elementwise chain fuses into its consumer —
another elementwise op or a reduction, across the calls XLA inlines (``INLINE``) — and a
kernel is a matmul, a convolution, a reduction, a gather, or the op ending a chain whose
result must reach memory (``_materialised``). A kernel reads each value in memory its chain
starts from once (its "roots") and writes its results once, so a BatchNorm's statistics, its
normalisation and the ReLU after it each cost a pass over the activations however many
equations they hold (Williams et al. 2009, "Roofline"). Four of XLA's rewrites are followed:
sibling reductions over the same values are one pass, an upcast a matmul reads is folded into
it (the matmul reads the 16-bit value and writes 16 bits), cuDNN returns a 16-bit
convolution's result in 16 bits, and reshapes, squeezes, constraints and transposes of a value
in memory move nothing (bitcasts, or layouts its consumers take). A slice or lookup reads
what it takes; an in-place update writes its update. Sizes are per device, as the liveness
pass sizes them (``liveness``); each kernel counts the trip counts of the loops around it.
"""

from __future__ import annotations

from jax._src import core as jcore

from .op_kinds import EXPENSIVE, FUSIBLE, MATMUL, REDUCE, SLICE

# Equations XLA turns into bitcasts or folds into its consumers' layouts: no pass of their own
# when they act on a value already in memory.
_FREE = {"reshape", "squeeze", "expand_dims", "sharding_constraint", "pvary", "pcast", "copy", "copy_p",
         "transpose", "stop_gradient"}
# XLA:GPU fuses elementwise chains (a backward's gradient sums, ``add_any``, among them) into
# their consumers, reductions included.
_ELEMENTWISE = FUSIBLE | {"add_any"}
_UPDATES = {"dynamic_update_slice", "scatter", "scatter-add", "scatter_add"}
# Calls XLA inlines (a ``jit`` inside the loss, ``custom_jvp`` functions such as ``relu``,
# remat): their bodies fuse with what surrounds them.
INLINE = {"pjit", "jit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "closed_call",
          "core_call", "remat", "checkpoint"}


class KernelTraffic:
    """The reader's kernel list (``reader._Reader`` mixes it in): ``kernels`` holds
    ``(flops, bytes, executions)`` per kernel, per device, for one microbatch's pass; a
    ``liveness.Pass``'s ``kernel_roots`` maps each fused value to the values in memory it is
    computed from."""

    kernels: list
    _inline: list  # roots carried into (and out of) an inlined call's body

    def _into_call(self, p, e, sub, outer: list) -> None:
        """Before an inlined call's body (``INLINE``) is walked: its inputs are the outer
        values' fusions, not values in memory."""
        if e.primitive.name in INLINE:
            roots = p.kernel_roots
            self._inline.append({iv: roots.get(ov, {ov}) for iv, ov in zip(sub.invars, outer)
                                 if not isinstance(ov, jcore.Literal)})

    def _opened(self, p) -> None:
        """A body's ``liveness.Pass`` was opened: an inlined call's gets its inputs' fusions and
        does not write its results unless its own rules say so."""
        if self._inline and isinstance(self._inline[-1], dict):
            p.kernel_roots.update(self._inline.pop())
            p.inline = True

    def _closed(self, p, jaxpr) -> None:
        """A body's pass is closed: an inlined call hands its results' fusions out."""
        if p.inline:
            self._inline.append([None if isinstance(v, jcore.Literal) else p.kernel_roots.get(v)
                                 for v in jaxpr.outvars])

    def _out_of_call(self, p, e) -> None:
        """After an inlined call's body: its results are what the body fused them from."""
        if e.primitive.name in INLINE and self._inline and isinstance(self._inline[-1], list):
            for o, roots in zip(e.outvars, self._inline.pop()):
                if roots is not None:
                    p.kernel_roots[o] = roots

    def _kernel(self, p, e, origin: dict, flops: float, nested: bool) -> None:
        """Reads equation ``e`` (after its nested jaxprs, with the ``flops`` the reader
        counted for it; ``nested``: its nested jaxprs are walked, their equations are the
        kernels): fuses it into its consumers or records it as a kernel."""
        roots_of = p.kernel_roots
        outs = [v for v in e.outvars if not isinstance(v, jcore.DropVar)]
        ins = [u for u in e.invars if not isinstance(u, jcore.Literal)]
        name = e.primitive.name
        if nested or not outs:
            return
        roots = set().union(*[roots_of.get(u, {u}) for u in ins]) if ins else set()
        # a matmul result XLA writes narrower (below) is read at that width
        size = lambda v: self.size_of(v.aval, self.whole(origin, v), v) * p.narrow.get(v, 1.0)  # noqa: E731
        written = sum(size(v) for v in outs)
        if name == "convert_element_type" and _widens(e) and all(c in MATMUL for c in p.consumers.get(outs[0], ())):
            # XLA folds an upcast into the matmul that reads it (a 16-bit operand computed in
            # f32): the matmul reads the 16-bit value — written by the chain computing it, if
            # one does — and writes its result at that width.
            u = e.invars[0]
            if u in roots_of:
                self.kernels.append((0.0, size(u) + sum(size(r) for r in roots), self._times))
            roots_of[outs[0]] = {u}
            p.widened[outs[0]] = e.invars[0].aval.dtype.itemsize / outs[0].aval.dtype.itemsize
            return
        if name in MATMUL and ins and all(u in p.widened for u in ins):
            for v in outs:
                p.narrow[v] = max(p.widened[u] for u in ins)
        elif name == "conv_general_dilated" and ins:
            # cuDNN's convolutions return their operands' type: XLA:GPU writes a 16-bit
            # convolution's f32 result (``preferred_element_type``) in 16 bits and widens it
            # in the kernels that read it.
            for v in outs:
                p.narrow[v] = min(u.aval.dtype.itemsize for u in ins) / v.aval.dtype.itemsize
        written = sum(size(v) for v in outs)
        if name in _ELEMENTWISE and not self._materialised(p, e, outs, sum(map(size, roots)), written):
            for v in outs:
                roots_of[v] = roots
            return
        if name in _FREE and not flops and all(u not in roots_of for u in ins):
            return  # a bitcast of a value in memory
        if name in SLICE or name == "gather":
            moved = 2 * written
        elif name in _UPDATES and len(ins) > 1:
            moved = 2 * size(e.invars[1] if name == "dynamic_update_slice" else e.invars[-1])
        elif name in REDUCE and frozenset(roots) in p.reductions:
            # A sibling of an earlier reduction over the same values (a BatchNorm's sum and
            # sum of squares): XLA fuses them into one pass that reads the values once.
            moved = written
        else:
            moved = written + sum(size(r) for r in roots)
        if name in REDUCE:
            p.reductions.add(frozenset(roots))
        self.kernels.append((flops, moved, self._times))

    @staticmethod
    def _materialised(p, e, outs, reads: float, written: float) -> bool:
        """Whether an elementwise equation's result is written to memory: a consumer that is
        neither elementwise nor a reduction reads it, the jaxpr returns it, or ``k`` > 1
        consumers read it and it is an expensive op (``EXPENSIVE``, which XLA does not
        duplicate) or duplicating it into each consumer moves more bytes than writing it once
        and reading it ``k`` times: ``(k - 1) · reads > (k + 1) · written``, with ``reads``
        the bytes of the values in memory it is computed from — the trade XLA:GPU's fusion
        cost model weighs. A cast or a normalisation of one activation is duplicated; a
        backward's gradient that several blocks add into is written once, not grown into one
        chain that reads every block's values."""
        consumers = p.consumers
        k = max(len(consumers.get(v, ())) for v in outs)
        return any(c not in _ELEMENTWISE and c not in REDUCE and c not in INLINE
                   for v in outs for c in consumers.get(v, ())) or (
            k > 1 and (e.primitive.name in EXPENSIVE or (k - 1) * reads > (k + 1) * written)) or (
            not p.inline and any(v in p.jaxpr_out for v in outs))


def _widens(e) -> bool:
    """Whether a cast makes its operand's elements wider (bf16 -> f32)."""
    u = e.invars[0]
    return not isinstance(u, jcore.Literal) and e.outvars[0].aval.dtype.itemsize > u.aval.dtype.itemsize
