"""Layout search: enumerate meshes, ZeRO stages, microbatches and remat; rank by estimated
step time (``sk.search``), and weak-scaling predictions (the ``shardkit plan`` command that
prints them is ``plan_cli``)."""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable
from typing import Any

from rich.table import Table

from ...precision import Precision
from .. import hardware as hw_lib
from ..compiled.bands import underestimate
from ..analytic.from_shape import estimate
from ..terms import Estimate, Layout, model_shape
from ..analytic.steptime import efficiency_for, links, times
from .candidates import layouts



@dataclasses.dataclass
class SearchResult:
    """Ranked layouts: fitting ones first, then by estimated step time.

    Attributes:
        model: the model's name; devices, hardware, global_batch: what was asked.
        estimates: one ``Estimate`` per layout, ranked; near-identical layouts (the same but
            for the data/fsdp split or ZeRO stage, within 0.5% in step time — e.g. ZeRO-3 over
            ``data`` vs ``fsdp`` over the same devices) appear once, the fastest first.
        equivalents: per estimate, the layouts folded into it.
        verified: per estimate, what compiling it on a simulated mesh found (``search(...,
            verify=k)``), or None where it was not compiled.
    """

    model: str
    devices: int
    hardware: str
    global_batch: int
    estimates: list[Estimate]
    equivalents: list[list[str]] = dataclasses.field(default_factory=list)
    verified: list["Verified | None"] = dataclasses.field(default_factory=list)

    @property
    def best(self) -> Estimate:
        if not self.estimates:
            raise ValueError("search found no layout: loosen the options or change the device count")
        return self.estimates[0]

    @property
    def rows(self) -> list[dict]:
        """One dict per layout: ``layout``, ``mesh``, ``zero``, ``microbatches``, ``remat``,
        ``schedule``, ``repeats``, ``keep`` (``sk.pipeline(keep=)``), ``step_time`` (s), ``mfu``, ``tokens_per_s``, ``memory`` (peak bytes per
        device), ``fits``, and the time parts (``t_compute``, ``t_grad-reduce``, ...)."""
        out = []
        for rank, e in enumerate(self.estimates, 1):
            lo = e.layout
            row = {"rank": rank, "layout": str(lo), "mesh": lo.mesh, "zero": lo.zero,
                   "microbatches": lo.microbatches, "remat": lo.remat,
                   "schedule": lo.schedule if lo.pipe > 1 else "", "repeats": lo.repeats, "keep": lo.keep,
                   "sequence_parallel": lo.sequence_parallel,
                   "step_time": e.step_time, "mfu": e.mfu, "tokens_per_s": e.tokens_per_s,
                   "memory": e.memory["peak"], "fits": e.fits,
                   "equivalent": self.equivalents[rank - 1] if rank <= len(self.equivalents) else []}
            row.update({f"t_{k}": v for k, v in e.time.items() if k != "step"})
            v = self.verified[rank - 1] if rank <= len(self.verified) else None
            if v is not None:
                row.update({"compiled_memory": v.peak, "compiled_step_time": v.step_time,
                            "compiled_fits": v.fits, "compiled_error": v.error,
                            "flags": compiled_flags(e, v)})
            out.append(row)
        return out

    def shown_rows(self, top: int) -> list[dict]:
        """``rows`` of the best ``top`` layouts and of every compiled one."""
        # A layout that compiled but does not fit ranks below every uncompiled one; hiding it
        # would hide what the compile found.
        return [r for r in self.rows if r["rank"] <= top or "compiled_memory" in r]

    def table(self, top: int = 15):
        """A ``rich`` table of the best ``top`` layouts and every compiled one (a compiled layout
        that does not fit ranks last, yet stays shown), each mesh written whole; with compiled
        columns, a figure the estimate is more than 10% under is marked ``!`` and its flag
        (``compiled_flags``) printed under the table."""

        eff = efficiency_for(hw_lib.lookup(self.hardware))
        t = RankTable(title=f"{self.model} on {self.devices} x {self.hardware}, global batch "
                        f"{self.global_batch} — estimated (matmuls at {eff.matmul:.0%} of peak; "
                        f"exposed comm: data {eff.exposed_data:.0%}, tensor {eff.exposed_tensor:.0%})")
        checked = any(v is not None for v in self.verified)
        if checked:
            target = next((v.report.target for v in self.verified if v is not None and v.report is not None
                           and v.report.target), "")
            where = (f"{target}'s compiler's program for the layout, compiled deviceless" if target else
                     "XLA:CPU's program for the layout on simulated devices (its buffers: 16-bit dots in f32)")
            t.caption = f"compiled: {where}; step time re-timed with its collective bytes per role"
        rows = self.shown_rows(top)
        meshes = [r["mesh"] + (" +sp" if r["sequence_parallel"] else "") for r in rows]
        for c in ("#", "mesh", "zero", "m", "remat", "pipe sched", "step (s)", "MFU", "tok/s/dev",
                  "mem/dev (GB)", "fits", "bound by", "+same") + (
                      ("compiled mem (GB)", "compiled step (s)", "compiled fits") if checked else ()):
            # The mesh is what a reader picks: never cut ("data=8,…"); other headers may wrap.
            wide = dict(no_wrap=True, min_width=max(map(len, meshes), default=4)) if c == "mesh" else {}
            t.add_column(c, justify="left" if c in ("mesh", "remat", "pipe sched", "bound by") else "right",
                         overflow="fold", **wide)
        flagged = [f"#{r['rank']} {m}: {'; '.join(r['flags'])}" for r, m in zip(rows, meshes) if r.get("flags")]
        if flagged:
            t.caption += "\n! " + "\n! ".join(flagged)
        for r, mesh in zip(rows, meshes):
            parts = {k[2:]: v for k, v in r.items() if k.startswith("t_") and k not in ("t_bubble", "t_exposed")}
            bound = max(parts, key=parts.get)
            t.add_row(str(r["rank"]), mesh, str(r["zero"]),
                      str(r["microbatches"]), r["remat"], _schedule_cell(r), f"{r['step_time']:.3f}",
                      f"{r['mfu']:.1%}", f"{r['tokens_per_s'] / self.devices:,.0f}",
                      f"{r['memory'] / 1e9:.1f}", "yes" if r["fits"] else "[red]no[/red]", bound,
                      str(len(r["equivalent"])) if r["equivalent"] else "", *(_compiled_cells(r) if checked else ()))
        return t

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        return _render(self.table())

    def _repr_html_(self) -> str:
        return _render(self.table(), html=True)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text(str(self))


