"""Pipeline schedule tables: which stage does what at every tick, as plain numpy.

The tables are the single source of truth: the executors (``forward``, ``explicit``) scan over
their rows (each device reads its own column), ``sk.pipeline_schedule`` returns them, and
``bench/pipeline.py`` and the cost model count their cells. Nothing here touches JAX, so a
table can be checked by eye (``print(sk.pipeline_schedule("zb-h1", stages=4, microbatches=8))``)
or by a test without devices.

Conventions: ``p`` stages, ``m`` microbatches, ``v`` repeats (layer chunks per device; chunk
``c`` on stage ``s`` is layer group ``c·p + s``). One tick is one unit slot: one forward (F),
one input-gradient backward (B), one weight-gradient backward (W), or, for the schedules
that do not split the backward, one fused backward (BW). Qi et al. (ICLR 2024, "Zero Bubble
Pipeline Parallelism") count F = B = W for their bubble figures; a tick here is that unit.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .ops import BW, DOWN, IDLE, NOWHERE, SELF, UP, B, F, W  # noqa: F401 - re-exported
from .simulate import interleaved_order, layer_groups, one_f_one_b_order, routes, simulate, simulate_v

# The named scope around the explicit executor's per-tick ``lax.switch``: it reaches the
# compiled HLO as the conditional's ``op_name``, which is how ``explain()`` finds that switch
# among a model's own conds.
EXPLICIT_SCOPE = "shardkit_pipeline_tick"

OP_LETTERS = {IDLE: ".", F: "F", B: "B", W: "W", BW: "BW"}
SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
EXPLICIT = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v")  # backward inside the pipeline, table-driven
SPLIT = ("zb-h1", "zb-v")  # backward split into B and W


@dataclasses.dataclass(frozen=True, eq=False)  # array fields: compared by identity
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


@functools.lru_cache(maxsize=256)
def forward_table(p: int, m: int, v: int = 1) -> ForwardTable:
    """Circular schedule (GPipe when ``v == 1``): stage ``s`` runs item ``t - s`` at tick ``t``.

    Requires ``m >= p`` so that an item leaving stage p-1 is back at stage 0 no later than
    the tick that needs it (``p`` ticks later, needed ``m`` ticks later). Cached: treat the
    arrays as read-only.
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
    return _frozen(ForwardTable(item, loop_slot, out_slot))


