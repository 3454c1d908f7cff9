"""The ``Report`` of what a compiled step costs per device — memory, collectives, flops — and
how it prints, beside the estimate and its band (``executable`` reads a compiled program into
one).

``cost`` (estimates, target compiles) and ``explain`` (the report of a step compiled here) both
build reports, so the report lives here, below both: neither imports the other to get it.

Memory comes two ways: from the shard sizes of the state (exact bookkeeping, ``shard_bytes``)
and from XLA's ``memory_analysis()`` of the compiled program (arguments, outputs, temporaries).
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from ..terms import COMPILED_ROLES
from .branches import BranchCollective as BranchCollective
from .hlo.collectives import Collective as Collective, Traffic as Traffic


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of jax Arrays or ShapeDtypeStructs with shardings
    (the largest per-device share, which is what limits memory)."""
    per_device: dict[Any, float] = defaultdict(float)
    everywhere = 0  # unsharded leaves, and shards on an AbstractMesh (one on every device)
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        itemsize = np.dtype(x.dtype).itemsize if hasattr(x, "dtype") else 0
        if sharding is None:
            everywhere += math.prod(x.shape) * itemsize
        elif isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
            everywhere += math.prod(sharding.shard_shape(x.shape)) * itemsize
        else:
            shard = sharding.shard_shape(x.shape)
            for d in sharding.device_set:
                per_device[d] += math.prod(shard) * itemsize
    return int(max(per_device.values(), default=0) + everywhere)