def search(model: Any, devices: int, hardware: str | hw_lib.Hardware = "h100", *, global_batch: int,
           memory_limit: float | None = None, seq: int | None = None, precision: str = "bf16",
           top: int | None = None, flops_per_token: float | None = None, verify: int = 0,
           build: Callable[[Layout], tuple] | None = None, step=None, state=None, batch=None,
           timeout: float = 1800.0, target: str = "cpu", **options) -> SearchResult:
    ms = model_shape(model, flops_per_token=flops_per_token, seq=seq)
    hw = hardware if isinstance(hardware, hw_lib.Hardware) else hw_lib.lookup(hardware)
    cands = layouts(devices, layers=ms.layers, heads=max(ms.heads, 1), global_batch=global_batch, seq=ms.seq,
                    node_size=min(links(hw)[0], 8 if hw.name.startswith(("h", "a")) else 16), **options)
    if not cands:
        raise ValueError(
            f"no layout of {devices} devices splits a global batch of {global_batch} (model "
            f"{ms.name}: {ms.layers} layers, {ms.heads} heads); use a batch that is a multiple "
            "of the device count, or loosen the options")
    prec = Precision.resolve(precision)  # once, not per layout
    ests = [estimate(ms, lo, hw, global_batch=global_batch, precision=prec,
                     memory_limit=memory_limit) for lo in cands]
    ests.sort(key=lambda e: (not e.fits, e.step_time, e.memory["peak"], _complexity(e.layout)))
    kept, same = _dedupe(ests)
    checked: list[Verified | None] = []
    if verify:
        kept, same, checked = _verify(kept, same, verify, _job_for(build, step, state, batch), hw,
                                      target=target, timeout=timeout)
    if top:
        kept, same, checked = kept[:top], same[:top], checked[:top]
    return SearchResult(ms.name, devices, hw.name, global_batch, kept, same, checked)


@dataclasses.dataclass
class Verified:
    """What compiling one layout on a simulated mesh found (``search(..., verify=k)``).

    Attributes:
        report: the ``sk.Report`` of the compiled step (None if it could not be compiled).
        peak: XLA's per-device peak bytes; ``fits``: within the search's memory limit.
        time: step-time parts re-timed (``steptime.times``) with the compiled collective bytes
            and counts per role and the estimate's flops.
        error: why the layout could not be compiled (its rules or batch do not fit, or the
            compiler failed), else "".
    """

    report: Any
    peak: float
    fits: bool
    time: dict[str, float]
    error: str = ""

    @property
    def step_time(self) -> float:
        return self.time.get("step", float("nan"))