@dataclasses.dataclass(frozen=True, eq=False)  # array fields: compared by identity
class Schedule:
    """A pipeline schedule as a tick × stage table; the explicit executor scans exactly this.

    Attributes:
        name: the schedule (one of ``SCHEDULES``).
        stages, microbatches, repeats: ``p``, ``m``, ``v``.
        op: (ticks, p) int32 in {IDLE, F, B, W, BW}.
        mb: (ticks, p) int32; the op's microbatch (0 when idle).
        chunk: (ticks, p) int32; the op's layer chunk on its stage (0 when idle).
        loss: (ticks, p) bool; the op is on the last layer group (F computes the loss there,
            B/W/BW start from the loss instead of an arriving cotangent).
        act_slot: (ticks, p) int32; ring slot of the op's saved stage input; -1: read the
            pipeline input ``x`` (stage 0, chunk 0).
        grad_slot: (ticks, p) int32; ring slot of the cotangent of the op's output (B, W, BW
            off the loss cells), else 0.
        recv_act: (ticks, p) int32; where the activation arriving at this tick (sent by the
            previous stage the tick before) is stored; ``act_ring`` = nothing to keep.
        recv_grad: (ticks, p) int32; likewise for the cotangent arriving from the next stage.
        act_ring, grad_ring: ring sizes (stage inputs; output cotangents waiting for B/W).
        peak_activations: per stage, the most microbatch-chunks whose saved input is alive at
            once (from its F to its last backward op, W or BW): the activation memory in units
            of one microbatch's stage input.
        executed: ``"explicit"`` (the table is scanned by the explicit-backward executor) or
            ``"autodiff"`` (GPipe/circular: the F half is ``forward_table``, scanned; the BW half
            is autodiff's mirror of it).
        w_slot: (ticks, p) int32; split schedules (B and W apart): the ring slot where a B
            leaves what its W needs (the chunk's per-layer residuals and cotangents, ``split``)
            and where that W reads it; 0 elsewhere.
        w_ring: that ring's size (0 without W ops): the most W's pending at once on a stage.
        send: (ticks, p) int32; where the op's result (F: activation, B/BW: input cotangent)
            goes: ``NOWHERE``, ``DOWN``, ``UP`` or ``SELF`` (ZB-V's turn at the last stage).
        recv_act_up, recv_grad_down, recv_act_self, recv_grad_self: (ticks, p) int32; like
            ``recv_act``/``recv_grad`` for what arrives from the stage above (sent ``UP``), from
            below, and from this stage's previous tick. ``recv_act`` is what comes from below
            and ``recv_grad`` from above. ZB-V uses them all; the others only the two first.
        group: (p, v) int32; the global layer group of chunk c on stage s (``c·p + s``; ZB-V:
            ``s`` and ``2p - 1 - s``).
        res_slot: (ticks, p) int32; the ring slot where an F leaves its chunk's residuals when
            the pipeline keeps them (``sk.pipeline(keep=...)``), and where the backward op that
            reads them (B, or BW) finds them; 0 elsewhere.
        res_ring: that ring's size: the most chunk-microbatches in flight at once on a stage,
            from F to its B/BW.
        loss_res_slot, loss_res_ring: the same for the loss's residuals (F on the loss cells).
    """

    name: str
    stages: int
    microbatches: int
    repeats: int
    op: np.ndarray
    mb: np.ndarray
    chunk: np.ndarray
    loss: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_ring: int
    grad_ring: int
    peak_activations: tuple[int, ...]
    executed: str
    w_slot: np.ndarray | None = None
    w_ring: int = 0
    send: np.ndarray | None = None
    recv_act_up: np.ndarray | None = None
    recv_grad_down: np.ndarray | None = None
    recv_act_self: np.ndarray | None = None
    recv_grad_self: np.ndarray | None = None
    group: np.ndarray | None = None
    res_slot: np.ndarray | None = None
    res_ring: int = 0
    loss_res_slot: np.ndarray | None = None
    loss_res_ring: int = 0

    @property
    def ticks(self) -> int:
        """Rows of the table."""
        return int(self.op.shape[0])

    @property
    def pending_w(self) -> tuple[int, ...]:
        """Per stage, the most W's waiting at once (their B done, their W not yet): what a
        split schedule holds beyond 1F1B, in units of one chunk's per-layer residuals for one
        microbatch (``split``). 0 for schedules without W ops."""
        waiting = np.cumsum((self.op == B).astype(np.int32) - (self.op == W), axis=0)
        return tuple(int(w) for w in waiting.max(axis=0)) if W in self.op else (0,) * self.stages

    @property
    def bubble_fraction(self) -> float:
        """Idle (tick, stage) cells over all cells."""
        return float(np.count_nonzero(self.op == IDLE) / self.op.size)

    @property
    def formula_bubble(self) -> float:
        """The published bubble as a fraction of the total time, in the table's unit slots:
        GPipe/1F1B (p-1)/(m+p-1) (Huang et al. 2019; Narayanan et al. 2021), circular and
        interleaved 1F1B (p-1)/(v·m+p-1) (Narayanan et al. 2021: (p-1)/(v·m) of the ideal time),
        ZB-H1 (p-1)(F+B-W) / (m(F+B+W) + (p-1)(F+B-W)) with F = B = W (Qi et al. 2024); ZB-V
        (p-1)/(6m+p-1) in its half-stage chunk slots (``formula_bubble``)."""
        return formula_bubble(self.name, self.stages, self.microbatches, self.repeats)

    def picture(self, keep: str = "input") -> str:
        """``str(self)`` with each backward op that recomputes its chunk's forward marked
        ``*`` (``keep="input"``: every B and BW) or ``~`` (a checkpoint policy: what it did
        not save); ``keep="all"`` marks none. W never recomputes (it reads what B kept)."""
        mark = {"input": "*", "all": ""}.get(keep, "~") if isinstance(keep, str) else "~"
        return self._text(mark)

    def __str__(self) -> str:
        return self._text("")

    def _text(self, mark: str) -> str:
        again = (self.op == B) | (self.op == BW) if self.executed == "explicit" else np.zeros_like(self.op, bool)
        cells = [[_cell(self, t, s) + (mark if again[t, s] else "") for t in range(self.ticks)]
                 for s in range(self.stages)]
        width = max(len(c) for row in cells for c in row)
        head = (f"{self.name}: p={self.stages} m={self.microbatches} v={self.repeats}, "
                f"{self.ticks} ticks, bubble {self.bubble_fraction:.3f} (formula "
                f"{self.formula_bubble:.3f}), peak activations {list(self.peak_activations)}")
        return "\n".join([head] + [f"stage {s}: " + " ".join(c.ljust(width) for c in row)
                                   for s, row in enumerate(cells)])


