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

The jaxpr is traced once and walked once (``walker``); beside the reader's own visitor, the
same walk hands each equation to ``row_syncs``, ``gather_or_move`` and ``explicit`` (the
collectives a program writes itself inside a ``shard_map``: ``sk.context_attention``'s ring,
``sk.moe``'s all-to-alls, a user's own, read off the jaxpr instead of being modelled).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
from jax._src import core as jcore

from ...rules import entry_axes
from . import cpu_buffers
from .explicit import ExplicitCollectives
from .flash import chunked_loss, kernel_call
from .gather_or_move import ActivationsSmaller
from .loop_stacks import loop_held
from .row_syncs import RowSyncs
from .liveness import Liveness, Pass as _Pass
from .walk import (nbytes as _bytes, ragged_dot_flops as _ragged_dot_flops, ragged_dot_masked as _ragged_dot_masked,
                   scan_split)
from .walker import Frame, Scope, Visitor, Walker, scopes
from .head_splits import HeadSplits
from .findings import ProgramReading as ProgramReading
from .kernel_traffic import KernelTraffic
from .tensor_splits import TensorSplits
from .trace import trace_pass
from .op_kinds import (FUSIBLE as _FUSIBLE, MATMUL as _MATMUL, OPAQUE as _OPAQUE, REDUCE as _REDUCE, SLICE as _SLICE,
                       VIEW as _VIEW, view_dims, whole_slice)


class _Token:
    """What the reader carries from an equation to its nested jaxprs and back (``after``)."""
    __slots__ = ("kernel", "nested", "sub_peak", "whole_out", "flops0")

    def __init__(self, kernel, nested: bool, flops0: float):
        self.kernel = kernel  # a kernel call's (name, flops): its body is not read
        self.nested = nested  # the equation has nested jaxprs
        self.sub_peak = 0.0
        self.whole_out = None
        self.flops0 = flops0  # the pass's flops before the equation: its own are the difference