def _job_for(build, step, state, batch) -> Callable[[Layout], dict]:
    """``layout -> simulate_many job``: ``build(layout)``'s ``(step, state, batch)`` on its plan's
    mesh, or the given step re-planned on the layout's mesh, ZeRO stage and microbatches."""
    if build is not None:
        def built(lo: Layout) -> dict:
            s, st, b = build(lo)
            if s.plan.mesh.size != lo.devices:
                raise ValueError(f"build({lo}) returned a step planned on {dict(s.plan.mesh.shape)}, "
                                 f"not on the layout's {lo.devices} devices ({lo.mesh})")
            return {"step": s, "state": st, "batch": b, "mesh": s.plan.mesh}
        return built
    if step is None or state is None or batch is None:
        raise ValueError("search(verify=k) compiles the top k layouts: give build=layout -> (step, state, "
                         "batch), or step=, state= and batch= (the step is re-planned on each layout's mesh)")
    return lambda lo: {"step": step, "state": state, "batch": batch, "mesh": lo.mesh, "zero": lo.zero,
                       "microbatches": lo.microbatches}


def _verify(kept: list[Estimate], same: list[list[str]], k: int, job_for, hw: hw_lib.Hardware, *,
            target: str, timeout: float):
    """Compiles the best ``k`` layouts for ``target`` (one subprocess for all) and re-ranks them:
    those whose compiled peak fits first, by the step time re-timed with their compiled
    traffic; then the layouts not compiled, in the analytic order; then compiled ones that do
    not fit, and those that failed to compile."""
    from ...rules import ShardingError
    from ..compiled.simulated import SimulationError, simulate_many

    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"verify must be a non-negative integer (layouts to compile), got {k!r}")
    jobs, errors = [], {}
    for i, e in enumerate(kept[:k]):
        try:
            jobs.append(job_for(e.layout))
        except (ShardingError, ValueError) as err:
            errors[i] = err
    reports = iter(simulate_many(jobs, target=target, timeout=timeout) if jobs else [])
    checked: list[Verified] = []
    for i, e in enumerate(kept[:k]):
        report = errors.get(i) or next(reports)
        if isinstance(report, Exception):
            if not isinstance(report, (ShardingError, SimulationError, ValueError)):
                raise report
            need = getattr(report, "required", float("nan"))  # DoesNotFit: the compiler's own figure
            checked.append(Verified(None, need, False, {}, f"{type(report).__name__}: {report}"))
            continue
        # The estimate's busy flops (``times`` divided them by the achievable matmul rate).
        flops = e.time["compute"] * hw.peak_flops * efficiency_for(hw).matmul
        peak = float(report.memory["peak"])
        checked.append(Verified(report, peak, peak <= e.memory_limit,
                                times(report.roles(), report.role_counts(), flops, hw, e.layout)))
    rest = [(e, s, None) for e, s in zip(kept[k:], same[k:])]
    mine = list(zip(kept[:k], same[:k], checked))
    good = sorted((x for x in mine if x[2].fits), key=lambda x: x[2].step_time)
    order = good + rest + [x for x in mine if not x[2].fits and not x[2].error] + [x for x in mine if x[2].error]
    return [x[0] for x in order], [x[1] for x in order], [x[2] for x in order]


def compiled_flags(e: Estimate, v: Verified) -> list[str]:
    """The flags of a compiled layout whose estimate is more than 10% under what compiling it
    found (``bands.underestimate``): its peak, and its step time re-timed on the compiled
    collectives. What ``SearchResult.table`` and the notebooks print beside the two figures."""
    if v.report is None:
        return []
    flags = [underestimate(e.memory["peak"], v.peak, "peak"),
             underestimate(e.step_time, v.step_time, "step time (re-timed on its collectives)")]
    return [f for f in flags if f]


def _schedule_cell(row: dict) -> str:
    """The pipeline column: schedule, chunks per stage (``x4``), and a ``keep`` other than the
    stage input."""
    if not row["schedule"]:
        return ""
    v = f"x{row['repeats']}" if row["repeats"] > 1 else ""
    return row["schedule"] + v + (f" keep={row['keep']}" if row["keep"] != "input" else "")


