"""Pipeline schedule tables: which stage does what at every tick, as plain numpy.

The tables are the single source of truth: the executors (``forward``, ``explicit``) scan over their rows (each device
reads its own column), and ``bench/pipeline.py`` counts their idle cells to measure the bubble.
Nothing here touches JAX, so the tables can be checked by eye or by a test without devices.

Conventions: ``p`` stages, ``m`` microbatches, ``v`` repeats (layer groups per device).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

# The named scope around 1F1B's per-tick ``lax.switch``: it reaches the compiled HLO as the
# conditional's ``op_name``, which is how ``explain()`` finds that switch among a model's own conds.
ONE_F_ONE_B_SCOPE = "shardkit_1f1b_tick"

IDLE, FWD, BWD, FWD_LAST, BWD_LAST = 0, 1, 2, 3, 4


@dataclasses.dataclass(frozen=True)
class ForwardTable:
    """A GPipe / circular forward schedule (backward comes from autodiff, mirrored).

    Attributes:
        item: (ticks, p) int32; the work item a stage runs at a tick, -1 when idle. Item ``i``
            is microbatch ``i % m`` in repeat ``i // m``; on stage ``s`` it applies layer group
            (chunk) ``(i // m) * p + s``.
        loop_slot: (ticks, p) int32; on stage 0, the buffer slot where the activation arriving
            from stage p-1 at this tick is parked until its next repeat (``m`` = discard).
        out_slot: (ticks, p) int32; on the last stage, the output row this tick's result goes
            to (``m`` = discard: not the last repeat, or idle).
    """

    item: np.ndarray
    loop_slot: np.ndarray
    out_slot: np.ndarray


def forward_table(p: int, m: int, v: int = 1) -> ForwardTable:
    """Circular schedule (GPipe when ``v == 1``): stage ``s`` runs item ``t - s`` at tick ``t``.

    Requires ``m >= p`` so that an item leaving stage p-1 is back at stage 0 no later than
    the tick that needs it (``p`` ticks later, needed ``m`` ticks later).
    """
    ticks = v * m + p - 1
    t = np.arange(ticks)[:, None]
    s = np.arange(p)[None, :]
    item = t - s
    item = np.where((item >= 0) & (item < v * m), item, -1).astype(np.int32)
    loop_slot = np.full((ticks, p), m, np.int32)
    out_slot = np.full((ticks, p), m, np.int32)
    last = item[:, p - 1]
    done = last >= 0
    out_slot[:, p - 1] = np.where(done & (last // m == v - 1), last % m, m)
    # The ppermute of tick t-1 delivers stage p-1's result to stage 0 at tick t.
    loops_back = done[:-1] & (last[:-1] // m < v - 1)
    loop_slot[1:, 0] = np.where(loops_back, last[:-1] % m, m)
    return ForwardTable(item, loop_slot, out_slot)


@dataclasses.dataclass(frozen=True)
class OneFOneBTable:
    """A 1F1B schedule with one-unit forward and backward slots, run in lockstep.

    Attributes:
        op: (ticks, p) int32 in {IDLE, FWD, BWD, FWD_LAST, BWD_LAST}.
        mb: (ticks, p) int32; the microbatch of the op (0 when idle).
        act_slot: (ticks, p) int32; ring slot holding the op's saved stage input.
        grad_slot: (ticks, p) int32; ring slot holding a BWD's incoming cotangent.
        recv_act: (ticks, p) int32; where the activation arriving at this tick is stored
            (``act_ring`` = discard).
        recv_grad: (ticks, p) int32; where the arriving cotangent is stored
            (``grad_ring`` = discard).
        act_ring: ring size for saved stage inputs: the most microbatches any stage holds
            between receiving an input and finishing its backward (at most ~p, whatever m).
        grad_ring: ring size for cotangents waiting for their backward.
    """

    op: np.ndarray
    mb: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_ring: int
    grad_ring: int


def _one_f_one_b_order(p: int, s: int, m: int) -> list[tuple[int, int]]:
    warmup = min(p - s - 1, m)
    ops = [(FWD, i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m or b < m:
        if f < m:
            ops.append((FWD, f))
            f += 1
        if b < m:
            ops.append((BWD, b))
            b += 1
    return ops


@functools.lru_cache(maxsize=256)
def one_f_one_b_table(p: int, m: int) -> OneFOneBTable:
    """Simulates PipeDream-flush 1F1B: each stage runs its op list in order, an op starting
    once its inputs arrived (ppermute takes one tick). Takes ``2 (m + p - 1)`` ticks. Cached
    (``sk.search`` asks for the same tables thousands of times): treat the arrays as read-only."""
    orders = [_one_f_one_b_order(p, s, m) for s in range(p)]
    pos = [0] * p
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    rows: list[list[tuple[int, int]]] = []
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = []
        for s in range(p):
            if pos[s] == len(orders[s]):
                row.append((IDLE, -1))
                continue
            kind, i = orders[s][pos[s]]
            if kind == FWD:
                ready = s == 0 or f_done.get((s - 1, i), t) < t
            else:
                ready = f_done.get((s, i), t) < t and (s == p - 1 or b_done.get((s + 1, i), t) < t)
            row.append((kind, i) if ready else (IDLE, -1))
        for s, (kind, i) in enumerate(row):
            if kind != IDLE:
                (f_done if kind == FWD else b_done)[(s, i)] = t
                pos[s] += 1
        rows.append(row)
        t += 1
    ticks = len(rows)
    kind = np.array([[k for k, _ in r] for r in rows], np.int32)
    mb = np.array([[i for _, i in r] for r in rows], np.int32)

    # Ring sizes: microbatches alive between arrival and their backward, per stage.
    def arrival_f(s: int, i: int) -> int:  # stage 0 reads its input straight from x
        return f_done[(s, i)] if s == 0 else f_done[(s - 1, i)] + 1

    def arrival_b(s: int, i: int) -> int:
        return f_done[(s, i)] + 1 if s == p - 1 else b_done[(s + 1, i)] + 1

    def ring(arrive) -> int:
        most = 1
        for s in range(p):
            for tt in range(ticks):
                alive = sum(arrive(s, i) <= tt <= b_done[(s, i)] for i in range(m))
                most = max(most, alive)
        return most

    act_ring, grad_ring = ring(arrival_f), ring(arrival_b)
    op = kind.copy()
    op[:, p - 1] = np.where(kind[:, p - 1] == FWD, FWD_LAST, np.where(kind[:, p - 1] == BWD, BWD_LAST, IDLE))
    idle = kind == IDLE
    mbz = np.where(idle, 0, mb)
    recv_act = np.full((ticks, p), act_ring, np.int32)
    recv_grad = np.full((ticks, p), grad_ring, np.int32)
    for tt in range(1, ticks):
        for s in range(p):
            if s > 0 and kind[tt - 1, s - 1] == FWD:
                recv_act[tt, s] = mb[tt - 1, s - 1] % act_ring
            if s < p - 1 and kind[tt - 1, s + 1] == BWD:
                recv_grad[tt, s] = mb[tt - 1, s + 1] % grad_ring
    arrays = dict(op=op, mb=mbz.astype(np.int32), act_slot=(mbz % act_ring).astype(np.int32),
                  grad_slot=(mbz % grad_ring).astype(np.int32), recv_act=recv_act, recv_grad=recv_grad)
    for a in arrays.values():
        a.flags.writeable = False  # shared by every caller through the cache
    return OneFOneBTable(**arrays, act_ring=act_ring, grad_ring=grad_ring)


def bubble_fraction(busy: np.ndarray) -> float:
    """Fraction of (tick, stage) cells that do no useful work."""
    return float(1.0 - np.count_nonzero(busy) / busy.size)


def formula_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The published bubble fraction of total time: (p-1)/(v·m+p-1) (v = 1 for GPipe, 1F1B)."""
    v = v if schedule == "circular" else 1
    return (p - 1) / (v * m + p - 1)