def _cell(tab: Schedule, t: int, s: int) -> str:
    op = int(tab.op[t, s])
    if op == IDLE:
        return "."
    text = f"{OP_LETTERS[op]}{tab.mb[t, s]}"
    return text + (f"/{tab.chunk[t, s]}" if tab.repeats > 1 else "")


def formula_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The published bubble fraction of total time (see ``Schedule.formula_bubble``)."""
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zb-v":
        # Each device runs 6m unit ops (F, B, W of its 2 chunks per microbatch, each chunk half
        # a stage): what stays idle is the last stage's wait for the first microbatch, p - 1
        # chunk forwards — (p-1)·F/2 in whole-stage units, half ZB-H1's (p-1)(F+B-W).
        return (p - 1) / (6 * m + p - 1)
    v = v if schedule in ("circular", "interleaved-1f1b") else 1
    return (p - 1) / (v * m + p - 1)


def bubble_fraction(busy: np.ndarray) -> float:
    """Fraction of (tick, stage) cells that do no useful work."""
    return float(1.0 - np.count_nonzero(busy) / busy.size)


def check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    """Raises ValueError for a schedule this module cannot build."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"repeats must be a positive integer, got {v!r}")
    if schedule == "zb-v" and v not in (1, 2):
        raise ValueError(f"zb-v always places 2 chunks per device (Qi et al. 2024), got repeats={v}; "
                         "leave repeats at 1 (or 2): the layers split into 2 x stages groups")
    if v > 1 and schedule not in ("circular", "interleaved-1f1b", "zb-v"):
        raise ValueError(f"repeats={v} needs schedule='circular' or 'interleaved-1f1b' (got "
                         f"{schedule!r}); or use repeats=1")
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"stages must be a positive integer, got {p!r}")
    if not isinstance(m, int) or m < p:
        raise ValueError(f"microbatches={m!r} but there are {p} stages; a pipeline needs "
                         f"microbatches >= stages: use microbatches >= {p}")
    if schedule == "interleaved-1f1b" and m % p:
        raise ValueError(f"interleaved-1f1b runs microbatches in groups of the {p} stages "
                         f"(Narayanan et al. 2021), but microbatches={m}; use a multiple of {p}")


@functools.lru_cache(maxsize=512)
def pipeline_schedule(schedule: str, stages: int, microbatches: int, repeats: int = 1) -> Schedule:
    """The tick × stage table of ``schedule`` (cached: treat its arrays as read-only).

    Args:
        schedule: one of ``SCHEDULES``.
        stages: ``p``, devices along the pipe axis.
        microbatches: ``m >= p`` (a multiple of ``p`` for ``"interleaved-1f1b"``).
        repeats: ``v``, layer chunks per device (``"circular"``, ``"interleaved-1f1b"``;
            ``"zb-v"`` always has 2: device s holds layer groups s and 2p-1-s).

    Returns:
        A frozen ``Schedule``.

    Raises:
        ValueError: unknown schedule, ``repeats`` for a schedule without chunks, too few
            microbatches.
    """
    p, m, v = stages, microbatches, repeats
    check_schedule(schedule, p, m, v)
    if schedule in ("gpipe", "circular"):
        return _autodiff_schedule(schedule, p, m, v)
    if schedule == "zb-v":
        return _table(schedule, p, m, 2, simulate_v(p, m))
    if schedule == "zb-h1":
        orders = [one_f_one_b_order(p, s, m, B) for s in range(p)]
    elif schedule == "interleaved-1f1b":
        orders = [interleaved_order(p, s, m, v) for s in range(p)]
    else:
        orders = [one_f_one_b_order(p, s, m, BW) for s in range(p)]
    return _table(schedule, p, m, v, simulate(p, v, orders, split=schedule == "zb-h1",
                                                routes=routes(schedule, p, v)))


