"""Reading post-partitioning HLO text: the collectives a compiled program executes (counted
through ``while`` loop trip counts, optionally weighting ``conditional`` branches), the mesh
axes their device groups span, and the matmul flops. ``explain.Report`` is built on these.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from ...pipeline import schedules as sched
from ..flash_flops import flash_call_flops, flash_kernel
from . import permutes

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


_COND = re.compile(r"\bcondition=%?([\w.\-]+)")
_CONST = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((-?\d+)\)")
_LT = re.compile(r"compare\(%?[\w.\-]+,\s*%?([\w.\-]+)\),\s*direction=LT")


def _trip_from_condition(lines: list[str]) -> int | None:
    """A ``while`` loop's trip count from its condition, where the compiler wrote no
    ``known_trip_count`` (XLA:TPU does not): the loop of a scan or fori_loop runs while its
    counter, from 0 by 1, is below a constant (``compare(i, N), direction=LT``). None for any
    other condition (the body then counts once, as before)."""
    consts = {m.group(1): int(m.group(2)) for m in map(_CONST.match, lines) if m}
    for line in lines:
        m = _LT.search(line)
        if m and m.group(1) in consts:
            return consts[m.group(1)]
    return None


def computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """HLO text split into its computations (name -> instruction lines) and the entry
    computation's name (None where the text has none)."""
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
    return comps, entry