class _Reader(TensorSplits, Liveness, KernelTraffic, Visitor):
    """The walk's main visitor (``walker``): parameter identity, flops, and the liveness
    simulation. Where it is in the program (trip counts, manual axes, name stacks, loops) is
    the scope of the jaxpr it reads (``walker.Scope``)."""

    def __init__(self, split_of: Callable, n_params: int, canonical_dots: bool):
        self.split_of = split_of
        # Per var viewing a parameter leaf whole: which of its dims are split over the tensor-like
        # axes (the leaf's spec, carried through transposes, reshapes, casts and loop slices).
        self.weight_dims: dict = {}
        self.rows = 0  # the microbatch's rows, where weight_dims are followed
        self.weight_axes: frozenset | None = None  # the mesh axes weight_dims are split over
        self.tensor_axes: frozenset = frozenset()  # the tensor-like mesh axes (read_program's weight_axes)
        self.split_followed = True  # weight_dims followed into every shard_map
        self.reducing: dict = {}  # a tensor-parallel reduction's result -> (its elements, executions)
        self.shard_maps = 0
        self.weight_shard_maps = 0
        self.loop_use = [False] * n_params
        self.tensor_reduce = 0.0  # elements one device all-reduces over the tensor axes
        self.tensor_reduce_ops = 0.0
        self.canonical_dots = canonical_dots  # (aval, param index or None) -> bytes on one device
        self.grouped_ragged_dots = False  # read_program's grouped_ragged_dots
        self.lookup = [False] * n_params
        self.matmul = [False] * n_params
        self.conv = [0] * n_params
        self.sliced: set = set()  # vars holding a slice of a parameter (a use of it, not its layout)
        self.unsplit: set = set()  # vars known whole over the tensor axes (see ``split``)
        self.notes: list[str] = []
        self.kernels: list = []  # (flops, bytes, executions) per kernel (kernel_traffic)
        self._inline: list = []
        self.unseen: dict[str, str] = {}
        self.held: dict = {}  # a loop's stacked weights and gradients: var -> times smaller (loop_stacks)
        self.heads: HeadSplits | None = None  # activations split over several dims (heads)
        self._frames: list[Frame] = []  # the jaxprs being read, innermost last

    @property
    def _scope(self) -> Scope:
        return self._frames[-1].scope

    @property
    def manual(self) -> frozenset:
        """Mesh axes the shard_maps around the jaxpr being read made manual."""
        return self._scope.manual

    @property
    def _times(self) -> float:
        return self._scope.times

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

    def open(self, frame: Frame) -> _Pass:
        # The outermost jaxpr's outputs stay to the end (the gradients); a nested one's are
        # written into its caller's buffers.
        outputs_live = not self._frames
        self._frames.append(frame)
        p = _Pass(frame, outputs_live,
                  cpu_buffers.materialised_for_reductions(frame.jaxpr.eqns, _FUSIBLE, _VIEW, _REDUCE)
                  if self.canonical_dots else set())
        self._opened(p)
        return p

    def close(self, p: _Pass, frame: Frame) -> tuple[float, float, float]:
        """Flops (one device's, all devices') and peak live bytes of the jaxpr (its inputs
        excluded)."""
        self._frames.pop()
        self._closed(p, frame.jaxpr)
        return p.flops, p.total, self._sweep(p, frame.jaxpr, p.outputs_live)

    def equation(self, p: _Pass, frame: Frame, i: int, e, subs: list) -> _Token:
        name, origin = e.primitive.name, frame.origin
        flops0 = p.flops
        src = frame.source(e)
        if (name in _VIEW or name in _SLICE) and src and src[0] is not None:
            for v in e.outvars:  # the walker made them views of the parameter
                # a slice of all of it (``w[rep]`` of a one-chunk stack) stays a view of the leaf
                if (name in _SLICE and not whole_slice(e)) or e.invars[0] in self.sliced:
                    self.sliced.add(v)
            if e.invars[0] in self.weight_dims:
                dims = view_dims(e, self.weight_dims[e.invars[0]])
                if dims is not None:
                    self.weight_dims[e.outvars[0]] = dims
        elif name == "gather" and src and src[0] is not None and not self.weight_dims.get(e.invars[0], {0}):
            self.unsplit.update(e.outvars)  # rows looked up in a table whole over the tensor axes
        elif name == "sharding_constraint" and self.tensor_axes and not constrained_axes(e) & self.tensor_axes:
            # An activation the program constrains whole over the tensor-like axes (under
            # sequence parallelism, a tensor-parallel region's gathered input): XLA keeps it so.
            self.unsplit.update(e.outvars)
        if self._scope.loops:
            for s_ in src:
                if s_ is not None:
                    self.loop_use[s_] = True
        if name in ("add", "add_any") and not self.canonical_dots:
            self._reassociate(p, e)
        if self.heads is not None and not self.manual and name not in _MATMUL and not subs:
            self._reduced(e.outvars[0], self.heads.follow(e, lambda u: self._dims(u, origin), self._times,
                                                          lambda v: self.split_of(v.aval, None, self.manual)[0]))
        # sk.attention's Pallas flash kernels, Megablox / Mosaic GPU grouped matmuls (sk.moe's experts)
        kernel = kernel_call(e, scopes(e, self._scope.stack))
        if kernel is not None and kernel[0] == "flash":
            # Per device already (sk.attention runs it in a shard_map manual over the rest).
            p.flops += kernel[1]
            p.total += kernel[1] * self._scope.manual_devices
        elif name in _MATMUL and not self._head_matmul(p, e, origin, src):
            self._matmul(p, i, e, origin, src)
        elif name == "gather" and src and src[0] is not None:
            self.lookup[src[0]] = True
        elif name == "ragged_dot_general":
            self._grouped(p, e, _ragged_dot_flops(e, grouped=self.grouped_ragged_dots))
            self._masked_copies(p, i, e, origin, _ragged_dot_masked(e, grouped=self.grouped_ragged_dots))
        elif kernel is not None and kernel[0] != "flash":
            self._grouped(p, e, kernel[1])
        elif kernel is None and (name in _OPAQUE or "custom_call" in name):
            self.unseen.setdefault("kernel", f"a custom kernel ({name}) the reader cannot see into")
        return _Token(kernel, bool(subs), flops0)

    def after(self, p: _Pass, frame: Frame, tok: _Token, i: int, e) -> None:
        if tok.kernel is None:  # a kernel's body holds tiles, not the program's values
            if tok.nested:
                p.inner_peak[i] = p.inner_peak.get(i, 0.0) + tok.sub_peak
            self.unsplit.update(e.outvars[k] for k in (tok.whole_out or ()))
        self._buffer(p, i, e, frame.origin)
        self._kernel(p, e, frame.origin, p.flops - tok.flops0, tok.nested and tok.kernel is None)

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

    def enter(self, p: _Pass, frame: Frame, tok: _Token, e, sub, outer: list, times: float, inner: Scope) -> bool:
        """Before an equation's nested jaxpr (a loop body through its trip count, a cond's
        branch, a shard_map's body with its manual axes) is read: what its inputs carry in."""
        if tok.kernel is not None:
            return False
        name, origin = e.primitive.name, frame.origin
        first_xs = sum(scan_split(e)) if name == "scan" else len(e.invars)
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
                and not chunked_loss(scopes(e, self._scope.stack))):  # sk.chunked_cross_entropy's chunks
            self.unseen.setdefault("recurrence", f"a scan of {times:.0f} steps over activations (a "
                                                 "recurrence inside a layer, not a layer scan)")
        if name == "shard_map":  # inside, values are local over its manual axes
            self.shard_maps += 1
            # One that takes a parameter (sk.moe's experts, a user's own layer) leaves XLA to
            # decide where that weight is gathered and kept; an attention kernel's takes
            # activations only.
            self.weight_shard_maps += any(not isinstance(u, jcore.Literal) and u in origin for u in e.invars)
            self.split_followed &= self.weight_axes is not None and not inner.manual & self.weight_axes
        self._into_call(p, e, sub, outer)
        return True

    def leave(self, p: _Pass, frame: Frame, tok: _Token, e, sub, outer: list, times: float, result) -> None:
        """After a nested jaxpr is read: what its outputs carry out; its flops through its trip
        count, its peak toward ``e``'s working set."""
        name = e.primitive.name
        times = 1.0 if math.isnan(times) else times
        if self.heads is not None and len(sub.outvars) == len(e.outvars):
            self.heads.leave(sub.outvars, e.outvars, [name == "scan" and k >= scan_split(e)[1]
                                                      for k in range(len(e.outvars))])
        if len(sub.outvars) == len(e.outvars):
            # A weight the body hands out (a shard_map's residual for its backward, one copy
            # per device stacked along dim 0) keeps its split dims.
            self.weight_dims.update((o, self.weight_dims[v]) for v, o in zip(sub.outvars, e.outvars)
                                    if v in self.weight_dims and v.aval.ndim == o.aval.ndim)
            kept = {k for k, v in enumerate(sub.outvars) if not isinstance(v, jcore.Literal) and v in self.unsplit}
            tok.whole_out = kept if tok.whole_out is None else tok.whole_out & kept
        self._out_of_call(p, e)
        f, t, pk = result
        p.flops += f * times
        p.total += t * times
        tok.sub_peak = max(tok.sub_peak, pk)