def _table(name: str, p: int, m: int, v: int, rows) -> Schedule:
    nxt, prv = routes(name, p, v)
    ticks = len(rows)
    op = np.array([[k for k, _, _ in r] for r in rows], np.int32)
    mb = np.array([[i for _, i, _ in r] for r in rows], np.int32)
    chunk = np.array([[c for _, _, c in r] for r in rows], np.int32)
    last = next((s, c) for s in range(p) for c in range(v) if nxt(s, c) is None)
    loss = (op != IDLE) & (np.arange(p)[None, :] == last[0]) & (chunk == last[1])
    where = {(int(op[t, s]), s, int(mb[t, s]), int(chunk[t, s])): t
             for t in range(ticks) for s in range(p) if op[t, s] != IDLE}
    back = BW if BW in op else B
    # From its F to its last backward op a microbatch-chunk is alive (W, BW); its stage input
    # and output cotangent are read last by B or BW (W reads what its B kept, ``split``).
    alive_until = {(s, i, c): where.get((W, s, i, c), where.get((BW, s, i, c)))
                   for (k, s, i, c) in where if k == F}
    last_use = {(s, i, c): where[(back, s, i, c)] for (k, s, i, c) in where if k == F}

    # Arrivals: an F (not on the last group) sends its output to the next chunk on its route
    # (``_routes``); a backward sends the input cotangent back along it. ``came``: from where.
    act_in, grad_in, came = {}, {}, {}
    send = np.zeros((ticks, p), np.int32)
    for (k, s, i, c), t in where.items():
        if k == F and (n := nxt(s, c)) is not None:
            act_in[(n[0], i, n[1])] = t + 1
            came[("act", n[0], i, n[1])] = send[t, s] = n[2]
        if k == back and (b := prv(s, c)) is not None:
            grad_in[(b[0], i, b[1])] = t + 1
            came[("grad", b[0], i, b[1])] = send[t, s] = b[2]
    act_slots, act_ring = _allocate(act_in, last_use)
    grad_slots, grad_ring = _allocate(grad_in, last_use)

    act_slot = np.zeros((ticks, p), np.int32)
    grad_slot = np.zeros((ticks, p), np.int32)
    recv_act = np.full((ticks, p), act_ring, np.int32)
    recv_grad = np.full((ticks, p), grad_ring, np.int32)
    for (k, s, i, c), t in where.items():
        act_slot[t, s] = act_slots.get((s, i, c), -1)
        grad_slot[t, s] = grad_slots.get((s, i, c), 0)
    # By the direction the message travelled: DOWN arrives from below, UP from above.
    recv = {("act", DOWN): recv_act, ("grad", UP): recv_grad}
    for kind, ring in (("act", act_ring), ("grad", grad_ring)):
        for d in (DOWN, UP, SELF):
            recv.setdefault((kind, d), np.full((ticks, p), ring, np.int32))
    for kind, arrivals, slots in (("act", act_in, act_slots), ("grad", grad_in, grad_slots)):
        for key, t in arrivals.items():
            recv[(kind, came[(kind, *key)])][t, key[0]] = slots[key]
    group = layer_groups(name, p, v)
    peak = []
    for s in range(p):
        lives = [(where[(F, s, i, c)], alive_until[(s, i, c)]) for (ss, i, c) in alive_until if ss == s]
        peak.append(max(sum(a <= t <= b for a, b in lives) for t in range(ticks)))
    w_slot, w_ring = np.zeros((ticks, p), np.int32), 0
    if W in op:  # what B keeps for W waits in a ring from the B to the W, both included
        w_at = {key: where[(W, *key)] for key in alive_until}
        w_slots, w_ring = _allocate({key: where[(B, *key)] for key in alive_until}, w_at)
        for (s, i, c), j in w_slots.items():
            w_slot[where[(B, s, i, c)], s] = w_slot[w_at[(s, i, c)], s] = j
    # Kept residuals (``keep``): from the F that makes them to the B/BW that reads them.
    f_at = {key: where[(F, *key)] for key in alive_until}
    on_loss = {key for key, t in f_at.items() if loss[t, key[0]]}
    res_slot, res_ring = _slots(f_at, last_use, ticks, p)
    loss_res_slot, loss_res_ring = _slots({k: f_at[k] for k in on_loss}, last_use, ticks, p)
    return _frozen(Schedule(name, p, m, v, op, mb, chunk, loss, act_slot, grad_slot, recv_act,
                            recv_grad, act_ring, grad_ring, tuple(peak), "explicit", w_slot, w_ring,
                            send, recv[("act", UP)], recv[("grad", DOWN)], recv[("act", SELF)],
                            recv[("grad", SELF)], group, res_slot, res_ring, loss_res_slot, loss_res_ring))


