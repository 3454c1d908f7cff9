"""What the traced program says about a model: how each parameter is used, the matmul flops a
device executes, and the bytes its backward pass keeps alive.

Read off the jaxpr of one microbatch's ``value_and_grad`` — the user's own loss, whatever
its architecture — instead of assuming a transformer. Three readings:

* **uses**: a parameter consumed by a ``gather`` is a lookup table (no matmul flops), by a
  ``dot_general``/``conv`` a matmul weight; a tied table is both.
* **flops**: 2·M·N·K per ``dot_general`` (2 × output × kernel window × input features per
  group for a convolution), through ``scan`` trip counts and into every nested jaxpr; the
  matmuls inside ``sk.attention``'s Pallas flash kernels and ``sk.moe``'s grouped ones too
  (``flash``, ``walk.grouped_kernel``).
* **liveness**: a simulation of the buffers the forward + backward pass holds, in program
  order, with XLA's fusion rule of thumb: elementwise ops (and broadcasts, reshapes,
  transposes, casts) fuse into their consumers and are never materialised unless a
  non-fusible op (a matmul, a convolution, a gather/scatter, a loop) or the program's output
  needs them; reductions fuse their inputs. A value is freed after its last use.

Per-device sizes: a dimension equal to the microbatch's row count is split over the data
axes; a value derived from a parameter has that parameter's compute layout (gathered over
the data axes, split like its spec over the others); an activation is split over the
tensor-like axes when one of its feature dimensions is a tensor-sharded weight dimension
(Megatron's split) — except a matmul's result with a weight, which is split exactly when a dim
the product keeps is one the weight's spec splits (followed through views: a Conv1D kernel
used transposed), and whole otherwise (after the all-reduce of a split contraction's partial
sums); the batch, what a whole table looks up and elementwise math of whole values are whole; a
split feature reshaped into heads is followed dim by dim (``head_splits``).
These are the only guesses: ``ProgramReading.notes`` lists what the
reader could not see into (a ``while`` of unknown trip count, a custom call).

A fourth reading, **explicit collectives**: the collectives a program writes itself inside a
``shard_map`` (``sk.context_attention``'s ring, ``sk.moe``'s all-to-alls, a user's own) are
read off the jaxpr with their mesh axes and result bytes, through loop trip counts, instead of
being modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax._src import core as jcore

from . import cpu_buffers
from .flash import chunked_loss, flash_flops, scopes
from .gather_or_move import activations_smaller
from .loop_stacks import loop_held
from .row_syncs import row_syncs
from .walk import Pass as _Pass, elementwise_output as _elementwise_output
from .walk import (grouped_kernel as _grouped_kernel, nbytes as _bytes, ragged_dot_flops as _ragged_dot_flops,
                   scan_split, sub_jaxprs as _sub_jaxprs)
from .head_splits import HeadSplits
from .findings import ProgramReading as ProgramReading
from .tensor_splits import TensorSplits
from .op_kinds import (COLLECTIVES as _COLLECTIVES, EXPENSIVE as _EXPENSIVE, FUSIBLE as _FUSIBLE, MATMUL as _MATMUL,
                         OPAQUE as _OPAQUE, REDUCE as _REDUCE, SLICE as _SLICE, VIEW as _VIEW, view_dims)


class _Reader(TensorSplits):
    """One pass over a (nested) jaxpr: parameter identity, flops, and the liveness simulation."""

    def __init__(self, split_of: Callable, n_params: int, canonical_dots: bool):
        self.split_of = split_of
        # Per var viewing a parameter leaf whole: which of its dims are split over the tensor-like
        # axes (the leaf's spec, carried through transposes, reshapes, casts and loop slices).
        self.weight_dims: dict = {}
        self.rows = 0  # the microbatch's rows, where weight_dims are followed
        self.weight_axes: frozenset | None = None  # the mesh axes weight_dims are split over
        self.split_followed = True  # weight_dims followed into every shard_map
        self.reducing: dict = {}  # a tensor-parallel reduction's result -> (its elements, executions)
        self.manual: frozenset = frozenset()  # mesh axes a shard_map being read made manual
        self.shard_maps = 0
        self.in_loop = 0
        self.loop_use = [False] * n_params
        self.tensor_reduce = 0.0  # elements one device all-reduces over the tensor axes
        self.tensor_reduce_ops = 0.0
        self.canonical_dots = canonical_dots  # (aval, param index or None) -> bytes on one device
        self.grouped_ragged_dots = False  # read_program's grouped_ragged_dots
        self.ragged = False  # a ragged_all_to_all seen (ProgramReading.ragged)
        self.lookup = [False] * n_params
        self.matmul = [False] * n_params
        self.conv = [0] * n_params
        self.explicit: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        self.sliced: set = set()  # vars holding a slice of a parameter (a use of it, not its layout)
        self.unsplit: set = set()  # vars known whole over the tensor axes (see ``split``)
        self.notes: list[str] = []
        self.unseen: dict[str, str] = {}
        self._times = 1.0
        self.held: dict = {}  # a loop's stacked weights and gradients: var -> times smaller (loop_stacks)
        self.heads: HeadSplits | None = None  # activations split over several dims (heads)
        self.stack = ""  # the name stacks of the equations holding the jaxpr being read (``flash``)
        self.manual_devices = 1  # devices a shard_map being read splits over (its manual axes')

    def size_of(self, aval, leaf, var=None) -> float:
        d, t = self.split_of(aval, leaf, self.manual)
        if self.heads is not None and var in self.heads.parts:
            t = math.prod(self.heads.parts[var].values())
        return _bytes(aval) / (d * (1 if var in self.unsplit else t))

    def split(self, u, origin: dict) -> tuple[float, float]:
        """``split_of`` for a var: one known to be whole over the tensor axes is not split there."""
        d, t = self.split_of(u.aval, self.whole(origin, u), self.manual)
        return d, (1 if u in self.unsplit else t)

    def whole(self, origin: dict, v):
        """The parameter leaf ``v`` is a whole view of (its per-device size follows the leaf's
        layout), or None — also for a slice of one, which counts as a use of the leaf but is
        sized like any other value."""
        return None if isinstance(v, jcore.Literal) or v in self.sliced else origin.get(v)

    def run(self, jaxpr: jcore.Jaxpr, origin: dict, outputs_live: bool) -> tuple[float, float, float]:
        """Flops (one device's, all devices') and peak live bytes of ``jaxpr`` (its inputs
        excluded); ``origin`` maps vars to the parameter they view. With ``outputs_live`` the
        jaxpr's outputs stay to the end."""
        p = _Pass(jaxpr, outputs_live,
                  cpu_buffers.materialised_for_reductions(jaxpr.eqns, _FUSIBLE, _VIEW, _REDUCE)
                  if self.canonical_dots else set())
        for i, e in enumerate(jaxpr.eqns):
            name = e.primitive.name
            src = [origin.get(u) if not isinstance(u, jcore.Literal) else None for u in e.invars]
            if (name in _VIEW or name in _SLICE) and src and src[0] is not None:
                for v in e.outvars:
                    origin[v] = src[0]
                    if name in _SLICE or e.invars[0] in self.sliced:
                        self.sliced.add(v)
                if e.invars[0] in self.weight_dims:
                    dims = view_dims(e, self.weight_dims[e.invars[0]])
                    if dims is not None:
                        self.weight_dims[e.outvars[0]] = dims
            elif name == "gather" and src and src[0] is not None and not self.weight_dims.get(e.invars[0], {0}):
                self.unsplit.update(e.outvars)  # rows looked up in a table whole over the tensor axes
            if self.in_loop:
                for s_ in src:
                    if s_ is not None:
                        self.loop_use[s_] = True
            if name in ("add", "add_any") and not self.canonical_dots:
                self._reassociate(p, e)
            if self.heads is not None and not self.manual and name not in _MATMUL and not _sub_jaxprs(e):
                self._reduced(e.outvars[0], self.heads.follow(e, lambda u: self._dims(u, origin), self._times,
                                                              lambda v: self.split_of(v.aval, None, self.manual)[0]))
            kernel = _grouped_kernel(e)  # Megablox / Mosaic GPU grouped matmuls: sk.moe's experts
            flash = flash_flops(e, scopes(e, self.stack))  # sk.attention's Pallas flash kernels
            if flash is not None:
                kernel = ("flash", flash)
                # Per device already (sk.attention runs it in a shard_map manual over the rest).
                p.flops += flash
                p.total += flash * self.manual_devices
            elif name in _MATMUL and not self._head_matmul(p, e, origin, src):
                self._matmul(p, i, e, origin, src)
            elif name == "gather" and src and src[0] is not None:
                self.lookup[src[0]] = True
            elif name in _COLLECTIVES:
                self._collective(e)
            elif name == "ragged_dot_general":
                self._grouped(p, e, _ragged_dot_flops(e, grouped=self.grouped_ragged_dots))
            elif kernel is not None and kernel[0] != "flash":
                self._grouped(p, e, kernel[1])
            elif kernel is None and (name in _OPAQUE or "custom_call" in name):
                self.unseen.setdefault("kernel", f"a custom kernel ({name}) the reader cannot see into")
            if kernel is None:  # a kernel's body holds tiles, not the program's values
                self._nested(p, i, e, origin)
            self._buffer(p, i, e, origin)
        return p.flops, p.total, self._sweep(p, jaxpr, outputs_live)

    def _scans_weights(self, e, origin: dict) -> bool:
        """Whether a ``scan`` walks over stacked parameters (a layer scan, forward or backward)
        rather than over activations only (a recurrence: time steps, chunks)."""
        xs = e.invars[sum(scan_split(e)):]
        return any(not isinstance(u, jcore.Literal) and u in origin for u in xs)

    def _grouped(self, p: _Pass, e, flops: float) -> None:
        """A grouped matmul (``sk.moe``'s experts on their routed rows): its flops, a device's
        share of them as of its result (inside ``sk.moe``'s shard_map, all of them)."""
        d, t = self.split_of(e.outvars[0].aval, None, self.manual)
        p.total += flops
        p.flops += flops / (d * t)

    def _collective(self, e) -> None:
        """A collective the program writes itself: its executions and result bytes."""
        axes = e.params.get("axis_name", e.params.get("axes", ()))
        axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
        key = (_COLLECTIVES[e.primitive.name], tuple(a for a in axes if isinstance(a, str)))
        got = self.explicit.setdefault(key, [0.0, 0.0])
        got[0] += self._times
        nbytes = sum(self.size_of(v.aval, None) for v in e.outvars if not isinstance(v, jcore.DropVar))
        if e.primitive.name == "ragged_all_to_all":
            # The routed side, as hlo.traffic_from_hlo counts it: the smaller of the rows sent
            # and the buffer they land in (sk.moe's static receive buffer, or the rows home).
            nbytes = min(nbytes, self.size_of(e.invars[0].aval, None))
            self.ragged = True
        got[1] += self._times * nbytes

    def _nested(self, p: _Pass, i: int, e, origin: dict) -> None:
        """Reads an equation's nested jaxprs (loop bodies through their trip counts, a cond's
        branches, a shard_map's body with its manual axes); their peak is ``e``'s working set."""
        name = e.primitive.name
        subs = _sub_jaxprs(e)
        sub_peak = 0.0
        whole_out = None
        first_xs = sum(scan_split(e)) if name == "scan" else len(e.invars)
        for sub, outer, times in subs:
            inner_origin = {iv: origin[ov] for iv, ov in zip(sub.invars, outer)
                            if not isinstance(ov, jcore.Literal) and ov in origin}
            shift = len(e.invars) - len(outer)  # a while's cond consts, a custom_vjp's extra inputs
            for k, (iv, ov) in enumerate(zip(sub.invars, outer)):
                if isinstance(ov, jcore.Literal):
                    continue
                if ov in self.unsplit:
                    self.unsplit.add(iv)
                if ov in self.weight_dims:  # a scan's xs lose their leading (layer) dim
                    dims = self.weight_dims[ov]
                    self.weight_dims[iv] = (frozenset(d - 1 for d in dims if d > 0)
                                            if name == "scan" and k + shift >= first_xs else dims)
            self.sliced.update(iv for iv, ov in zip(sub.invars, outer)
                               if not isinstance(ov, jcore.Literal) and ov in self.sliced)
            if self.heads is not None:
                self.heads.enter(outer, sub.invars, [name == "scan" and k + shift >= first_xs
                                                     for k in range(len(outer))])
            if math.isnan(times):
                self.notes.append(f"a while loop of unknown trip count: its flops count once ({name})")
                self.unseen.setdefault("while", "a while loop of unknown trip count (its body counted once)")
                times = 1.0
            if (name == "scan" and times > 1 and not self.manual and not self._scans_weights(e, origin)
                    and not chunked_loss(scopes(e, self.stack))):  # sk.chunked_cross_entropy's chunks
                self.unseen.setdefault("recurrence", f"a scan of {times:.0f} steps over activations (a "
                                                     "recurrence inside a layer, not a layer scan)")
            loop = name in ("scan", "while")
            self.in_loop += loop
            outer_manual, outer_devices, outer_stack = self.manual, self.manual_devices, self.stack
            self.stack = scopes(e, self.stack)
            if name == "shard_map":  # inside, values are local over these axes
                self.shard_maps += 1
                new = frozenset(e.params.get("newly_manual_axes", ()))
                self.manual = self.manual | new
                self.manual_devices *= math.prod(dict(e.params["mesh"].shape).get(a, 1) for a in new)
                self.split_followed &= self.weight_axes is not None and not self.manual & self.weight_axes
            outer_times, self._times = self._times, self._times * times
            f, t, pk = self.run(sub, inner_origin, outputs_live=False)
            if self.heads is not None and len(sub.outvars) == len(e.outvars):
                self.heads.leave(sub.outvars, e.outvars, [name == "scan" and k >= scan_split(e)[1]
                                                          for k in range(len(e.outvars))])
            if len(sub.outvars) == len(e.outvars):
                # A weight the body hands out (a shard_map's residual for its backward, one copy
                # per device stacked along dim 0) keeps its split dims.
                self.weight_dims.update((o, self.weight_dims[v]) for v, o in zip(sub.outvars, e.outvars)
                                        if v in self.weight_dims and v.aval.ndim == o.aval.ndim)
                kept = {k for k, v in enumerate(sub.outvars) if not isinstance(v, jcore.Literal) and v in self.unsplit}
                whole_out = kept if whole_out is None else whole_out & kept
            self.in_loop -= loop
            self.manual, self.manual_devices, self.stack = outer_manual, outer_devices, outer_stack
            self._times = outer_times
            p.flops += f * times
            p.total += t * times
            sub_peak = max(sub_peak, pk)
        if subs:
            p.inner_peak[i] = p.inner_peak.get(i, 0.0) + sub_peak
        self.unsplit.update(e.outvars[k] for k in (whole_out or ()))

    def _buffer(self, p: _Pass, i: int, e, origin: dict) -> None:
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

    def _result_bytes(self, p: _Pass, e, v, origin: dict) -> float:
        """Per-device bytes of the materialised result ``v`` of ``e``."""
        name = e.primitive.name
        view = name in _VIEW and self.whole(origin, v) is not None
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
        return nbytes / self.held.get(v, 1.0)

    def _sweep(self, p: _Pass, jaxpr: jcore.Jaxpr, outputs_live: bool) -> float:
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


