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


def _walk(hlo: str, branch_weights: dict[int, list[float]] | None = None
          ) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Splits HLO text into computations and counts how often each runs per step: an entry
    computation once, a ``while`` body ``known_trip_count`` times its caller, others as called.

    A conditional runs one branch per call, which the text cannot tell; each branch counts
    once per call unless ``branch_weights[n]`` gives, for conditionals of ``n`` branches, the
    fraction of calls that take each branch (e.g. from a pipeline's schedule table)."""
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
    mult: dict[str, float] = defaultdict(float)
    if entry is None:
        return comps, mult
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            for role, callee in _CALLEE.findall(line):
                calls[name].append((callee, int(trip.group(1)) if (role == "body" and trip) else 1))
            for group in _BRANCHES.findall(line):
                branches = [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
                w = (branch_weights or {}).get(len(branches)) or [1.0] * len(branches)
                calls[name].extend(zip(branches, w))

    def visit(name: str, m: int, depth: int = 0):
        if depth > 64 or name not in comps:
            return
        mult[name] += m
        for callee, k in calls.get(name, ()):
            visit(callee, m * k, depth + 1)

    visit(entry, 1)
    return comps, mult


def _collective_ops(hlo: str, branch_weights=None):
    """Yields ``(kind, multiplicity, result_bytes, line)`` for every collective op."""
    comps, mult = _walk(hlo, branch_weights)
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
            yield base, m, b, line


def collectives_from_hlo(hlo: str) -> list[Collective]:
    """Counts the collectives a post-partitioning HLO module executes, through loops."""
    count, nbytes, static = defaultdict(int), defaultdict(int), defaultdict(int)
    for base, m, b, _ in _collective_ops(hlo):
        static[base] += 1
        count[base] += m
        nbytes[base] += m * b
    return [Collective(k, round(count[k]), round(nbytes[k]), static[k]) for k in COLLECTIVES if static[k]]


_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,\s]*\},?\s*)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9,\s]*\},?\s*)*)\}")
_DOT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+dot\(\s*(?:(\S+\[[0-9,]*\])\S*\s+)?%?([\w.\-]+)")
_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s")
_LHS_C = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text or "")]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _device_groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups a collective runs over, from any of HLO's three spellings."""
    if (m := _MESH.search(line)) is not None:
        names = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in names]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(-1) if m.group(2)
               else np.arange(math.prod(sizes)))
        grid = ids.reshape(sizes)
        over = [i for i, (n, _) in enumerate(names) if f"'{n}'" in m.group(4)]
        rest = [i for i in range(len(sizes)) if i not in over]
        size = math.prod(sizes[i] for i in over)
        return grid.transpose(rest + over).reshape(-1, size).tolist()
    if (m := _IOTA.search(line)) is not None:
        shape = _ints(m.group(1))
        return _iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(shape).tolist()
    if (m := _PAIRS.search(line)) is not None:
        return [_ints(g) for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))]
    if (m := _EXPLICIT.search(line)) is not None:
        groups = [_ints(g) for g in re.findall(r"\{([0-9,\s]*)\}", m.group(1))]
        if groups and any(groups):
            return groups
    return [list(range(n_devices))]


def _axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the members of a device group differ (ids are mesh positions)."""
    names, dims = list(mesh_shape), tuple(mesh_shape.values())
    coords = np.array(np.unravel_index(np.asarray(groups[0]), dims)).T if dims else np.zeros((1, 0))
    return tuple(n for i, n in enumerate(names) if len(set(coords[:, i].tolist())) > 1)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Executed collectives of one kind over one set of mesh axes.

    Attributes:
        kind: the collective (``all-reduce``, ``all-gather``, ...).
        axes: the mesh axes its device groups span (``("data",)``, ``("tensor",)``).
        group: devices per group.
        count: executions per step (through loop trip counts).
        bytes: per-device result bytes summed over executions.
        operand_bytes: per-device input bytes: the result for all-reduce, permute and
            all-to-all, result/group for all-gather, result×group for reduce-scatter. For
            reductions this is the "bytes reduced" figure, the same whether XLA emits a
            reduce-scatter (GPU) or an all-reduce plus slice (XLA:CPU).
    """

    kind: str
    axes: tuple[str, ...]
    group: int
    count: int
    bytes: int
    operand_bytes: int


