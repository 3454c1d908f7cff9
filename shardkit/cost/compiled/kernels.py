"""The kernels a compiled program launches, each with its flops and the bytes it moves through
device memory: what the step-time model's roofline (``analytic.steptime.roofline_excess``) times.

XLA:GPU's deviceless executables carry no ``cost_analysis``, so this reads the program text.
A kernel is an instruction of a computation the device steps through (the entry, a ``while``
body or condition, a ``conditional``'s branch, a ``call``'s callee): a fusion, a cuDNN or
cuBLAS custom call, a copy, a sort, ... — not a parameter, tuple plumbing, a bitcast or a
collective (the collectives have their own link model). Its bytes are its operands' sizes
read once each plus its result's size written once: a fusion reads its inputs and writes its
outputs through HBM and keeps everything between on chip, which is what makes a BatchNorm's
statistics, its normalisation and a ReLU each a pass over the activations (Williams et al.
2009, "Roofline"; Ivanov et al. 2021, "Data Movement Is All You Need"). Two access patterns
touch less than the buffers they name, and are read as such: a fusion operand that is only
sliced inside it (a layer scan's one layer of its stacked weights, ``dynamic-slice``) reads
the slices; a result written by ``dynamic-update-slice`` into an operand (the scan's stacked
output or gradient, updated in place) writes the update and does not read the buffer.
Counted through loop trip counts as ``hlo`` counts collectives.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from .hlo.collectives import COLLECTIVES
from .hlo.matmuls import defined_types, line_matmul_flops, operand_words
from .hlo.text import _INSTR, _SHAPE, _split_tuple, _walk, shape_bytes

# Instructions that launch nothing (plumbing, control flow whose bodies are walked) or whose
# time the collective model owns.
_NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
                "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
                "domain", "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
                "async-start", "async-update", "async-done"}
_COLLECTIVE_OPS = {k + s for k in COLLECTIVES for s in ("", "-start", "-done")}
# Callees a kernel-level computation steps through (a fusion's or a reducer's body is not one).
_STEPPED = re.compile(r"\b(?:body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_TO_APPLY = re.compile(r"\bto_apply=%?([\w.\-]+)")
_BRANCH_LIST = re.compile(r"branch_computations=\{([^}]*)\}")
_SLICES = {"dynamic-slice", "slice", "gather"}
_SCRATCH = ("u8", "s8")  # a custom call's workspace, the last element of its result tuple


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program, per device.

    Attributes:
        name: the instruction's name (``loop_add_fusion.3``, ``cudnn-conv.12``).
        op: its opcode (``fusion``, ``custom-call``, ``copy``, ...).
        flops: the matmul / convolution flops of one execution (``hlo.line_matmul_flops``; 0
            for a memory-bound kernel).
        bytes: device-memory bytes one execution reads and writes (the module docstring).
        count: executions per step (through loop trip counts).
    """

    name: str
    op: str
    flops: float
    bytes: float
    count: float


def kernels_from_hlo(hlo: str, branch_weights: dict | None = None) -> list[Kernel]:
    """Every kernel of a compiled program (``compiled.as_text()``), with its flops, bytes and
    executions per step (see the module docstring); ``branch_weights`` as ``hlo._walk``."""
    comps, mult = _walk(hlo, branch_weights)
    stepped = _stepped(comps)
    out = []
    for name in stepped:
        m = mult.get(name, 0)
        if not m:
            continue
        lines = comps[name]
        shapes = defined_types(lines)
        for line in lines:
            ins = _INSTR.match(line)
            if ins is None:
                continue
            op = ins.group(2)
            if op in _NOT_KERNELS or op in _COLLECTIVE_OPS:
                continue
            kernel = _kernel(line, ins, op, shapes, comps)
            if kernel is not None:
                out.append(dataclasses.replace(kernel, count=float(m)))
    return out


def _stepped(comps: dict[str, list[str]]) -> list[str]:
    """The computations whose instructions are kernels: every one some ``while``,
    ``conditional`` or ``call`` steps through, and the entry (the one nothing calls)."""
    called, stepped = set(), set()
    for lines in comps.values():
        for line in lines:
            for pattern in (_CALLS, _TO_APPLY):
                called.update(pattern.findall(line))
            stepped.update(_STEPPED.findall(line))
            ins = _INSTR.match(line)
            if ins is not None and ins.group(2) == "call":
                stepped.update(_TO_APPLY.findall(line))
            for group in _BRANCH_LIST.findall(line):
                stepped.update(c.strip().lstrip("%") for c in group.split(",") if c.strip())
    called |= stepped
    return [n for n in comps if n in stepped or n not in called]