def read_program(fn: Callable, params, batch, *, split_of: Callable, n_params: int,
                 canonical_dots: bool = False, weight_dims: list | None = None,
                 weight_axes: frozenset | None = None, feature_dims: Callable | None = None,
                 tensor_axis: int = 1, grouped_ragged_dots: bool = False,
                 stored_split: list | None = None, grad_split: list | None = None) -> ProgramReading:
    """Traces ``value_and_grad(fn)(params, batch)`` and reads it (see the module docstring).

    Args:
        fn: ``(params, batch) -> scalar loss``.
        params, batch: abstract inputs (``ShapeDtypeStruct``), global shapes.
        split_of: ``(aval, leaf index or None, manual axes) -> (data split, tensor split)``:
            how many devices share the value along the data axes and along the others; inside
            a ``shard_map`` the value is already local over the manual axes it names.
        n_params: the number of parameter leaves (the first ``n_params`` inputs).
        canonical_dots: XLA:CPU's matmuls: count the copies it makes of non-canonical operands,
            and its f32 results of 16-bit matmuls.
        weight_dims: per parameter leaf, the dims its spec splits over the tensor-like axes:
            then a matmul with a weight places its tensor-parallel reduction by the weight's
            dims, not by sizes (a d_model-wide projection input is not taken for a split
            feature), and the batch and what a whole table looks up are whole over those axes.
            None: the size rule alone (sequence or context parallelism split activations on
            other grounds).
        weight_axes: the mesh axes ``weight_dims`` are split over: inside a ``shard_map``
            manual over none of them the weights keep those dims (None: no shard_map does).
        feature_dims, tensor_axis: with ``weight_dims``, the dims of an activation the size rule
            reads as tensor-split (``shape -> [dims]``) and the tensor axes' size: a split
            feature reshaped into heads is then followed dim by dim (``head_splits``).
        grouped_ragged_dots: XLA:TPU's ``lax.ragged_dot``: its forward and input gradient run
            as grouped matmuls (each row meets one group's weights), not as the masked dense
            product over all groups XLA:CPU and XLA:GPU run (``walk.ragged_dot_flops``).
        stored_split, grad_split: per parameter leaf, how many times smaller than its compute
            layout its stored layout and the gradient a loop writes are: a scanned stack of
            layers is then sized that way where only a loop reads or writes it
            (``loop_stacks``). None: every stack at its compute layout.
    """
    grad_fn = jax.value_and_grad(fn)
    closed = jax.make_jaxpr(grad_fn)(params, batch)
    jaxpr = closed.jaxpr
    origin = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
    reader = _Reader(split_of, n_params, canonical_dots)
    reader.grouped_ragged_dots = grouped_ragged_dots
    if stored_split is not None or grad_split is not None:
        ones = [1.0] * n_params
        reader.held = loop_held(jaxpr, n_params, stored_split or ones, grad_split or ones)
    if weight_dims is not None:
        reader.weight_dims = {v: frozenset(d) for v, d in zip(jaxpr.invars[:n_params], weight_dims)}
        reader.weight_axes = weight_axes
        reader.unsplit.update(jaxpr.invars[n_params:])
        leaves = jax.tree.leaves(batch)
        reader.rows = leaves[0].shape[0] if leaves and leaves[0].shape else 0
        if feature_dims is not None and tensor_axis > 1:
            reader.heads = HeadSplits(tensor_axis, feature_dims)
    flops, total, peak = reader.run(jaxpr, origin, outputs_live=True)
    # The forward/backward boundary: the first equation that consumes the loss's cotangent
    # seed is hard to name in a jaxpr; the live bytes where the pass is largest before any
    # gradient-shaped output is born is a fair stand-in for "what the forward keeps".
    live = reader._live
    grads = [v for v in jaxpr.outvars[1:] if not isinstance(v, jcore.Literal)]
    first_grad = min((reader._born.get(v, len(live)) for v in grads), default=len(live) - 1)
    residuals = float(max(live[:max(first_grad, 1)], default=0.0))
    heads = reader.heads
    if heads is not None and heads.relayouts:
        reader.unseen.setdefault("relayout", heads.relayouts[0] + " (XLA moves blocks between layouts: "
                                 "all-to-alls, permutes)")
    if heads is not None and heads.spills:
        reader.unseen.setdefault("head-spill", heads.spills[0] + " (XLA reduce-scatters some per-head "
                                 "partial sums there and gathers them back where they are read)")
    return ProgramReading(reader.lookup, reader.matmul, reader.conv, reader.loop_use, flops, total, peak, residuals,
                          reader.tensor_reduce, reader.tensor_reduce_ops, reader.notes,
                          {k: tuple(v) for k, v in reader.explicit.items()}, reader.shard_maps, reader.unseen,
                          row_syncs(jaxpr, split_of), reader.weight_axes is not None and reader.split_followed,
                          activations_smaller(jaxpr, n_params), reader.ragged)



def jaxpr_peak(closed, *, n_params: int, split_of: Callable, canonical_dots: bool = False,
               whole: Callable = lambda v: False) -> float:
    """The liveness peak (bytes, one device) of an already traced program — ``read_program``'s
    ``peak`` for a jaxpr that is not a loss's ``value_and_grad`` (a pipeline's backward op).

    Args:
        closed: a ``ClosedJaxpr``; its first ``n_params`` inputs are parameter leaves (sized by
            their layout), the rest activations; inputs excluded, outputs live at the end.
        n_params, split_of, canonical_dots: as ``read_program``.
        whole: which of the jaxpr's own vars are known whole over the tensor axes (where their
            shape alone would pass for a tensor-split activation).
    """
    jaxpr = closed.jaxpr
    reader = _Reader(split_of, n_params, canonical_dots)
    reader.unsplit.update(v for e in jaxpr.eqns for v in e.outvars if whole(v))
    return reader.run(jaxpr, {v: i for i, v in enumerate(jaxpr.invars[:n_params])}, outputs_live=True)[2]
