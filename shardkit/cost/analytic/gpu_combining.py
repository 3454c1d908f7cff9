"""What XLA:GPU does with a step's collectives beyond what the traced program writes: its
combiners merge independent collectives of one kind over the same devices (``AllReduceCombiner``,
``AllGatherCombiner``, ``ReduceScatterCombiner``, up to ``COMBINE_BYTES`` an op), so a step
executes far fewer ops than it has gradients and gathered weights. Counts matter where latency
does: each op pays its ring's link latencies (``steptime.collective_time``), which decide the
order of small models' layouts. Read off H100 compiles of the house GPT, MLP and CNN and of HF
GPT-2 (``bench/cost_ranking.py``); ``from_step`` uses it for GPU targets only (``cpu_buffers`` has
XLA:CPU's habits).
"""

from __future__ import annotations

import math

from ...rules import entry_axes
from .roles import grads_on_shard

# ``kDefaultAllReduceCombineThreshold``, and the same for all-gather and reduce-scatter
# (xla/service/collective_utils.h).
COMBINE_BYTES = 30 * 1024 * 1024 + 7


def data_ops(lv, zero_specs, uses, reading, *, zero: int, microbatches: int, grad_bytes: int,
             wire: int) -> tuple[float, float, float]:
    """(gradient reductions, ZeRO-3/FSDP gathers, ZeRO-1/2 gathers of the updated shards) one
    step executes on XLA:GPU.

    A loop body's — a layer scan's — collectives make one op per trip (gathers forward and
    backward); those outside any loop one op per kind of leaf (its own non-batch axes). The
    loss's mean and the gradient norm add one all-reduce, merged into the gradients' when those
    are all-reduces too (below ZeRO-2, nothing FSDP-sharded); a tied table's two gradients are
    reduced apart, and under ZeRO-3 it is gathered for each. ZeRO-1/2 gathers the updated shards
    once per set of axes a leaf's shard adds (a leaf too small for all the data axes is sharded
    over some). Checked on the compiles: GPT 6/2 (ZeRO-1/2 fsdp), 5 (ZeRO-0), 6/8 (ZeRO-3); MLP
    1/1, 2/1; GPT-2 2/1, 3/2; the CNN's ZeRO-1 gathers 2 and 3; the MLP with tensor at ZeRO-3
    reduces in 4 ops, modelled 3.

    Args:
        lv: the step's ``leaf_sizes.Leaves``; ``zero_specs``: its layout's ZeRO specs.
        uses: per leaf, the uses that gather it where it is sharded (``from_step``).
        reading: the ``program.ProgramReading`` (loop uses, lookups, matmuls).
    """
    m, loop, comp, stored = microbatches, reading.loop_use, lv.comp, lv.stored
    # The gradients are reduce-scattered — where ZeRO shards some leaf: on a mesh larger than
    # every leaf's dims divide (a small model on 256 GPUs) ZeRO-2/3 all-reduce them all.
    scatter = lv.fsdp or (grads_on_shard(zero, microbatches) and any(z < f for f, z in zip(lv.full, lv.zshard)))
    in_loop = any(loop)
    out_bytes = sum(c for c, lp in zip(comp, loop) if not lp) * grad_bytes
    # Reduce-scatters combine whatever dim they scatter, apart for leaves split over other axes
    # (the house MLP's 15 leaves at ZeRO-3: 1 op).
    kinds = {frozenset(a for e in l.spec for a in entry_axes(e))
             for l, z, lp in zip(lv.leaves, zero_specs, loop) if not lp and _added_axes(l.spec, z)} if scatter else ()
    outside = max(len(kinds), math.ceil(out_bytes / COMBINE_BYTES)) if out_bytes else 0
    tied = int(any(u and mm and not lp for u, mm, lp in zip(reading.lookup, reading.matmul, loop)))
    reduce_ops = m * ((lv.layers if in_loop else 0) + (outside + 1 if scatter else max(outside, 1)) + tied)
    groups = {_added_axes(l.spec, z) for l, z, st, c, lp in zip(lv.leaves, zero_specs, stored, comp, loop)
              if st < c and not lp}
    gathered_out = sum(u * c for u, st, c, lp in zip(uses, stored, comp, loop) if st < c and not lp) * wire
    looped = any(st < c and lp for st, c, lp in zip(stored, comp, loop))
    gather_ops = m * ((2 * lv.layers if looped else 0) + (
        max(len(groups), math.ceil(gathered_out / COMBINE_BYTES)) + (tied if zero == 3 else 0) if groups else 0))
    zero12 = {_added_axes(l.spec, z) for l, z, f, zs in zip(lv.leaves, zero_specs, lv.full, lv.zshard) if zs < f}
    # ZeRO-1/2 reducing into the shard: a tied table's matmul gradient is reduce-scattered, then
    # gathered back whole to take the lookup's scatter-add (one more all-gather; GPT at ZeRO-1
    # and ZeRO-2 on data=4,fsdp=16: 2 gathers).
    regather = tied if zero in (1, 2) and grads_on_shard(zero, microbatches) and zero12 else 0
    return reduce_ops, gather_ops, max(len(zero12), 1) + regather


def _added_axes(spec, zero_spec) -> tuple[str, ...]:
    """The mesh axes ZeRO's spec shards a leaf over beyond its own spec (empty: none)."""
    own = {a for e in spec for a in entry_axes(e)}
    return tuple(sorted({a for e in zero_spec for a in entry_axes(e)} - own))
