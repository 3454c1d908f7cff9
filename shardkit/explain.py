"""``explain()``: what a compiled step costs per device — memory, collectives, flops.

Memory comes two ways: from the shard sizes of the state (exact bookkeeping) and from XLA's
``memory_analysis()`` of the compiled program (arguments, outputs, temporaries). Collectives are
read off the post-partitioning HLO and counted as executed: an op inside a ``while`` body (a
``lax.scan`` over layers or microbatches) counts ``known_trip_count`` times.
"""

from __future__ import annotations

import dataclasses
import io
import math
import re
from collections import defaultdict
from typing import Any

import jax
import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
                "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One kind of collective in a compiled program.

    Attributes:
        kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``, ``all-to-all`` or
            ``collective-permute``.
        count: times it executes per step (ops inside loops × trip count).
        bytes: per-device bytes of the ops' results, summed over executions (for an
            all-gather the gathered size, for a reduce-scatter the shard).
        static_count: ops of this kind in the program text.
    """

    kind: str
    count: int
    bytes: int
    static_count: int


def _shape_bytes(text: str) -> int:
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            total += n * _DTYPE_BYTES[dtype]
    return int(total)


def collectives_from_hlo(hlo: str) -> list[Collective]:
    """Counts the collectives a post-partitioning HLO module executes, through loops."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        head = _COMP_HEAD.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    if entry is None:
        return []
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                calls[name].append((callee, int(trip.group(1)) if (role == "body" and trip) else 1))
            for group in _BRANCHES.findall(line):
                calls[name].extend((c.strip().lstrip("%"), 1) for c in group.split(",") if c.strip())
    mult: dict[str, int] = defaultdict(int)

    def visit(name: str, m: int, depth: int = 0):
        if depth > 64 or name not in comps:
            return
        mult[name] += m
        for callee, k in calls.get(name, ()):
            visit(callee, m * k, depth + 1)

    visit(entry, 1)
    count, nbytes, static = defaultdict(int), defaultdict(int), defaultdict(int)
    for name, lines in comps.items():
        m = mult.get(name, 0)
        for line in lines:
            ins = _INSTR.match(line)
            if not ins:
                continue
            result, op = ins.group(1), ins.group(2)
            base = op[:-6] if op.endswith("-start") else op
            if base not in COLLECTIVES or op.endswith("-done"):
                continue
            b = _shape_bytes(result)
            if op.endswith("-start") and result.startswith("("):
                # async start ops return (operands..., results..., contexts): count the results
                shapes = [_shape_bytes(s) for s in _split_tuple(result)]
                b = max(shapes) if base == "all-gather" else shapes[0] if shapes else 0
            static[base] += 1
            count[base] += m
            nbytes[base] += m * b
    return [Collective(k, count[k], nbytes[k], static[k]) for k in COLLECTIVES if static[k]]


def _split_tuple(text: str) -> list[str]:
    inner = text.strip()[1:-1]
    parts, depth, cur = [], 0, []
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur)); cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of jax Arrays or ShapeDtypeStructs with shardings
    (the largest per-device share, which is what limits memory)."""
    per_device: dict[Any, float] = defaultdict(float)
    total_if_unsharded = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        itemsize = np.dtype(x.dtype).itemsize if hasattr(x, "dtype") else 0
        if sharding is None:
            total_if_unsharded += math.prod(x.shape) * itemsize
            continue
        shard = sharding.shard_shape(x.shape)
        for d in sharding.device_set:
            per_device[d] += math.prod(shard) * itemsize
    return int(max(per_device.values(), default=0) + total_if_unsharded)


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
        estimate: the analytic model's figures, when available (``sk.cost``).
    """

    title: str
    memory: dict[str, int]
    collectives: list[Collective]
    flops: float
    estimate: dict[str, float] | None = None

    def collective_bytes(self) -> dict[str, int]:
        return {c.kind: c.bytes for c in self.collectives}

    def comparison(self) -> list[dict]:
        """Rows ``{"quantity", "estimate", "compiled"}`` for every quantity both sides have."""
        compiled = {f"memory/{k}": float(v) for k, v in self.memory.items()}
        compiled.update({f"collective/{c.kind}": float(c.bytes) for c in self.collectives})
        compiled["flops"] = float(self.flops)
        est = self.estimate or {}
        return [{"quantity": q, "estimate": float(est[q]), "compiled": compiled.get(q, 0.0)}
                for q in est if q in compiled or q.startswith("collective/")]

    def __rich__(self):
        from rich.console import Group
        from rich.table import Table

        mem = Table(title="per-device memory", title_justify="left")
        mem.add_column("kind"); mem.add_column("bytes", justify="right"); mem.add_column("", justify="right")
        for k, v in self.memory.items():
            mem.add_row(k, f"{v:,}", _human(v))
        col = Table(title="collectives executed per step (per device)", title_justify="left")
        for c in ("kind", "count", "ops in program", "bytes", ""):
            col.add_column(c, justify="left" if c == "kind" else "right")
        for c in self.collectives:
            col.add_row(c.kind, str(c.count), str(c.static_count), f"{c.bytes:,}", _human(c.bytes))
        if not self.collectives:
            col.add_row("(none)", "0", "0", "0", "")
        parts = [f"[bold]{self.title}[/bold]", mem, col, f"flops per device per step (XLA cost analysis): {self.flops:,.0f}"]
        if self.estimate:
            est = Table(title="analytic estimate vs compiled", title_justify="left")
            for c in ("quantity", "estimate", "compiled", "ratio"):
                est.add_column(c, justify="left" if c == "quantity" else "right")
            for r in self.comparison():
                ratio = r["estimate"] / r["compiled"] if r["compiled"] else float("nan")
                est.add_row(r["quantity"], _human(r["estimate"]), _human(r["compiled"]), f"{ratio:.2f}")
            parts.append(est)
        return Group(*parts)

    def render(self, html: bool = False, width: int = 110) -> str:
        from rich.console import Console

        console = Console(file=io.StringIO(), width=width, record=True, force_terminal=False)
        console.print(self)
        return console.export_html(inline_styles=True) if html else console.export_text()

    def __str__(self) -> str:
        return self.render()

    def _repr_html_(self) -> str:
        return self.render(html=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def report_from_compiled(compiled, title: str, memory: dict[str, int] | None = None) -> Report:
    """A ``Report`` for any compiled JAX program (``jax.jit(f).lower(...).compile()``)."""
    mem = dict(memory or {})
    ma = compiled.memory_analysis()
    if ma is not None:
        args, outs = ma.argument_size_in_bytes, ma.output_size_in_bytes
        alias, temp = ma.alias_size_in_bytes, ma.temp_size_in_bytes
        mem.update(arguments=args, outputs=outs, aliased=alias, temporaries=temp,
                   peak=args + outs - alias + temp)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    return Report(title, mem, collectives_from_hlo(compiled.as_text()), flops)


def explain_step(step, state, batch) -> Report:
    """The report behind ``TrainStep.explain``."""
    compiled = step.lower(state, batch).compile()
    plan = step.plan
    grad_specs = step._specs("grads")
    grads = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, plan.precision.grads, sharding=plan.sharding(s)),
        state.params, grad_specs)
    placed, _ = step._place_batch(batch)
    memory = {"params": shard_bytes(state.params), "opt_state": shard_bytes(state.opt_state),
              "model_state": shard_bytes(state.model_state), "grads": shard_bytes(grads),
              "batch": shard_bytes(placed)}
    title = f"{plan!r}, microbatches={step.microbatches}"
    return report_from_compiled(compiled, title, memory)