def constrained_axes(e) -> frozenset:
    """The mesh axes a ``sharding_constraint`` equation splits its value over."""
    spec = getattr(e.params.get("sharding"), "spec", None) or ()
    return frozenset(a for entry in spec for a in entry_axes(entry))


def read_program(fn: Callable, params, batch, *, split_of: Callable, n_params: int,
                 canonical_dots: bool = False, weight_dims: list | None = None,
                 weight_axes: frozenset | None = None, feature_dims: Callable | None = None,
                 tensor_axis: int = 1, grouped_ragged_dots: bool = False, ragged_row_bytes: int = 1,
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
            Also without ``weight_dims``: a value a ``sharding_constraint`` leaves whole over
            them is sized whole (a sequence-parallel region's gathered input).
        feature_dims, tensor_axis: with ``weight_dims``, the dims of an activation the size rule
            reads as tensor-split (``shape -> [dims]``) and the tensor axes' size: a split
            feature reshaped into heads is then followed dim by dim (``head_splits``).
        grouped_ragged_dots: XLA:TPU's ``lax.ragged_dot``: its forward and input gradient run
            as grouped matmuls (each row meets one group's weights), not as the masked dense
            product over all groups XLA:CPU and XLA:GPU run (``walk.ragged_dot_flops``).
        ragged_row_bytes: a ragged-all-to-all's rows travel padded to a multiple of this many
            bytes: XLA:TPU's ``explicit.TPU_ROW_BYTES`` (whole 128-lane tile rows), 1 elsewhere.
        stored_split, grad_split: per parameter leaf, how many times smaller than its compute
            layout its stored layout and the gradient a loop writes are: a scanned stack of
            layers is then sized that way where only a loop reads or writes it
            (``loop_stacks``). None: every stack at its compute layout.
    """
    jaxpr, saved = trace_pass(fn, params, batch)
    reader = _Reader(split_of, n_params, canonical_dots)
    reader.grouped_ragged_dots = grouped_ragged_dots
    reader.tensor_axes = weight_axes or frozenset()
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
    syncs, moved = RowSyncs(split_of), ActivationsSmaller(n_params)
    explicit = ExplicitCollectives(split_of, ragged_row_bytes)
    (flops, total, peak), *_ = Walker([reader, syncs, moved, explicit], n_params).walk(jaxpr)
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
                          {k: tuple(v) for k, v in explicit.explicit.items()}, reader.shard_maps, reader.unseen,
                          syncs.found(jaxpr), reader.weight_axes is not None and reader.split_followed,
                          moved.moved, explicit.ragged, saved, weight_shard_maps=reader.weight_shard_maps,
                          kernels=reader.kernels)



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
    return Walker([reader], n_params).walk(jaxpr)[0][2]