def _operands(ins) -> list[str]:
    """The operand names of an instruction (``_INSTR`` match), in order."""
    return [words[-1].lstrip("%") for words in operand_words(ins)]


def _result_bytes(result: str, op: str) -> float:
    if op == "custom-call" and result.startswith("("):
        parts = _split_tuple(result)
        if len(parts) > 1 and _SHAPE.search(parts[-1]) and _SHAPE.search(parts[-1]).group(1) in _SCRATCH:
            parts = parts[:-1]
        return float(sum(shape_bytes(p) for p in parts))
    return float(shape_bytes(result))


def _kernel(line: str, ins, op: str, shapes: dict, comps: dict) -> Kernel | None:
    result, operands = ins.group(1), _operands(ins)
    name = _name(line)
    sizes = {u: float(shape_bytes(shapes.get(u, ""))) for u in operands}
    written = _result_bytes(result, op)
    if op in _SLICES:  # reads what it takes
        return Kernel(name, op, 0.0, 2 * written, 1.0)
    if op == "dynamic-update-slice":  # in place: reads and writes the update
        update = sizes.get(operands[1], 0.0) if len(operands) > 1 else written
        return Kernel(name, op, 0.0, 2 * update, 1.0)
    flops = line_matmul_flops(line, shapes)
    if op != "fusion":
        return Kernel(name, op, flops, sum(sizes.values()) + written, 1.0)
    callee = _CALLS.search(line)
    body = comps.get(callee.group(1), []) if callee else []
    if any((b := _INSTR.match(x)) is not None and b.group(2) in _COLLECTIVE_OPS for x in body):
        return None  # XLA:TPU's reduce-scatter is a fusion around an all-reduce: a collective
    reads, written = _fusion_bytes(body, operands, sizes, written)
    body_shapes = defined_types(body)
    flops = sum(line_matmul_flops(b, body_shapes) for b in body)
    return Kernel(name, op, flops, reads + written, 1.0)


def _fusion_bytes(body: list[str], operands: list[str], sizes: dict, written: float) -> tuple[float, float]:
    """(bytes read, bytes written) of a fusion whose fused computation is ``body``: each
    distinct operand once, or only the slices taken of an operand the body only slices; an
    operand a ``dynamic-update-slice`` writes into is not read, and that output writes the
    update only (through bitcasts, which view a value in another shape)."""
    types = defined_types(body)
    instrs: dict[str, tuple[str, list[str]]] = {}  # local name -> (op, operands)
    params: dict[int, str] = {}
    users: dict[str, list[tuple[str, list[str], str]]] = defaultdict(list)
    roots: list[str] = []
    for line in body:
        ins = _INSTR.match(line)
        if ins is None:
            continue
        local = _name(line)
        op, ops = ins.group(2), _operands(ins)
        instrs[local] = (op, ops)
        if op == "parameter":
            params[int(ops[0])] = local
        for u in ops:
            users[u].append((op, ops, local))
        if line.lstrip().startswith("ROOT"):
            roots = ops if op == "tuple" else [local]
    # A bitcast is the value it views: its uses are its operand's.
    base = {}
    for local, (op, ops) in instrs.items():
        if op == "bitcast" and ops:
            base[local] = ops[0]

    def root_of(v: str) -> str:
        while v in base:
            v = base[v]
        return v

    def uses_of(v: str) -> list:
        out = []
        for use in users.get(v, []):
            out.extend(uses_of(use[2]) if use[0] == "bitcast" else [(use[0], [root_of(u) for u in use[1]], use[2])])
        return out

    in_place: set[str] = set()
    for root in roots:
        op, ops = instrs.get(root_of(root), ("", []))
        if op == "dynamic-update-slice" and len(ops) > 1:
            in_place.add(root_of(ops[0]))
            written += shape_bytes(types.get(ops[1], "")) - shape_bytes(types.get(root, ""))
    reads, seen = 0.0, set()
    for k, outer in enumerate(operands):
        local = params.get(k)
        if local is None or outer in seen:
            continue
        seen.add(outer)
        uses = uses_of(local)
        if local in in_place and all(op == "dynamic-update-slice" and ops[0] == local for op, ops, _ in uses):
            continue
        if uses and all(op in _SLICES and ops[0] == local for op, ops, _ in uses):
            reads += sum(float(shape_bytes(types.get(res, ""))) for _, _, res in uses)
        else:
            reads += sizes.get(outer, 0.0)
    return reads, max(written, 0.0)


def _name(line: str) -> str:
    """The name an instruction line defines."""
    return line.split("=", 1)[0].strip().removeprefix("ROOT").strip().lstrip("%")