def callees(line: str) -> list[tuple[str, str]]:
    """The computations an instruction calls, as ``(role, name)``: ``body``, ``condition``,
    ``calls``, ``to_apply``, ``true_computation``/``false_computation``, and for a
    ``conditional`` with ``branch_computations`` each branch as ``branch<i>``."""
    found = _CALLEE.findall(line)
    for group in _BRANCHES.findall(line):
        branches = [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        found.extend((f"branch{i}", b) for i, b in enumerate(branches))
    return found


def _walk(hlo: str, branch_weights: dict[int, list[float]] | None = None
          ) -> tuple[dict[str, list[str]], dict[str, float]]:
    """Splits HLO text into computations and counts how often each runs per step: an entry
    computation once, a ``while`` body ``known_trip_count`` times its caller (or, without one,
    the bound of its ``i < N`` condition), others as called.

    A conditional runs one branch per call, which the text cannot tell; each branch counts
    once per call (an upper bound) unless ``branch_weights[marker]`` gives, for conditionals
    whose line contains ``marker`` (a named scope, which HLO keeps in the op's metadata), the
    fraction of calls that take each branch (e.g. from a pipeline's schedule table)."""
    comps, entry = computations(hlo)
    mult: dict[str, float] = defaultdict(float)
    if entry is None:
        return comps, mult
    calls: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for name, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            n = int(trip.group(1)) if trip else None
            if n is None and (cond := _COND.search(line)) is not None:
                n = _trip_from_condition(comps.get(cond.group(1), []))
            found = callees(line)
            branches = [c for role, c in found if role.startswith("branch")]
            w = next((ws for marker, ws in (branch_weights or {}).items()
                      if marker in line and len(ws) == len(branches)), [1.0] * len(branches))
            for role, callee in found:
                k = n if (role == "body" and n is not None) else 1
                calls[name].append((callee, w[int(role[6:])] if role.startswith("branch") else k))

    def visit(name: str, m: int, depth: int = 0):
        if depth > 64 or name not in comps:
            return
        mult[name] += m
        for callee, k in calls.get(name, ()):
            visit(callee, m * k, depth + 1)

    visit(entry, 1)
    return comps, mult


def op_name(line: str) -> str:
    """An instruction's ``op_name`` metadata (the JAX op and named scopes it came from), or ""."""
    m = _OP_NAME.search(line)
    return m.group(1) if m else ""


def collective_kind(line: str) -> str | None:
    """The collective an instruction starts or runs (``all-reduce`` for ``all-reduce-start``),
    None for any other instruction (a ``-done`` included: its start was counted)."""
    ins = _INSTR.match(line)
    if not ins:
        return None
    op = ins.group(2)
    base = op[:-6] if op.endswith("-start") else op
    return base if base in COLLECTIVES and not op.endswith("-done") else None


def _collective_ops(hlo: str, branch_weights=None, walked=None):
    """Yields ``(kind, multiplicity, result_bytes, line)`` for every collective op (``walked``:
    ``_walk``'s result, where the caller has it)."""
    comps, mult = walked or _walk(hlo, branch_weights)
    for name, lines in comps.items():
        m = mult.get(name, 0)
        # XLA:TPU writes a reduce-scatter as a fusion of this name around an all-reduce and
        # the dynamic-slice of this device's shard (its root): one reduce-scatter on the wire.
        scatter = name.startswith("all-reduce-scatter")
        for line in lines:
            ins = _INSTR.match(line)
            if not ins:
                continue
            result, op = ins.group(1), ins.group(2)
            base = collective_kind(line)
            if base is None:
                continue
            b = _shape_bytes(result)
            if base == "ragged-all-to-all":
                b = _ragged_routed_bytes(op, result, ins.group(3), lines)
            elif op.endswith("-start") and result.startswith("("):
                # async start ops return (operands..., results..., contexts): count the results.
                # An all-gather's result is its largest member, a reduce-scatter's its smallest
                # (XLA:GPU: ((f32[1024,1024]), f32[128,1024]) — the operand comes first); the
                # others' results are their operands' size.
                shapes = [_shape_bytes(s) for s in _split_tuple(result) if "[]" not in s]  # no scalar contexts
                b = (max(shapes) if base == "all-gather" else min(shapes) if base == "reduce-scatter"
                     else shapes[0]) if shapes else 0
            if scatter and base == "all-reduce":
                root = next((r for r in map(_INSTR.match, lines) if r and r.group(0).lstrip().startswith("ROOT")), None)
                base, b = "reduce-scatter", _shape_bytes(root.group(1)) if root else b
            yield base, m, b, line


def _ragged_routed_bytes(op: str, result: str, operands: str, lines: list[str]) -> int:
    """A ragged-all-to-all's bytes: the routed side, the smaller of its rows operand and its
    result (the sorted assignments sent out, or brought back home), not the static receive
    buffer on the other side, nor (XLA:GPU's async form, ``((rows, output, 4 offset arrays),
    result)``) the whole operand tuple. How many of those rows carry a token is data-dependent:
    this is the static bound, the figure ``sk.moe``'s estimate counts too."""
    if op.endswith("-start") and result.startswith("("):
        parts = _split_tuple(result)
        rows, out = _SHAPE.search(parts[0]), parts[1]
        rows = _shape_bytes(rows.group(0)) if rows else 0
        return min(rows, _shape_bytes(out))
    first = _split_tuple(f"({operands}")[0]  # XLA:TPU's sync form names its operands
    if _SHAPE.search(first) is None:
        name = first.strip().lstrip("%")
        first = next((d.group(2) for d in map(_NAMED.match, lines) if d and d.group(1) == name), "")
    rows = _shape_bytes(first)
    return min(rows, _shape_bytes(result)) if rows else _shape_bytes(result)


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
_CONV = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+convolution\(\s*%?([\w.\-]+)\S*,\s*%?([\w.\-]+)")
# XLA:GPU lowers convolutions to cuDNN custom calls: forward (x, w) -> y, backward input
# (dy, w) -> dx, backward filter (x, dy) -> dw, each with the forward convolution's dim_labels.
_CUDNN = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\(?(\S+?\])\S*\s"
                    r".*?custom-call\(\s*%?([\w.\-]+)\S*,\s*%?([\w.\-]+)"
                    r".*custom_call_target=\"__cudnn\$conv(\w+)\"")
# XLA:TPU's lax.ragged_dot (forward and input gradient): a Mosaic grouped matmul it names
# ragged-dot-*, whose flops it writes in its backend config (the rows it is handed times one
# group's weights; ragged-dot-metadata is the group bookkeeping).
_TPU_RAGGED_DOT = re.compile(r'^\s*(?:ROOT\s+)?%ragged-dot-(?!metadata)[\w.\-]*\s*=.*custom_call_target="tpu_custom_call"'
                             r'.*"cost_estimate":\{"flops":"(\d+)"')
# sk.attention's Pallas flash kernels: custom calls no compiler counts flops for (Triton's on
# GPU, Mosaic's on TPU), told apart from other kernels by the named scope in their metadata.
_KERNEL_CALL = re.compile(r'custom_call_target="(?:__gpu\$xla\.gpu\.triton|tpu_custom_call)"')
_OP_NAME = re.compile(r'metadata=\{op_name="([^"]*)"')
_WINDOW = re.compile(r"window=\{size=([0-9x]+)")
_LHS_DILATE = re.compile(r"window=\{[^}]*lhs_dilate=([0-9x]+)")
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text or "")]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


