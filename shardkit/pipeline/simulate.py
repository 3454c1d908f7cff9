"""The explicit schedules' op orders, run in lockstep into tick rows (``schedules._table``
turns the rows into the executed table): PipeDream-flush 1F1B and Megatron's interleaved
order (Narayanan et al. 2021), ZB-H1's W's dropped into the bubble and ZB-V's list
scheduling (Qi et al. 2024), and the routes a microbatch takes between chunks. No JAX.
"""

from __future__ import annotations

import numpy as np

from .ops import BW, DOWN, IDLE, SELF, UP, B, F, W


def one_f_one_b_order(p: int, s: int, m: int, back: int) -> list[tuple[int, int, int]]:
    """PipeDream-flush 1F1B (Narayanan et al. 2021): p-s-1 warmup forwards, then F/back pairs."""
    warmup = min(p - s - 1, m)
    ops = [(F, i, 0) for i in range(warmup)]
    f, b = warmup, 0
    while f < m or b < m:
        if f < m:
            ops.append((F, f, 0))
            f += 1
        if b < m:
            ops.append((back, b, 0))
            b += 1
    return ops


def interleaved_order(p: int, s: int, m: int, v: int) -> list[tuple[int, int, int]]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021): microbatches go through the chunks in
    groups of p; (p-s-1)·2 + (v-1)·p warmup forwards (all of them when m == p), then F/BW pairs."""
    total = m * v

    def at(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        return (k // (p * v)) * p + k % p, c if forward else v - 1 - c

    warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
    ops = [(F, *at(k, True)) for k in range(warmup)]
    for j in range(total - warmup):
        ops += [(F, *at(warmup + j, True)), (BW, *at(j, False))]
    ops += [(BW, *at(j, False)) for j in range(total - warmup, total)]
    return ops


def routes(name: str, p: int, v: int):
    """``(next, prev)``: where chunk c of stage s sends its output — ``(stage, chunk,
    direction)``, ``None`` after the last layer group — and where its input comes from (the
    cotangent goes back the same way, the other direction). Interleaved: stage p-1's chunk c
    feeds stage 0's chunk c+1 around the ring (Narayanan et al. 2021). ZB-V (Qi et al. 2024):
    chunk 0 goes down the stages, turns on the last one (its own chunk 1), and chunk 1 comes
    back up to stage 0, which computes the loss."""
    def nxt(s, c):
        if name == "zb-v":
            if c == 0:
                return (s + 1, 0, DOWN) if s < p - 1 else (s, 1, SELF)
            return (s - 1, 1, UP) if s > 0 else None
        if s < p - 1:
            return (s + 1, c, DOWN)
        return (0, c + 1, DOWN) if c < v - 1 else None

    back = {DOWN: UP, UP: DOWN, SELF: SELF}
    prev = {}
    for s in range(p):
        for c in range(v):
            if (n := nxt(s, c)) is not None:
                prev[n[:2]] = (s, c, back[n[2]])
    return nxt, lambda s, c: prev.get((s, c))


def layer_groups(schedule: str, p: int, v: int) -> np.ndarray:
    """(p, v) int32: the global layer group of chunk c on stage s — ``c·p + s`` (Narayanan et
    al. 2021), ZB-V ``s`` and ``2p - 1 - s`` (Qi et al. 2024)."""
    if schedule == "zb-v":
        return np.array([[s, 2 * p - 1 - s] for s in range(p)], np.int32)
    return np.array([[c * p + s for c in range(v)] for s in range(p)], np.int32)


def simulate_v(p: int, m: int) -> list[list[tuple[int, int, int]]]:
    """ZB-V's table by list scheduling, in lockstep (a message takes one tick): each tick a
    stage runs the first ready op of: a B (oldest microbatch first; chunk 0 on ties, it is on
    the critical path to stage 0), an F (chunk 1 before chunk 0, microbatches in order) while
    fewer than 2p microbatch-chunks are alive on it — 1F1B's peak, p microbatches of a whole
    stage —, the oldest pending W. Every stage holds chunks s and 2p-1-s (Qi et al. 2024)."""
    nxt, prv = routes("zb-v", p, 2)
    done: dict[tuple[int, int, int, int], int] = {}
    fpos = [[0, 0] for _ in range(p)]
    bpos = [[0, 0] for _ in range(p)]
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    alive = [0] * p
    rows, t = [], 0

    def before(*key):
        return done.get(key, t) < t

    while any(pending_w) or any(min(f) < m or min(b) < m for f, b in zip(fpos, bpos)):
        row = []
        for s in range(p):
            op = None
            backs = []
            for c in (0, 1):
                i = bpos[s][c]
                n = nxt(s, c)
                if i < m and before(F, s, i, c) and (n is None or before(B, n[0], i, n[1])):
                    backs.append((i, c))
            if backs:
                i, c = min(backs)
                op = (B, i, c)
            elif alive[s] < 2 * p:
                for c in (1, 0):
                    i = fpos[s][c]
                    src = prv(s, c)
                    if i < m and (src is None or before(F, src[0], i, src[1])):
                        op = (F, i, c)
                        break
            if op is None and pending_w[s]:
                op = (W, *pending_w[s][0])
            row.append(op or (IDLE, 0, 0))
        for s, (kind, i, c) in enumerate(row):
            if kind == IDLE:
                continue
            done[(kind, s, i, c)] = t
            if kind == F:
                fpos[s][c] += 1
                alive[s] += 1
            elif kind == B:
                bpos[s][c] += 1
                pending_w[s].append((i, c))
            else:
                pending_w[s].pop(0)
                alive[s] -= 1
        rows.append(row)
        t += 1
        if t > 16 * 6 * m * p + 64:
            raise RuntimeError("zb-v schedule simulation did not finish")
    return rows


def simulate(p: int, v: int, orders: list, split: bool, routes) -> list[list[tuple[int, int, int]]]:
    """Runs each stage's op list in order, in lockstep: an op starts once its inputs arrived
    (a ppermute takes one tick). With ``split`` (zero bubble) the W ops are not in the lists:
    a stage runs its oldest pending W whenever its next F/B cannot start, or when its next op
    is an F but p microbatches are already alive on it (1F1B's peak), so W fills the bubble
    and memory stays at 1F1B's (Qi et al. 2024, ZB-H1)."""
    pos = [0] * p
    done: dict[tuple[int, int, int, int], int] = {}  # (kind, stage, mb, chunk) -> tick
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    alive = [0] * p
    back = B if split else BW
    rows: list[list[tuple[int, int, int]]] = []
    t = 0

    nxt, prv = routes

    def ready(kind, s, i, c) -> bool:
        before = lambda *key: done.get(key, t) < t  # noqa: E731
        if kind == F:
            src = prv(s, c)
            return src is None or before(F, src[0], i, src[1])
        n = nxt(s, c)
        return before(F, s, i, c) and (n is None or before(back, n[0], i, n[1]))

    while any(pos[s] < len(orders[s]) for s in range(p)) or any(pending_w):
        row = []
        for s in range(p):
            op = orders[s][pos[s]] if pos[s] < len(orders[s]) else None
            go = op is not None and ready(*op[:1], s, *op[1:])
            if split and op is not None and op[0] == F and alive[s] >= p:
                go = False
            if go:
                row.append(op)
            elif split and pending_w[s]:
                row.append((W, *pending_w[s][0]))
            else:
                row.append((IDLE, 0, 0))
        for s, (kind, i, c) in enumerate(row):
            if kind == IDLE:
                continue
            done[(kind, s, i, c)] = t
            if kind == W:
                pending_w[s].pop(0)
                alive[s] -= 1
            else:
                pos[s] += 1
                alive[s] += kind == F
                if kind == B and split:
                    pending_w[s].append((i, c))
                elif kind == BW:
                    alive[s] -= 1
        rows.append(row)
        t += 1
        if t > 16 * sum(len(o) for o in orders) + 64:
            raise RuntimeError("pipeline schedule simulation did not finish (deadlocked op order)")
    return rows
