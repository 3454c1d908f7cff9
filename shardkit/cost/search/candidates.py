"""The layouts ``search`` ranks: every way to split a model over N devices that the analytic
model can estimate (mesh axes, ZeRO stage, microbatches, remat, pipeline schedule, chunks per
stage and what an explicit schedule keeps for its backward)."""

from __future__ import annotations

import dataclasses
import itertools

from ...pipeline.keep import KEEP
from ...pipeline.schedules import EXPLICIT
from ..terms import Layout

POW2 = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# A context axis is searched only where each of its shards still holds this many tokens of a
# sequence: Llama 3 turned context parallelism on for its 128K phase alone, 8K tokens per GPU
# (CP 16; Llama Team 2024, sec. 3.3.2), and shorter blocks leave ring attention's K/V
# transfers less compute to hide behind.
CONTEXT_MIN_TOKENS = 8192


def layouts(devices: int, *, layers: int, heads: int, global_batch: int, node_size: int = 8,
            zero=(0, 1, 3), microbatches=(1, 2, 4, 8, 16, 32), remat=("none", "dots", "full"),
            tensor=None, pipe=None, fsdp=None, schedules=("1f1b", "gpipe", "circular"),
            sequence_parallel=(False, True), replicas=(1,), diloco_every=(100,), keep=KEEP,
            repeats=None, context=None, seq: int | None = None) -> list[Layout]:
    """Every layout of ``devices`` the search considers: power-of-two ``tensor`` within a node
    dividing the heads, ``pipe`` dividing the layers, a ``context`` axis where ``seq`` is long
    enough (default: power-of-two splits leaving each shard ``CONTEXT_MIN_TOKENS`` or more,
    the sequence a multiple of twice the axis for the zig-zag order), the rest split between
    ``data`` and ``fsdp``; ZeRO stages over ``data``; microbatches that divide the batch (≥
    stages). ``"circular"`` and ``"interleaved-1f1b"`` (microbatches a multiple of the stages)
    take each ``repeats`` (chunks per stage; default every divisor > 1 of the layers per
    stage). The explicit schedules (``"1f1b"``, ``"interleaved-1f1b"``, ``"zb-h1"``) with
    ``remat="none"`` take each ``keep`` (``sk.pipeline(keep=)``: ``"input"`` recomputes each
    chunk's forward in its backward op, ``"all"`` / ``"dots"`` / ``"lean"`` keep every in-flight
    chunk-microbatch's residuals, the policy's saved set, or the values a layer names
    ``sk.LEAN_RESIDUALS``). ``schedules`` may also name
    ``"interleaved-1f1b"`` and ``"zb-h1"``; they are not searched by default.
    ``replicas`` > 1 adds DiLoCo layouts (``sk.DiLoCo``): that many copies of each layout of
    ``devices / replicas``, outermost, syncing every ``diloco_every`` steps (asked for, never
    by default: DiLoCo trains differently from data parallelism)."""
    if tuple(replicas) != (1,):
        kw = dict(node_size=node_size, zero=zero, microbatches=microbatches, remat=remat, tensor=tensor, pipe=pipe,
                  fsdp=fsdp, schedules=schedules, sequence_parallel=sequence_parallel, keep=keep, repeats=repeats,
                  context=context, seq=seq)
        out = []
        for r in replicas:
            if devices % r or global_batch % r:
                continue
            for h in (diloco_every if r > 1 else (1,)):
                out += [dataclasses.replace(lo, replica=r, diloco_every=h)
                        for lo in layouts(devices // r, layers=layers, heads=heads, global_batch=global_batch // r, **kw)]
        return out
    out = []
    tensors = tensor or [t for t in POW2 if t <= node_size and heads % t == 0]
    pipes = pipe or [p for p in POW2 if p <= layers and layers % p == 0]
    contexts = context or [c for c in POW2 if c == 1 or (seq and seq % (2 * c) == 0 and seq // c >= CONTEXT_MIN_TOKENS)]
    for t, c, p in itertools.product(tensors, contexts, pipes):
        if devices % (t * c * p):
            continue
        rest = devices // (t * c * p)
        for f in (fsdp or [x for x in POW2 if x <= rest]):
            if rest % f:
                continue
            d = rest // f
            for z, m, r in itertools.product(zero, microbatches, remat):
                if (d == 1 and z) or global_batch % (d * f * m) or (p > 1 and m < p):
                    continue
                for sched in (schedules if p > 1 else ("gpipe",)):
                    if sched == "interleaved-1f1b" and m % p:
                        continue
                    for v in _repeats(sched, layers // p, repeats):
                        for k in (keep if sched in EXPLICIT and r == "none" else ("input",)):
                            for sp in (sequence_parallel if t > 1 else (False,)):
                                out.append(Layout(d, f, t, p, z, m, sched, v, r, sp, context=c, keep=k))
    return out


def _repeats(schedule: str, stage_layers: int, repeats) -> list[int]:
    """Chunks per stage ``layouts`` tries: 1 but for circular and interleaved 1F1B, which take
    each of ``repeats`` (default every divisor > 1) that divides the stage's layers."""
    if schedule not in ("circular", "interleaved-1f1b"):
        return [1]
    return [v for v in (repeats or range(2, stage_layers + 1)) if v > 1 and stage_layers % v == 0]