@dataclasses.dataclass
class Report:
    """What one compiled step costs per device.

    Attributes:
        title: the plan and step it describes.
        memory: per-device bytes by kind: ``params``, ``opt_state``, ``model_state``,
            ``grads`` (transient, in the gradient layout), ``batch`` — from the shard sizes —
            and ``arguments``, ``outputs``, ``aliased``, ``temporaries``, ``peak`` from the
            compiled program (``peak`` = arguments + outputs − aliased + temporaries).
        collectives: executed collectives per kind.
        flops: per-device flops from XLA's ``cost_analysis()`` (XLA counts a loop body once).
        estimate: the analytic model's figures (*modelled*), when available (``sk.cost``).
        caveats: estimate quantity -> why its figure is only a bound or an approximation.
        compiled_on: which program the compiled figures were read from (this process's mesh,
            or a simulated mesh: ``sk.cost.simulate``).
        notes: what else a reader must know about the figures (e.g. why there is no estimate).
        seconds: wall time spent on the figures, where measured (``simulate``: ``export``,
            ``compile``, ``subprocess``); for a TPU target also ``xla_tpu_optimal``, XLA:TPU's
            own step-time figure (it counts a loop body once: shown, not used).
        target: the accelerator the program was compiled for (``"h100"``, ``"tpu-v5p"``;
            ``""``: this process's devices or simulated CPU devices).
        device_memory: bytes of memory one device of the target has (0: unknown).
        step_time: seconds per step by part, with ``step``; ``step_time_source`` says whose:
            the TPU compiler's own ``optimal_seconds``, or the step-time model fed with the
            compiled flops and collectives.
        offloaded: the state kinds the plan keeps in pinned host memory (``Plan.offload``);
            their ``memory`` rows are host bytes, and the compiled ``host_*`` rows (host
            arguments, outputs, aliased, temporaries, ``host_peak``) are what the program holds
            in host memory — device rows and ``peak`` exclude them.
        fp8_matmul_flops: of ``matmul_flops``, those of dots whose operands are fp8 (counted at
            the target's fp8 peak by the step-time model).
        unread_matmuls: matmuls XLA rewrote as elementwise multiply + reduce (a matrix-vector or
            outer product), whose flops ``matmul_flops`` cannot count; the report says so and
            compares no flops ratio (``unread_note``).
        kernels: ``(flops, bytes, executions)`` of each kernel the program launches, per device
            (``kernels.kernels_from_hlo``): what the step-time model's roofline times.
        branch_collectives: collectives inside ``conditional`` branches (``branches``), where a
            device that took another branch would leave the program hanging;
            ``hang_risks()`` are those that can.
    """

    title: str
    memory: dict[str, int]
    collectives: list[Collective]
    flops: float
    estimate: dict[str, float] | None = None
    caveats: dict[str, str] = dataclasses.field(default_factory=dict)
    traffic: list[Traffic] = dataclasses.field(default_factory=list)
    matmul_flops: float = 0.0
    data_axes: tuple[str, ...] = ()
    pipe_axis: str | None = None
    compiled_on: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    target: str = ""
    device_memory: float = 0.0
    step_time: dict[str, float] | None = None
    step_time_source: str = ""
    offloaded: tuple[str, ...] = ()
    fp8_matmul_flops: float = 0.0
    unread_matmuls: int = 0
    kernels: list = dataclasses.field(default_factory=list)
    branch_collectives: list[BranchCollective] = dataclasses.field(default_factory=list)

    @property
    def fits(self) -> bool | None:
        """Whether the compiled peak fits in the target device's memory (None: unknown)."""
        if not self.device_memory or "peak" not in self.memory:
            return None
        return self.memory["peak"] <= self.device_memory

    def headroom(self) -> float | None:
        """Device memory left at the compiled peak (negative: over by that much)."""
        return None if self.fits is None else self.device_memory - self.memory["peak"]

    def hang_risks(self) -> list[BranchCollective]:
        """The collectives inside conditional branches that devices of one group may reach on
        different branches (``BranchCollective.may_hang``): on real devices the program hangs
        at the first tick that splits them."""
        return [c for c in self.branch_collectives if c.may_hang(self.pipe_axis)]

    def collective_bytes(self) -> dict[str, int]:
        return {c.kind: c.bytes for c in self.collectives}

    def roles(self) -> dict[str, float]:
        """Executed collective bytes by what they are for, read off the mesh axes they span:
        ``grad-reduce`` (all-reduce/reduce-scatter over a data axis; bytes reduced, so XLA:CPU's
        all-reduce + slice and a GPU reduce-scatter count the same), ``param-gather``
        (all-gathers over a data axis: ZeRO), ``tensor-reduce`` / ``tensor-gather`` (over other
        axes: Megatron TP, sequence parallel), ``pipe-permute`` (collective-permutes),
        ``pipe-reduce`` (all-reduces over the pipeline axis alone: ``sk.pipeline``'s psums),
        ``pipe-relayout`` (with a pipeline: all-to-alls over its axis and permutes between
        non-neighbours, i.e. circular's stage-major weight order), ``context-permute`` /
        ``context-gather`` (``sk.context_attention``'s ring / all-gather of K/V over a
        ``context`` axis), ``expert-all-to-all`` (``sk.moe``'s dispatch and combine over an
        ``expert`` axis: all-to-alls, and the dropless dispatch's ragged-all-to-alls by their
        routed rows, a static bound); a permute that moves the result of a reduction over a
        data axis (traced through data movement: ``permutes``) is ``grad-reduce``, its bytes
        added to the reduction's: XLA reduced a gradient in another layout than ZeRO's shard
        (split over ``tensor``) and carries each reduced block to its owner; ``other`` (the rest, e.g.
        permutes XLA adds to reorder blocks between two shardings: nothing the estimate
        models, so ``comparison()`` lists it whenever it is not zero)."""
        out = dict.fromkeys(COMPILED_ROLES, 0.0)
        for role, t in self._with_roles():
            out[role] += t.operand_bytes if role in ("pipe-reduce", "grad-reduce", "tensor-reduce") else t.bytes
        return out

    def all_reduced(self) -> dict[str, float]:
        """The share of the gradient reduction's bytes (``roles()["grad-reduce"]``) reduced by
        all-reduces: XLA:CPU's all-reduce + slice, ZeRO-0's all-reduce, and XLA:TPU's over a
        group spanning every chip of a 3-D slice (v4/v5p 2x2x2 and up), where it all-reduces and
        slices rather than reduce-scatter (its only reduce-scatter emitter for such a group is a
        one-colour ring over one link, 1.5x slower than its all-reduce over the three
        dimensions' links: BENCHMARKS.md). The step time (``steptime.times``) times that
        share as the all-reduces it is."""
        total = ar = 0.0
        for role, t in self._with_roles():
            if role == "grad-reduce":
                total += t.operand_bytes
                ar += t.operand_bytes if t.kind == "all-reduce" else 0.0
        return {"grad-reduce": ar / total} if total else {}

    def role_counts(self) -> dict[str, int]:
        """Executed collectives by role (as ``roles()`` names them), through loops."""
        out = dict.fromkeys(COMPILED_ROLES, 0)
        for role, t in self._with_roles():
            out[role] += t.count
        return out

    def _with_roles(self):
        pipe = self.pipe_axis
        for t in self.traffic:
            # A context axis reduces the (replicated) weights' gradients like a data axis.
            data = bool(set(t.axes) & (set(self.data_axes) | {"context"}))
            if t.kind == "collective-permute" and t.after and set(t.after.split("+")) <= {
                    "all-reduce", "reduce-scatter"} and set(t.after_axes) & (set(self.data_axes) | {"context"}):
                yield "grad-reduce", t  # a data-reduced gradient carried to its ZeRO shard (``permutes``)
            elif "expert" in t.axes and t.kind in ("all-to-all", "ragged-all-to-all"):  # sk.moe padded or dropless
                yield "expert-all-to-all", t
            elif ("context" in t.axes and not set(t.axes) & set(self.data_axes)
                  and t.kind in ("collective-permute", "all-gather")):
                yield ("context-permute" if t.kind == "collective-permute" else "context-gather"), t
            elif pipe and t.kind == "all-reduce" and t.axes == (pipe,):
                yield "pipe-reduce", t
            elif pipe and ((t.kind == "collective-permute" and (t.axes != (pipe,) or not t.shift))
                           or (t.kind == "all-to-all" and pipe in t.axes)):
                yield "pipe-relayout", t
            elif t.kind in ("all-reduce", "reduce-scatter"):
                yield ("grad-reduce" if data else "tensor-reduce"), t
            elif t.kind == "all-gather":
                yield ("param-gather" if data else "tensor-gather"), t
            elif t.kind == "collective-permute" and pipe:
                yield "pipe-permute", t
            else:
                yield "other", t

    def compiled(self) -> dict[str, float]:
        """Every compiled figure under the names the estimate uses (``memory/peak``,
        ``collective/all-reduce``, ``collective/grad-reduce``, ``flops``, ...). ``flops`` is
        the matmul flops counted through loops (``flops/xla`` is XLA's own figure, which counts
        a ``while`` body once); all figures are per device per step."""
        out = {f"memory/{k}": float(v) for k, v in self.memory.items()}
        out.update({f"collective/{c.kind}": float(c.bytes) for c in self.collectives})
        if self.traffic:
            out.update({f"collective/{k}": v for k, v in self.roles().items()})
        out["flops"] = float(self.matmul_flops or self.flops)
        out["flops/xla"] = float(self.flops)
        return out

    def comparison(self) -> list[dict]:
        """Rows ``{"quantity", "estimate", "compiled", "caveat", "band"}`` for every quantity both
        sides have (a collective the program does not execute counts as 0 compiled bytes);
        ``caveat`` says why an estimate is approximate, or (``"not modelled: ..."``) why it is not
        modelled — the rendered table then prints the reason instead of the number (None:
        modelled); ``band``: the estimate's measured error band on this target
        (``sk.cost.bands``; None where not measured). A peak estimated more than 10% under the
        compiled one always carries a caveat that says so."""
        compiled = self.compiled()
        est = self.estimate or {}
        rows = [{"quantity": q, "estimate": float(est[q]), "compiled": compiled.get(q, 0.0)}
                for q in est if q in compiled or q.startswith("collective/")]
        if est and compiled.get("collective/other"):
            rows.append({"quantity": "collective/other", "estimate": float(est.get("collective/other", 0.0)),
                         "compiled": compiled["collective/other"]})
        from .bands import label, underestimate

        for r in rows:
            r["caveat"] = self.caveats.get(r["quantity"])
            r["band"] = label(self.target, r["quantity"])
            flag = underestimate(r["estimate"], r["compiled"]) if r["quantity"] == "memory/peak" else None
            if flag and not (r["caveat"] or "").startswith("not modelled"):
                r["caveat"] = flag + (f" ({r['caveat']})" if r["caveat"] else "")
            if r["quantity"] == "flops" and self.unread_matmuls:
                r["caveat"] = f"compiled figure incomplete: {self.unread_note()}"
        return rows

    def unread_note(self) -> str:
        """Why the compiled matmul flops miss some matmuls ("" when they do not)."""
        if not self.unread_matmuls:
            return ""
        return ("XLA rewrote matmuls of this program as elementwise multiply + reduce "
                f"({self.unread_matmuls} such ops traced to a dot_general), as it does for a matrix-vector "
                "or outer product (one row, column or contracted element per device: e.g. one batch row "
                "per device per microbatch); their flops are not in the compiled count, which is then "
                "below the work done (a batch with more rows per device keeps them matmuls)")

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table

        mem = Table(title="per-device memory", title_justify="left")
        mem.add_column("kind"); mem.add_column("bytes", justify="right"); mem.add_column("", justify="right")
        mem.add_column("from")
        host = self.offloaded or any(k.startswith("host_") for k in self.memory)
        if host:
            mem.add_column("where")
        for k, v in self.memory.items():
            row = [k, f"{v:,}", _human(v), "compiled" if k in _COMPILED_MEMORY or k.startswith("host_") else "shard sizes"]
            mem.add_row(*row, *(["host" if k.startswith("host_") or k in self.offloaded else "device"] if host else []))
        col = Table(title="collectives executed per step (per device)", title_justify="left")
        for c in ("kind", "count", "ops in program", "bytes", ""):
            col.add_column(c, justify="left" if c == "kind" else "right")
        for c in self.collectives:
            col.add_row(c.kind, str(c.count), str(c.static_count), f"{c.bytes:,}", _human(c.bytes))
        if not self.collectives:
            col.add_row("(none)", "0", "0", "0", "")
        where = f" for {self.compiled_on}" if self.compiled_on else ""
        parts = [f"[bold]{self.title}[/bold]",
                 f"compiled (read from XLA's program{where}): {', '.join(_COMPILED_MEMORY)} memory, "
                 "collectives, flops; shard sizes: the state's, batch's and gradients' bytes in the "
                 "plan's layout; modelled: the analytic estimate"
                 + ("" if self.estimate else " (none here)"),
                 *(f"note: {n}" for n in self.notes),
                 *(f"[bold red]may hang on real devices[/bold red]: a collective inside a conditional branch that "
                   f"devices of its group can skip: {c}" for c in self.hang_risks()),
                 *self._target_lines(),
                 mem, col, f"flops per device per step: matmuls through loops {self.matmul_flops:,.0f}"
                 + (f" ({self.fp8_matmul_flops / self.matmul_flops:.0%} in fp8 GEMMs)"
                    if self.fp8_matmul_flops and self.matmul_flops else "")
                 + f"; XLA cost analysis (loop bodies once) {self.flops:,.0f}"
                 + ((" (incomplete: see flops below the comparison)" if self.estimate
                     else f"\nnote: {self.unread_note()}") if self.unread_matmuls else "")]
        if self.estimate:
            est = Table(title="modelled (analytic estimate) vs compiled", title_justify="left")
            footnotes: dict[str, list[str]] = {}  # one paragraph per reason, naming its rows
            for c in ("quantity", "estimate", "compiled", "ratio", "modelled?", "band"):
                est.add_column(c, justify="right" if c in ("estimate", "compiled", "ratio") else "left")
            for r in self.comparison():
                if not r["estimate"] and not r["compiled"]:
                    continue  # neither side has it: nothing to compare
                fmt = (lambda v: f"{v:.3g}") if r["quantity"].startswith("flops") else _human
                caveat = r["caveat"] or "modelled"
                shown = not caveat.startswith("not modelled")  # the reason, not a number
                # No ratio against a compiled figure of 0 or one known to be incomplete.
                ratio = (f"{r['estimate'] / r['compiled']:.2f}" if shown and r["compiled"]
                         and not caveat.startswith("compiled figure incomplete") else "-")
                band = (r["band"] or "not measured") if shown else "-"
                if band.startswith("no band:"):
                    footnotes.setdefault(band, []).append(r["quantity"])
                    band = "no band (below)"
                est.add_row(r["quantity"], fmt(r["estimate"]) if shown else "unmodelled", fmt(r["compiled"]),
                            ratio, caveat.split(":")[0], band)
                if r["caveat"]:
                    footnotes.setdefault(r["caveat"], []).append(r["quantity"])
            parts.append(est)
            parts.extend(f"{', '.join(names)}: {text}" for text, names in footnotes.items())
        return Group(*parts)

    def _target_lines(self) -> list[str]:
        lines = []
        if self.fits is not None:
            peak, room = self.memory["peak"], self.headroom()
            verdict = (f"fits, {_human(room)} free" if room >= 0 else f"[bold red]does not fit[/bold red], "
                       f"over by {_human(-room)}")
            lines.append(f"{self.target or 'device'}: peak {_human(peak)} of {_human(self.device_memory)} "
                         f"per device: {verdict}")
        if "host_peak" in self.memory:
            lines.append(f"pinned host memory per device: {_human(self.memory['host_peak'])} (compiled; "
                         f"offloaded: {', '.join(self.offloaded) or 'activations'})")
        if self.step_time:
            lines.append(f"step time {self.step_time['step'] * 1e3:.3g} ms ({self.step_time_source})")
        return lines

    def render(self, html: bool = False, width: int = 110) -> str:
        from rich.console import Console

        # force_jupyter=False: inside a notebook rich would also display what it records (the
        # report rendered twice, with ANSI codes in its text/plain).
        console = Console(file=io.StringIO(), width=width, record=True, force_terminal=False,
                          force_jupyter=False)
        console.print(self)
        return console.export_html(inline_styles=True) if html else console.export_text()

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        return self.render(html=True)

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        """IPython's text/plain: the rendered report (not the dataclass's fields)."""
        printer.text(self.render())


_COMPILED_MEMORY = ("arguments", "outputs", "aliased", "temporaries", "peak")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)