def traffic_from_hlo(hlo: str, mesh_shape: dict[str, int], branch_weights=None) -> list[Traffic]:
    """Executed collectives per (kind, mesh axes), through loops (see ``Traffic``)."""
    n = math.prod(mesh_shape.values()) if mesh_shape else 1
    acc: dict[tuple, list[float]] = {}
    for kind, m, b, line in _collective_ops(hlo, branch_weights):
        groups = _device_groups(line, n)
        size = max(len(groups[0]), 1) if kind != "collective-permute" else 2
        axes = _axes_of(groups, mesh_shape) if mesh_shape else ()
        operand = b // size if kind == "all-gather" else b * size if kind == "reduce-scatter" else b
        row = acc.setdefault((kind, axes, size), [0, 0, 0])
        row[0] += m; row[1] += m * b; row[2] += m * operand
    return [Traffic(k, a, s, round(c), round(b), round(o)) for (k, a, s), (c, b, o) in acc.items()]


def matmul_flops_from_hlo(hlo: str) -> float:
    """Flops of every ``dot`` (2 × result elements × contracted size), counted through loop
    trip counts — XLA's ``cost_analysis`` counts a ``while`` body once."""
    comps, mult = _walk(hlo)
    total = 0.0
    for name, lines in comps.items():
        m = mult.get(name, 0)
        if not m:
            continue
        shapes = {}
        for line in lines:
            if (d := _NAMED.match(line)) is not None:
                shapes[d.group(1)] = d.group(2)
        for line in lines:
            d = _DOT.match(line)
            if d is None:
                continue
            lhs = d.group(2) or shapes.get(d.group(3), "")
            lhs_dims = _ints(lhs.split("[", 1)[1].split("]", 1)[0]) if "[" in lhs else []
            res = _ints(d.group(1).split("[", 1)[1].split("]", 1)[0]) if "[" in d.group(1) else []
            c = _LHS_C.search(line)
            k = math.prod(lhs_dims[i] for i in _ints(c.group(1)) if i < len(lhs_dims)) if c else 1
            total += m * 2.0 * math.prod(res) * k
    return total


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
    traffic: list[Traffic] = dataclasses.field(default_factory=list)
    matmul_flops: float = 0.0
    data_axes: tuple[str, ...] = ()
    pipe_axis: str | None = None

    def collective_bytes(self) -> dict[str, int]:
        return {c.kind: c.bytes for c in self.collectives}

    def roles(self) -> dict[str, float]:
        """Executed collective bytes by what they are for, read off the mesh axes they span:
        ``grad-reduce`` (all-reduce/reduce-scatter over a data axis; bytes reduced, so XLA:CPU's
        all-reduce + slice and a GPU reduce-scatter count the same), ``param-gather``
        (all-gathers over a data axis: ZeRO), ``tensor-reduce`` / ``tensor-gather`` (over other
        axes: Megatron TP, sequence parallel), ``pipe-permute`` (collective-permutes),
        ``pipe-reduce`` (all-reduces over the pipeline axis alone: ``sk.pipeline``'s psums)."""
        out = dict.fromkeys(("grad-reduce", "param-gather", "tensor-reduce", "tensor-gather",
                             "pipe-permute", "pipe-reduce", "other"), 0.0)
        for t in self.traffic:
            data = bool(set(t.axes) & set(self.data_axes))
            if t.kind == "all-reduce" and self.pipe_axis and t.axes == (self.pipe_axis,):
                out["pipe-reduce"] += t.operand_bytes
            elif t.kind in ("all-reduce", "reduce-scatter"):
                out["grad-reduce" if data else "tensor-reduce"] += t.operand_bytes
            elif t.kind == "all-gather":
                out["param-gather" if data else "tensor-gather"] += t.bytes
            elif t.kind == "collective-permute":
                out["pipe-permute"] += t.bytes
            else:
                out["other"] += t.bytes
        return out

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
        """Rows ``{"quantity", "estimate", "compiled"}`` for every quantity both sides have
        (a collective the program does not execute counts as 0 compiled bytes)."""
        compiled = self.compiled()
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
        parts = [f"[bold]{self.title}[/bold]", mem, col, f"flops per device per step: matmuls through loops {self.matmul_flops:,.0f}; "
                 f"XLA cost analysis (loop bodies once) {self.flops:,.0f}"]
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


