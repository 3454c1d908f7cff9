"""The program reader's matmul rules (``program._Reader`` mixes them in): a matmul's flops
over the devices that share it, and the tensor-parallel reductions its contraction leaves —
placed by the weights' split dims (Megatron's column- and row-parallel pair) where they are
known, by ``head_splits`` where a split feature was reshaped into heads, else by sizes — with
XLA:GPU's reassociation of two reductions into one."""

from __future__ import annotations

import math

from jax._src import core as jcore

from . import cpu_buffers
from .liveness import Pass as _Pass
from .walk import dot_flops as _dot_flops


class TensorSplits:
    """Matmul rules of ``program._Reader``; they read and write the reader's state (splits,
    weight dims, the tensor-parallel reduction tally)."""

    def _matmul(self, p: _Pass, i: int, e, origin: dict, src: list) -> None:
        """A matmul's flops, its tensor-parallel reduction and working buffers."""
        # A device does the share of the most-split operand (or result): tokens split
        # over data, features over tensor.
        ops = [self.split(u, origin) for u in e.invars[:2] if not isinstance(u, jcore.Literal)]
        out_d, out_t = self.split_of(e.outvars[0].aval, None, self.manual)
        exact = self._dot_split(e, ops) if e.primitive.name == "dot_general" else None
        if exact is not None:
            # A weight's split dims are known: the result is split iff a dim the product keeps
            # is (a column-parallel weight), else whole after XLA's all-reduce of the partial
            # sums of a split contraction (row-parallel) — whatever its sizes say.
            out_t = max(t for _, t in ops) if exact else 1
            if not exact:
                self.unsplit.update(e.outvars)
        elif max(t for _, t in ops) <= 1 and out_t > 1:
            # A product of operands whole over the tensor axes is whole too, whatever
            # its sizes (a head's logits as wide as a tensor-split MLP).
            out_t = 1
            self.unsplit.update(e.outvars)
        p.total += _dot_flops(e)
        p.flops += _dot_flops(e) / max(d * t for d, t in ops + [(out_d, out_t)])
        if max(t for _, t in ops) > 1 and out_t == 1:
            # A tensor-split contraction leaves partial sums: XLA all-reduces the result
            # (Megatron's row-parallel forward, column-parallel input gradient).
            self._reduced(e.outvars[0], self._times * math.prod(e.outvars[0].aval.shape) / out_d)
            # The all-reduce writes a second buffer beside the partial sums.
            reduce_copy = self.size_of(e.outvars[0].aval, None)
        else:
            reduce_copy = 0.0
        if self.canonical_dots:
            # An activation is copied for the op; a weight takes the layout the op
            # wants for free (layout assignment picks it).
            p.inner_peak[i] = sum(self.size_of(u.aval, None) for u in cpu_buffers.transposed_operands(e)
                                  if self.whole(origin, u) is None)
        p.inner_peak[i] = p.inner_peak.get(i, 0.0) + reduce_copy
        for s in src[:2]:
            if s is not None:
                self.matmul[s] = True
                self.conv[s] += e.primitive.name == "conv_general_dilated"

    def _dims(self, u, origin: dict):
        """An operand's split dims for ``head_splits`` (None: the size rule cannot place them)."""
        if isinstance(u, jcore.Literal):
            return {}
        return self.heads.dims(u, self.split(u, origin)[1], self.weight_dims.get(u), u in self.unsplit)

    def _reduced(self, v, elems: float, ops: float | None = None) -> None:
        """A tensor-parallel all-reduce of ``elems`` elements a device (0: none) of ``v``, in
        ``ops`` collectives (default: one an execution)."""
        if elems:
            ops = self._times if ops is None else ops
            self.tensor_reduce += elems
            self.tensor_reduce_ops += ops
            self.reducing[v] = (elems, ops)

    def _head_matmul(self, p: _Pass, e, origin: dict, src: list) -> bool:
        """A ``dot_general`` with an operand split over several dims (``head_splits``): its flops,
        partial sums and gathers by those dims; False where the reader's own rules apply."""
        if (self.heads is None or self.manual or e.primitive.name != "dot_general"
                or not any(u in self.heads.parts for u in e.invars[:2] if not isinstance(u, jcore.Literal))):
            return False
        da, db = (self._dims(u, origin) for u in e.invars[:2])
        if da is None or db is None:
            return False
        ops = [self.split(u, origin) for u in e.invars[:2] if not isinstance(u, jcore.Literal)]
        d = max([dd for dd, _ in ops] + [self.split_of(e.outvars[0].aval, None, self.manual)[0]])
        elems, joins = self.heads.dot(e, da, db, self._times, d)
        self._reduced(e.outvars[0], elems, ops=0.0 if joins else self._times)
        if e.outvars[0] not in self.heads.parts:
            self.unsplit.add(e.outvars[0])
        # Flops shared as the reader's own rule shares them (by the most split operand): XLA:GPU
        # runs more of Griffin's per-head products per device than the head split implies.
        p.total += _dot_flops(e)
        p.flops += _dot_flops(e) / max(dd * t for dd, t in ops + [(d, 1)])
        for s in src[:2]:
            if s is not None:
                self.matmul[s] = True
        return True

    def _reassociate(self, p: _Pass, e) -> None:
        """A sum of two tensor-parallel reductions' results that nothing else reads is one
        reduction of the sum (XLA:GPU's ``AllReduceReassociate``: q, k and v's input gradients
        are all-reduced once, measured on the GPT family's H100 compile)."""
        a, b = e.invars[:2]
        if (isinstance(a, jcore.Literal) or isinstance(b, jcore.Literal) or a not in self.reducing
                or b not in self.reducing or a.aval.shape != b.aval.shape
                or len(p.consumers.get(a, ())) != 1 or len(p.consumers.get(b, ())) != 1):
            return
        elems, times = min(self.reducing[a], self.reducing[b])
        self.tensor_reduce -= elems
        self.tensor_reduce_ops -= times
        self.reducing[e.outvars[0]] = max(self.reducing[a], self.reducing[b])

    def _dot_split(self, e, ops) -> bool | None:
        """Whether a ``dot_general`` with a weight operand of known split dims keeps a split dim
        in its result; None where no operand is such a weight (the size rule decides)."""
        contract, _ = e.params["dimension_numbers"]
        # Inside a shard_map manual over the data axes alone (sk.moe's) a weight keeps its split;
        # one manual over an axis a weight's dims name holds a local block (the sizes decide).
        if (self.manual and (self.weight_axes is None or self.manual & self.weight_axes)) or any(
                isinstance(u, jcore.Literal) for u in e.invars[:2]):
            return None
        known = [u for u in e.invars[:2] if u in self.weight_dims]
        if not known:
            lhs, rhs = (u.aval.shape for u in e.invars[:2])
            if self.rows and 0 in contract[0] and 0 in contract[1] and lhs[:1] == rhs[:1] == (self.rows,):
                # A contraction over the batch rows (a weight's gradient): its partial sums are
                # the data axes' (grad-reduce), and a split feature it keeps stays split.
                return max(t for _, t in ops) > 1
            return None
        kept = False
        for side, u in enumerate(e.invars[:2]):
            if u in self.unsplit:
                continue
            dropped = set(contract[side])
            if u in self.weight_dims:
                kept |= any(d not in dropped for d in self.weight_dims[u])
            elif ops[side][1] > 1 and not any(d in contract[e.invars.index(w)] for w in known
                                              for d in self.weight_dims[w]):
                # An activation split on its features meets a weight whose contraction is
                # whole: its split is a dim the product keeps.
                kept = True
        return kept