def _slots(made: dict, read: dict, ticks: int, p: int) -> tuple[np.ndarray, int]:
    """A ring from each key's making tick to its reading tick (``_allocate``), as a (ticks, p)
    table holding the key's slot at both ticks."""
    slots, ring = _allocate(made, read)
    table = np.zeros((ticks, p), np.int32)
    for key, j in slots.items():
        table[made[key], key[0]] = table[read[key], key[0]] = j
    return table, ring


def _allocate(arrive: dict, last_use: dict) -> tuple[dict, int]:
    """Ring slots per stage: a value occupies its slot from its arrival tick to its last use,
    both included (a tick stores its arrival before it reads). Returns (slot per key, ring)."""
    slots, ring = {}, 1
    for s in {k[0] for k in arrive}:
        free_at: list[int] = []  # per slot, the first tick it is free again
        for key in sorted((k for k in arrive if k[0] == s), key=arrive.get):
            t0 = arrive[key]
            j = next((j for j, f in enumerate(free_at) if f <= t0), len(free_at))
            if j == len(free_at):
                free_at.append(0)
            free_at[j] = last_use[key] + 1
            slots[key] = j
        ring = max(ring, len(free_at))
    return slots, ring


def _autodiff_schedule(name: str, p: int, m: int, v: int) -> Schedule:
    """GPipe / circular as a Schedule: ``forward_table``'s F cells, then autodiff's mirror of
    them as BW cells (every microbatch's residuals stay alive: peak m·v per stage)."""
    item = forward_table(p, m, v).item
    fwd = np.where(item >= 0, F, IDLE).astype(np.int32)
    op = np.concatenate([fwd, np.where(item[::-1] >= 0, BW, IDLE)]).astype(np.int32)
    it = np.concatenate([item, item[::-1]])
    mb = np.where(it >= 0, it % m, 0).astype(np.int32)
    chunk = np.where(it >= 0, it // m, 0).astype(np.int32)
    loss = (op != IDLE) & (np.arange(p)[None, :] == p - 1) & (chunk == v - 1)
    zeros = np.zeros_like(op)
    return _frozen(Schedule(name, p, m, v, op, mb, chunk, loss, zeros - 1, zeros, zeros, zeros,
                            0, 0, (m * v,) * p, "autodiff"))


def _frozen(tab):
    for f in dataclasses.fields(tab):
        a = getattr(tab, f.name)
        if isinstance(a, np.ndarray):
            a.flags.writeable = False  # shared by every caller through the cache
    return tab


def switch_branches(tab: Schedule) -> tuple[tuple[tuple[int, bool], ...], np.ndarray]:
    """The explicit executor's ``lax.switch`` branches for ``tab``: the (op, on-the-loss-cell)
    pairs the table uses, in order (idle first), and each cell's branch index. ``explain()``
    weights the compiled switch's branches by how often the table takes each."""
    pairs = sorted({(int(o), bool(l)) for o, l in zip(tab.op.ravel(), tab.loss.ravel())} | {(IDLE, False)})
    index = np.zeros(tab.op.shape, np.int32)
    for j, (o, l) in enumerate(pairs):
        index[(tab.op == o) & (tab.loss == l)] = j
    return tuple(pairs), index