def report_from_compiled(compiled, title: str, memory: dict[str, int] | None = None,
                         mesh=None, data_axes: tuple[str, ...] = (), pipeline: dict | None = None) -> Report:
    """A ``Report`` for any compiled JAX program (``jax.jit(f).lower(...).compile()``).

    With ``mesh`` the collectives are also attributed to mesh axes (``Report.traffic``).
    ``pipeline`` (``sk.pipeline``'s trace note) names the pipe axis, and for 1F1B weights the
    branches of its per-tick ``lax.switch`` by how often the schedule table takes each
    (averaged over stages), so collectives inside a backward branch count m times, not once
    per tick.
    """
    weights = _pipeline_branch_weights(pipeline) if pipeline else None
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
    hlo = compiled.as_text()
    traffic = traffic_from_hlo(hlo, dict(mesh.shape), weights) if mesh is not None else []
    return Report(title, mem, collectives_from_hlo(hlo), flops, traffic=traffic,
                  matmul_flops=matmul_flops_from_hlo(hlo), data_axes=tuple(data_axes),
                  pipe_axis=(pipeline or {}).get("axis"))


def _pipeline_branch_weights(note: dict) -> dict[int, list[float]] | None:
    """1F1B's ``lax.switch(op, [idle, fwd, bwd, fwd_last, bwd_last])``: the fraction of
    (tick, stage) cells of the schedule table with each op."""
    if note.get("schedule") != "1f1b":
        return None
    from . import _pipeline_schedules as sched

    op = sched.one_f_one_b_table(note["stages"], note["microbatches"]).op
    return {5: [float(np.mean(op == k)) for k in range(5)]}


def explain_step(step, state, batch) -> Report:
    """The report behind ``TrainStep.explain``: compiled figures, and the analytic estimate
    of ``sk.cost.estimate_for_step`` beside them."""
    compiled = step.lower(state, batch).compile()
    plan = step.plan
    grad_specs = step._specs("grads")
    grads = jax.tree.map(
        lambda p, s: jax.ShapeDtypeStruct(p.shape, plan.precision.grads, sharding=plan.sharding(s)),
        state.params, grad_specs)
    placed, _ = step._place_batch(batch)
    # Parameter and optimizer-state bytes as the compiled executable lays out its arguments.
    (state_sh, batch_sh), _ = compiled.input_shardings
    as_compiled = lambda tree, sh: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
    memory = {"params": shard_bytes(as_compiled(state.params, state_sh.params)),
              "opt_state": shard_bytes(as_compiled(state.opt_state, state_sh.opt_state)),
              "model_state": shard_bytes(state.model_state), "grads": shard_bytes(grads),
              "batch": shard_bytes(as_compiled(placed, batch_sh))}
    title = f"{plan!r}, microbatches={step.microbatches}"
    report = report_from_compiled(compiled, title, memory, plan.mesh, plan.batch_axes,
                                  pipeline=step.trace_notes.get("pipeline"))
    from . import cost

    report.estimate = cost.estimate_for_step(step, state, batch).as_dict()
    return report