def _compiled_cells(row: dict) -> tuple[str, str, str]:
    if "compiled_memory" not in row:
        return "", "", ""
    if row["compiled_error"]:
        return "[red]error[/red]", "", "[red]no[/red]"
    mark = lambda what: " [bold red]![/bold red]" if any(what in f for f in row["flags"]) else ""  # noqa: E731
    return (f"{row['compiled_memory'] / 1e9:.1f}{mark('peak')}", f"{row['compiled_step_time']:.3f}{mark('step')}",
            "yes" if row["compiled_fits"] else "[red]no[/red]")


class RankTable(Table):
    """``SearchResult.table``'s: a ``rich`` table a notebook shows as plain text and HTML (rich's
    own display puts ANSI codes in the text/plain)."""

    def _repr_mimebundle_(self, include=None, exclude=None, **_):
        return {"text/plain": _render(self), "text/html": _render(self, html=True)}


def _render(renderable, html: bool = False, width: int = 180) -> str:
    """Text or HTML of a rich renderable, recorded off-screen (never displayed by rich itself:
    in a notebook it would be shown twice, with ANSI codes in its text)."""
    from rich.console import Console

    c = Console(file=io.StringIO(), width=width, record=True, force_terminal=False, force_jupyter=False)
    c.print(renderable)
    return c.export_html(inline_styles=True) if html else c.export_text()


def _complexity(lo: Layout) -> tuple:
    """Tie-break among equal estimates: fewer mesh axes, lower ZeRO stage, fewer microbatches,
    less remat, fewer chunks per stage, the stage input kept only, no sequence parallelism."""
    axes = sum(getattr(lo, a) > 1 for a in ("data", "fsdp", "tensor", "pipe", "context"))
    return (axes, lo.zero, lo.microbatches, ("none", "dots", "full").index(lo.remat), lo.repeats,
            lo.keep != "input", lo.sequence_parallel)


def _dedupe(ests: list[Estimate], rel: float = 0.005) -> tuple[list[Estimate], list[list[str]]]:
    """Folds near-identical layouts into the first (fastest, then smallest) one: same tensor,
    pipe, context, microbatches, remat, schedule, chunks, keep and sequence parallelism, and a step time within
    ``rel`` — i.e. layouts that differ only in how the data-parallel devices split between
    ``data`` and ``fsdp`` or in the ZeRO stage, where that changes (almost) nothing. Layouts
    with identical estimates (e.g. 1F1B and GPipe when microbatches = stages) fold too."""
    kept: list[Estimate] = []
    same: list[list[str]] = []
    families: dict[tuple, list[int]] = {}
    exact: dict[tuple, int] = {}
    for e in ests:
        lo = e.layout
        family = (e.fits, lo.tensor, lo.pipe, lo.microbatches, lo.remat, lo.schedule, lo.repeats,
                  lo.sequence_parallel, lo.replica, lo.diloco_every, lo.context, lo.keep)
        key = (e.fits, f"{e.step_time:.6g}", f"{e.memory['peak']:.6g}")
        hit = exact.get(key)
        if hit is None:
            hit = next((i for i in families.get(family, ())
                        if abs(e.step_time - kept[i].step_time) <= rel * kept[i].step_time), None)
        if hit is not None:
            same[hit].append(str(lo))
            continue
        families.setdefault(family, []).append(len(kept))
        exact[key] = len(kept)
        kept.append(e)
        same.append([])
    return kept, same


def weak_scaling(model: Any, layout: Layout, hardware: str | hw_lib.Hardware = "h100", *,
                 per_device_batch: float, devices=(8, 64, 256), precision: str = "bf16",
                 seq: int | None = None) -> list[dict]:
    """Tokens/s per device as the data axis grows with the device count (tensor, pipe, ZeRO,
    microbatches and remat kept; fsdp kept up to what fits), relative to the smallest count."""
    rows, base = [], None
    group = layout.tensor * layout.pipe
    for n in devices:
        if n % group:
            continue
        replicas = n // group
        f = math.gcd(layout.fsdp, replicas)
        lo = dataclasses.replace(layout, data=replicas // f, fsdp=f,
                                 zero=layout.zero if replicas // f > 1 else 0)
        gb = max(int(per_device_batch * n), replicas * lo.microbatches)
        gb -= gb % (replicas * lo.microbatches)
        e = estimate(model, lo, hardware, global_batch=gb, precision=precision, seq=seq)
        per_dev = e.tokens_per_s / n
        base = base or per_dev
        rows.append({"devices": n, "layout": str(lo), "global_batch": gb, "step_time": e.step_time,
                     "tokens_per_s_per_device": per_dev, "efficiency": per_dev / base, "mfu": e.mfu})
    return rows
