"""Tensor splits an activation carries over several of its dims: a tensor-split feature reshaped
into heads (``(B, T, 64)`` split 8 ways into ``(B, T, 4, 16)``), followed dim by dim through the
program, and the collectives XLA adds where a contraction meets them.

XLA's sharding propagation splits a reshaped dim outermost factor first: 64 features over 8
devices become 4 heads over 4 devices and each head's 16 features over the other 2 — when the
heads do not divide the axis, the split spills into the head's own dims. A contraction over a
dim a device holds part of leaves partial sums that XLA all-reduces over the devices sharing
that dim, whatever the operands are: a head's logits (q·k over the head dim), a block-diagonal
gate (``... h i, h i j -> ... h j``), the key/value gradients (summed over the heads).
Checked on XLA:GPU's compiles of recurrentgemma's Griffin and HF GPT-2 (4 heads each) at
tensor=8 and tensor=4. What it cannot bound is reported, never guessed: slices,
concatenations or pads along a dim split this way (rotary embeddings that split the head dim,
which XLA moves with all-to-alls and permutes), a product whose two operands keep dims split
over the same devices (XLA gathers or moves one of them), and the gathers XLA adds around a
split that spilled into the heads' own dims (it reduce-scatters some per-head partial sums
and gathers them back where they are read).

``program._Reader`` asks ``HeadSplits`` for the dims of each value; a value not followed here
keeps the reader's own rules (weight specs, the size rule).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from jax._src import core as jcore

from .op_kinds import FUSIBLE, REDUCE, SLICE, VIEW

Dims = dict  # {dim: devices of the tensor axis that share it}; the product divides the axis


def _spread(factor: int, sizes: list[int]) -> list[int] | None:
    """A split of ``factor`` devices over dims of ``sizes`` (outermost first), as XLA's
    reshape propagation tiles them; None where they do not divide (XLA pads or replicates)."""
    out, rem = [], factor
    for n in sizes:
        g = math.gcd(n, rem)
        out.append(g)
        rem //= g
    return out if rem == 1 else None


def reshape_dims(src: tuple, dst: tuple, dims: Dims) -> tuple[Dims | None, bool]:
    """The split dims of a reshape's result: each group of input dims whose sizes multiply to a
    group of output dims passes its devices to those, outermost first; None where a split does
    not divide the dims it lands on. Also whether a split dim was factored into several."""
    out: Dims = {}
    factored = False
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [i], [j]
        if i >= len(src) or j >= len(dst):  # trailing dims of size 1
            i, j = i + 1, j + 1
            continue
        pi, pj = src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                pi *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pj *= dst[j]
                gj.append(j)
                j += 1
            else:
                return None, False
        factor = math.prod(dims.get(d, 1) for d in gi)
        if factor > 1:
            got = _spread(factor, [dst[d] for d in gj])
            if got is None:
                return None, False
            out.update({d: f for d, f in zip(gj, got) if f > 1})
            factored |= sum(dst[d] > 1 for d in gj) > 1
    return out, factored


class HeadSplits:
    """The per-dim splits of the values that carry one (see the module docstring), and the
    collectives they cost one device per microbatch.

    Attributes:
        parts: var -> ``Dims``, for the values followed here.
        relayouts: what XLA moves between layouts that is not counted (slices, concatenations,
            pads along a dim split this way; a product whose operands keep dims split over the
            same devices).
        spills: reshapes whose split spilled from the heads into their own dims (fewer heads
            than devices): XLA then reduce-scatters some per-head partial sums and gathers them
            back where they are read, which is not counted (only the reductions are).
    """

    def __init__(self, axis: int, feature_dims: Callable[[tuple], list[int]]):
        self.axis = axis
        self.feature_dims = feature_dims
        self.parts: dict = {}
        self.relayouts: list[str] = []
        self.spills: list[str] = []
        self.reduced: set = set()  # (operand, devices) whose products' partial sums were reduced
        self.root: dict = {}  # a followed value -> the value it views (one input reshaped twice)

    def dims(self, u, split: float, weight: frozenset | None, whole: bool) -> Dims | None:
        """The split dims of an operand: followed here, a weight's spec, whole, or the size
        rule's one split feature dim; None where the size rule is ambiguous (several dims)."""
        if isinstance(u, jcore.Literal):
            return {}
        if u in self.parts:
            return self.parts[u]
        if weight is not None:
            return {d: self.axis for d in weight}
        if whole or split <= 1:
            return {}
        fd = self.feature_dims(tuple(u.aval.shape))
        return {fd[0]: self.axis} if len(fd) == 1 else None

    def follow(self, e, operand_dims: Callable, times: float, data_split: Callable) -> float:
        """Carries the split dims through a non-matmul equation ``e`` (views, elementwise math,
        reductions, slices); ``operand_dims(u)`` gives an operand's dims (``dims``). Returns the
        elements one device all-reduces for it (a sum over a split dim), ``times`` executions."""
        name = e.primitive.name
        ins = [u for u in e.invars if not isinstance(u, jcore.Literal)]
        tracked = [u for u in ins if u in self.parts]
        if name == "reshape" and ins:
            d = operand_dims(ins[0])
            if not d:
                return 0.0
            out = e.outvars[0]
            got, factored = reshape_dims(tuple(ins[0].aval.shape), tuple(out.aval.shape), d)
            if got is None:
                self.relayouts.append(f"a reshape {ins[0].aval.shape} -> {out.aval.shape} whose tensor "
                                      "split does not divide its dims")
            elif factored or (ins[0] in self.parts and not self._plain(out, got)):
                # A split feature factored into heads starts here; one merged back into a
                # plain split feature leaves it to the reader's own rules.
                self.parts[out] = got
                self.root[out] = self.root.get(ins[0], ins[0])
                if factored and len(got) > 1:
                    self.spills.append(f"a tensor split of {self.axis} reshaped {ins[0].aval.shape} -> "
                                       f"{out.aval.shape} spills from the heads into their own dims")
            return 0.0
        if not tracked:
            return 0.0
        src = self.parts[tracked[0]]
        out = e.outvars[0]
        if name in VIEW:
            self.root[out] = self.root.get(tracked[0], tracked[0])
        if name == "transpose":
            perm = e.params["permutation"]
            self.parts[out] = {k: src[p] for k, p in enumerate(perm) if p in src}
        elif name == "broadcast_in_dim":
            bd = e.params["broadcast_dimensions"]
            self.parts[out] = {bd[d]: f for d, f in src.items()}
        elif name in ("squeeze", "expand_dims"):
            got, _ = reshape_dims(tuple(tracked[0].aval.shape), tuple(out.aval.shape), src)
            if got is not None:
                self.parts[out] = got
        elif name in REDUCE:
            axes = set(e.params.get("axes", ()))
            keep = [d for d in range(tracked[0].aval.ndim) if d not in axes]
            self.parts[out] = {keep.index(d): f for d, f in src.items() if d in keep}
            if math.prod(f for d, f in src.items() if d in axes) > 1:  # a sum over a split dim
                return self._reduce(out, times, data_split(out), self.parts[out])
        elif name in SLICE or name in ("split", "concatenate", "pad", "dynamic_update_slice"):
            same = [v for v in e.outvars if v.aval.ndim == tracked[0].aval.ndim]
            if len(same) < len(e.outvars) or any(v.aval.shape[d] != tracked[0].aval.shape[d]
                                                 for v in same for d in src if src[d] < self.axis):
                self.relayouts.append(f"a {name} of {tracked[0].aval.shape} along a dim split over part of the "
                                      "tensor axis")
            for v in same:
                self.parts[v] = dict(src)
        elif name in FUSIBLE or name in VIEW or len(e.outvars) == 1:
            for v in e.outvars:
                if v.aval.shape == tracked[0].aval.shape:
                    self.parts[v] = dict(src)
        return 0.0

    def dot(self, e, da: Dims, db: Dims, times: float, d: float) -> tuple[float, bool]:
        """A ``dot_general`` with split dims on its operands: the result's dims. Returns the
        elements of its partial sums one device all-reduces (0: none), ``times`` executions, and
        whether that all-reduce joins an earlier one: products of one operand reduced over the same devices are independent, and
        XLA's combiner makes them one op (Griffin's two RG-LRU gates of one input). A result
        with no split dim is whole."""
        (ca, cb), (ba, bb) = e.params["dimension_numbers"]
        a, b = e.invars[:2]
        red = math.prod(max(da.get(i, 1), db.get(j, 1)) for i, j in zip(ca, cb))
        out: Dims = {}
        for k, (i, j) in enumerate(zip(ba, bb)):
            out[k] = max(da.get(i, 1), db.get(j, 1))
        free_a = [i for i in range(a.aval.ndim) if i not in ca and i not in ba]
        free_b = [j for j in range(b.aval.ndim) if j not in cb and j not in bb]
        kept_a = {len(ba) + k: da.get(i, 1) for k, i in enumerate(free_a)}
        kept_b = {len(ba) + len(free_a) + k: db.get(j, 1) for k, j in enumerate(free_b)}
        ka, kb = math.prod(kept_a.values()), math.prod(kept_b.values())
        if ka > 1 and kb > 1 and ka * kb * red * math.prod(out.values()) > self.axis:
            if a in self.parts and b in self.parts:
                self.relayouts.append(f"a product of {a.aval.shape} and {b.aval.shape} whose operands keep dims "
                                      "split over the same devices")
            # One side's split may be the size rule's guess (a cotangent as wide as a split
            # feature): the side followed here decides, the other is taken whole.
            (kept_b if a in self.parts else kept_a).clear()
        out.update(kept_a)
        out.update(kept_b)
        out = {k: f for k, f in out.items() if f > 1}
        if out:
            self.parts[e.outvars[0]] = out
        if red == 1:
            return 0.0, False
        keys = {(self.root.get(u, u), red) for u in (a, b) if u in self.parts}
        joins = bool(keys & self.reduced)
        self.reduced |= keys
        return self._reduce(e.outvars[0], times, d, out), joins

    def _plain(self, v, dims: Dims) -> bool:
        """Whether ``dims`` is the whole axis on the one dim the size rule reads as split."""
        return list(dims.values()) == [self.axis] and self.feature_dims(tuple(v.aval.shape)) == list(dims)

    @staticmethod
    def _reduce(v, times: float, d: float, out: Dims) -> float:
        return times * math.prod(v.aval.shape) / (d * math.prod(out.values() or (1,)))

    def enter(self, outer: list, inner: list, shift: list[bool]) -> None:
        """Passes the dims of a nested jaxpr's operands to its inputs (``shift``: a scan's xs,
        which lose their leading dim)."""
        for ov, iv, sh in zip(outer, inner, shift):
            if isinstance(ov, jcore.Literal) or ov not in self.parts:
                continue
            src = self.parts[ov]
            if not sh:
                self.parts[iv] = src
            elif 0 not in src:
                self.parts[iv] = {k - 1: f for k, f in src.items()}

    def leave(self, inner_out: list, outer_out: list, stacked: list[bool]) -> None:
        """Passes the dims of a nested jaxpr's results to its equation's (``stacked``: a scan's
        ys, which gain a leading dim)."""
        for iv, ov, st in zip(inner_out, outer_out, stacked):
            if not isinstance(iv, jcore.Literal) and iv in self.parts:
                src = self.parts[iv]
                self.parts[ov] = {k + 1: f for k, f in src.items()} if st else dict(src)