class HloParseError(ValueError):
    """A compiled program holds a collective whose device groups this reader cannot parse."""


def _device_groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups a collective runs over, from any of HLO's spellings (mesh, iota,
    source-target pairs, explicit lists; ``replica_groups={}`` means all devices, as HLO
    defines it).

    Raises:
        HloParseError: none of them matches: guessing "all devices" would misattribute the
            collective's traffic to the wrong mesh axes.
    """
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
    if not re.search(r"replica_groups=|source_target_pairs=", line):
        return [list(range(n_devices))]  # no groups attribute: HLO's default, all devices
    raise HloParseError(f"cannot read the device groups of this collective: {line.strip()[:300]}\n"
                        "Please report it with your jax version; explain() will not guess.")


def _axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the members of a device group differ (ids are mesh positions)."""
    names, dims = list(mesh_shape), tuple(mesh_shape.values())
    coords = np.array(np.unravel_index(np.asarray(groups[0]), dims)).T if dims else np.zeros((1, 0))
    return tuple(n for i, n in enumerate(names) if len(set(coords[:, i].tolist())) > 1)


def _pairs_axes(pairs: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes a permute's source-target pairs cross, over all its pairs: its first pair
    may be a device keeping its own block (``{0,0}``), which crosses none."""
    crossed = set()
    for pair in pairs:
        crossed.update(_axes_of([pair], mesh_shape))
    return tuple(n for n in mesh_shape if n in crossed)


def participant_axes(kind: str, line: str, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes over which the devices that meet in one execution of the collective
    ``kind`` on ``line`` differ: any of its replica groups', and for a collective-permute
    every device its pairs name (one op for all of them: XLA:CPU's rendezvous waits for every
    device the pairs name, its own-block pairs included), not only the axes a pair crosses
    (``Traffic.axes``).

    Raises:
        HloParseError: its device groups cannot be read (``_device_groups``).
    """
    groups = _device_groups(line, math.prod(mesh_shape.values()) if mesh_shape else 1)
    if kind == "collective-permute":
        groups = [sorted({d for pair in groups for d in pair})]
    spanned = {a for g in groups for a in (_axes_of([g], mesh_shape) if mesh_shape and g else ())}
    return tuple(a for a in mesh_shape if a in spanned)


def _is_shift(pairs: list[list[int]], mesh_shape: dict[str, int]) -> bool:
    """Whether every pair of a permute moves a block one step along one mesh axis (a ring's
    shift, ``sk.pipeline``'s stage-to-stage send), rather than reordering blocks (some
    devices keeping theirs, others swapping with non-neighbours)."""
    sizes = list(mesh_shape.values())
    for pair in pairs:
        if len(pair) != 2 or pair[0] == pair[1]:
            return False
        src, dst = np.unravel_index(pair[0], sizes), np.unravel_index(pair[1], sizes)
        moved = [(int(a), int(b), n) for a, b, n in zip(src, dst, sizes) if a != b]
        if len(moved) != 1 or (moved[0][1] - moved[0][0]) % moved[0][2] not in (1, moved[0][2] - 1):
            return False
    return True


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
        after: for a collective-permute that moves the results of other collectives (traced
            through data movement: ``permutes``), their kind (``all-reduce``,
            ``reduce-scatter``, ``all-gather``; ``+``-joined if several); else ``""``.
        after_axes: the mesh axes those collectives span (``()`` when ``after`` is empty).
        shift: for a collective-permute, whether each pair moves one step along one axis
            (``_is_shift``); False for other kinds.
    """

    kind: str
    axes: tuple[str, ...]
    group: int
    count: int
    bytes: int
    operand_bytes: int
    after: str = ""
    after_axes: tuple[str, ...] = ()
    shift: bool = False


def traffic_from_hlo(hlo: str, mesh_shape: dict[str, int], branch_weights=None) -> list[Traffic]:
    """Executed collectives per (kind, mesh axes, and for a permute the collectives whose
    results it moves), through loops (see ``Traffic``)."""
    n = math.prod(mesh_shape.values()) if mesh_shape else 1
    walked = _walk(hlo, branch_weights)
    defs = None
    acc: dict[tuple, list[float]] = {}
    for kind, m, b, line in _collective_ops(hlo, branch_weights, walked):
        groups = _device_groups(line, n)
        size = max(len(groups[0]), 1) if kind != "collective-permute" else 2
        after, after_axes, shift = "", (), False
        if kind == "collective-permute":
            axes = _pairs_axes(groups, mesh_shape) if mesh_shape else ()
            shift = bool(mesh_shape) and _is_shift(groups, mesh_shape)
            defs = permutes.definitions(walked[0]) if defs is None else defs
            if sources := permutes.moved_from(line, defs, walked[0]):
                after = "+".join(sorted({k for k, _ in sources}))
                crossed = {a for _, src in sources for a in (_axes_of(_device_groups(src, n), mesh_shape)
                                                              if mesh_shape else ())}
                after_axes = tuple(a for a in mesh_shape if a in crossed)
        else:
            axes = _axes_of(groups, mesh_shape) if mesh_shape else ()
        operand = b // size if kind == "all-gather" else b * size if kind == "reduce-scatter" else b
        row = acc.setdefault((kind, axes, size, after, after_axes, shift), [0, 0, 0])
        row[0] += m; row[1] += m * b; row[2] += m * operand
    return [Traffic(k, a, s, round(c), round(b), round(o), af, aa, sh)
            for (k, a, s, af, aa, sh), (c, b, o) in acc.items()]


def matmul_flops_from_hlo(hlo: str, branch_weights: dict[int, list[float]] | None = None,
                          fp8_only: bool = False) -> float:
    """Flops of every ``dot`` (2 × result elements × contracted size), ``convolution`` (2 ×
    result elements × window × input features per group), XLA:TPU ``ragged-dot`` grouped
    matmul (the flops its kernel's cost estimate states) and ``sk.attention`` flash kernel call
    (``_flash_flops``: the program reader's formula), counted through loop trip counts — XLA's
    ``cost_analysis`` counts a ``while`` body once and no custom call. ``branch_weights``
    weights ``conditional`` branches as in ``_walk`` (a pipeline's schedule table: a 1F1B tick
    runs one of its switch's branches, not all of them). ``fp8_only``: only the ops (dots,
    convolutions, cuDNN convolutions alike) whose operands are all fp8 (``f8e4m3fn``,
    ``f8e5m2``, ...: ``sk.fp8``'s GEMMs); XLA:TPU writes a bf16 dot as a ``convolution``, which
    is no fp8 GEMM."""
    comps, mult = _walk(hlo, branch_weights)
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
            if (g := _TPU_RAGGED_DOT.match(line)) is not None:
                total += 0.0 if fp8_only else m * float(g.group(1))
                continue
            if (flash := _flash_flops(line, shapes)) is not None:
                total += 0.0 if fp8_only else m * flash
                continue
            cv = _CONV.match(line)
            cd = _CUDNN.match(line) if cv is None and "__cudnn$conv" in line else None
            d = _DOT.match(line) if cv is None and cd is None else None
            if (cv or cd or d) is None or (fp8_only and not _fp8_operands(line, shapes)):
                continue
            if cv is not None:
                total += m * _conv_flops(line, cv, shapes)
                continue
            if cd is not None:
                total += m * _cudnn_conv_flops(line, cd, shapes)
                continue
            lhs = d.group(2) or shapes.get(d.group(3), "")
            lhs_dims = _ints(lhs.split("[", 1)[1].split("]", 1)[0]) if "[" in lhs else []
            res = _ints(d.group(1).split("[", 1)[1].split("]", 1)[0]) if "[" in d.group(1) else []
            c = _LHS_C.search(line)
            k = math.prod(lhs_dims[i] for i in _ints(c.group(1)) if i < len(lhs_dims)) if c else 1
            total += m * 2.0 * math.prod(res) * k
    return total


def _flash_flops(line: str, shapes: dict) -> float | None:
    """The flops of an ``sk.attention`` flash kernel call (``cost.flash_flops``, the program
    reader's formula, on the custom call's operand and result shapes), or None where ``line``
    is no kernel call inside a flash scope.

    Raises:
        HloParseError: an operand's shape cannot be read (a figure without it would be wrong).
    """
    if "custom-call(" not in line or not _KERNEL_CALL.search(line):
        return None
    op_name = _OP_NAME.search(line)
    found = flash_kernel(op_name.group(1)) if op_name else None
    if found is None:
        return None
    array = lambda t: (_ints(t.group(2)), t.group(1) in _FLOAT or bool(_FP8.match(t.group(1))))  # noqa: E731
    operands = [_SHAPE.search(t) for t in _operand_types(line, shapes)]
    if len(operands) < 2 or None in operands:
        raise HloParseError(f"cannot read the operand shapes of this flash kernel call: {line.strip()[:300]}")
    return flash_call_flops(*found, [array(t) for t in operands],
                            [array(t) for t in _SHAPE.finditer(_INSTR.match(line).group(1))])


_FLOAT = ("bf16", "f16", "f32", "f64")


# A floating-point array multiply (not the scalar index arithmetic of a dot's loop) named
# after a dot_general.
_REWRITTEN = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:bf16|f16|f32|f64|f8\w+)\[\d[\d,]*\]\S*\s+"
                        r"multiply\(.*op_name=\"([^\"]*dot_general)\"(?:.*stack_frame_id=(\d+))?")


def rewritten_matmuls(hlo: str) -> int:
    """How many ops of the program are matmuls XLA rewrote as an elementwise ``multiply`` (then
    a ``reduce``) — its algebraic simplifier does so for a matrix-vector or outer product —
    told apart by the ``dot_general`` they came from (op name and source frame in the
    metadata). Their flops are not in ``matmul_flops_from_hlo``: no ``dot`` is left to read.
    (A ``reduce`` alone named after a dot is XLA:GPU's split-K sum of a dot that stays one.)"""
    comps, mult = _walk(hlo)
    seen = set()
    for name, lines in comps.items():
        if mult.get(name):
            seen.update(m.groups() for m in map(_REWRITTEN.search, lines) if m is not None)
    return len(seen)


_FP8 = re.compile(r"^f8e\d")
_COMMENT = re.compile(r"/\*.*?\*/")  # HLO numbers long operand lists: /*index=5*/


def _operand_types(line: str, shapes: dict) -> list[str]:
    """The types of an instruction's operands, in order: the one written before an operand's
    name, or else the one its defining instruction gave it ("" where neither is known)."""
    ins = _INSTR.match(line)
    if ins is None:
        return []
    text, depth, end = ins.group(3), 1, 0
    for end, ch in enumerate(text):  # the operand list ends at the op's closing parenthesis
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            break
    types = []
    for operand in _split_tuple(f"({_COMMENT.sub('', text[:end])})"):
        words = operand.split()
        if not words:
            continue
        types.append(words[0] if len(words) > 1 else shapes.get(words[-1].lstrip("%"), ""))
    return types


def _fp8_operands(line: str, shapes: dict) -> bool:
    """Whether every operand of an instruction is fp8."""
    types = [t.lstrip("(").split("[", 1)[0] for t in _operand_types(line, shapes)]
    return bool(types) and all(_FP8.match(t) for t in types)


def _conv_flops(line: str, cv, shapes: dict) -> float:
    """2 × result elements × window elements × the kernel's input-feature dimension (the
    ``i`` of its dim labels: input features per group, or the batch for a weight gradient)."""
    res = _ints(cv.group(1).split("[", 1)[1].split("]", 1)[0]) if "[" in cv.group(1) else []
    rhs = shapes.get(cv.group(3), "")
    rhs_dims = _ints(rhs.split("[", 1)[1].split("]", 1)[0]) if "[" in rhs else []
    window, labels = _WINDOW.search(line), _DIM_LABELS.search(line)
    if not res or not rhs_dims or labels is None or "i" not in labels.group(1):
        raise HloParseError(f"cannot read this convolution's shapes: {line.strip()[:300]}")
    size = math.prod(_ints(window.group(1).replace("x", ","))) if window else 1
    # A strided convolution's input gradient dilates its operand by the stride: the inserted
    # zeros are not work (as ``program``'s count and cuDNN's).
    dilate = _LHS_DILATE.search(line)
    size /= math.prod(_ints(dilate.group(1).replace("x", ","))) if dilate else 1
    return 2.0 * math.prod(res) * size * rhs_dims[labels.group(1).index("i")]


def _cudnn_conv_flops(line: str, cd, shapes: dict) -> float:
    """A cuDNN convolution's flops: 2 × the forward output's elements × window × the kernel's
    input features, whichever of the three passes it is (the forward output is the result of
    the forward, the first operand of the input gradient, the second of the filter gradient;
    the kernel the second operand, or the filter gradient's result)."""
    dims = lambda t: _ints(t.split("[", 1)[1].split("]", 1)[0]) if "[" in t else []  # noqa: E731
    res, a, b, kind = cd.group(1), shapes.get(cd.group(2), ""), shapes.get(cd.group(3), ""), cd.group(4)
    y, kernel = {"BackwardInput": (a, b), "BackwardFilter": (b, res)}.get(kind, (res, b))
    window, labels = _WINDOW.search(line), _DIM_LABELS.search(line)
    if not dims(y) or not dims(kernel) or labels is None or "i" not in labels.group(1):
        raise HloParseError(f"cannot read this cuDNN convolution's shapes: {line.strip()[:300]}")
    size = math.prod(_ints(window.group(1).replace("x", ","))) if window else 1
    return 2.0 * math.prod(dims(y)) * size * dims(kernel)[labels.group(1).index("i")]


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



def pipeline_branch_weights(note: dict) -> dict[int, list[float]] | None:
    """The explicit pipeline executor's per-tick ``lax.switch`` (1F1B, interleaved 1F1B,
    ZB-H1): the fraction of (tick, stage) cells of the schedule table taking each branch, for
    the conditional inside ``sched.EXPLICIT_SCOPE`` only."""
    if note.get("schedule") not in sched.EXPLICIT:
        return None
    tab = sched.pipeline_schedule(note["schedule"], note["stages"], note["microbatches"],
                                  note.get("repeats", 1))
    pairs, index = sched.switch_branches(tab)
    return {sched.EXPLICIT_SCOPE: [float(np.mean(index == k)) for k in range(len(pairs))]}
