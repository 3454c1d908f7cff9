"""The collectives a compiled program executes, read off its HLO text: how many of each kind
and their bytes, counted through loops (``Collective``), and the mesh axes their device groups
span (``Traffic``; for a ``collective-permute``, the collectives whose results it moves:
``permutes``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

from . import permutes
from .text import _INSTR, _NAMED, _OP_NAME, _SHAPE, HloParseError, _ints, _split_tuple, _walk, shape_bytes

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")


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
            b = shape_bytes(result)
            if base == "ragged-all-to-all":
                b = _ragged_routed_bytes(op, result, ins.group(3), lines)
            elif op.endswith("-start") and result.startswith("("):
                # async start ops return (operands..., results..., contexts): count the results.
                # An all-gather's result is its largest member, a reduce-scatter's its smallest
                # (XLA:GPU: ((f32[1024,1024]), f32[128,1024]) — the operand comes first); the
                # others' results are their operands' size.
                shapes = [shape_bytes(s) for s in _split_tuple(result) if "[]" not in s]  # no scalar contexts
                b = (max(shapes) if base == "all-gather" else min(shapes) if base == "reduce-scatter"
                     else shapes[0]) if shapes else 0
            if scatter and base == "all-reduce":
                root = next((r for r in map(_INSTR.match, lines) if r and r.group(0).lstrip().startswith("ROOT")), None)
                base, b = "reduce-scatter", shape_bytes(root.group(1)) if root else b
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
        rows = shape_bytes(rows.group(0)) if rows else 0
        return min(rows, shape_bytes(out))
    first = _split_tuple(f"({operands}")[0]  # XLA:TPU's sync form names its operands
    if _SHAPE.search(first) is None:
        name = first.strip().lstrip("%")
        first = next((d.group(2) for d in map(_NAMED.match, lines) if d and d.group(1) == name), "")
    rows = shape_bytes(first)
    return min(rows, shape_bytes(result)) if rows else shape_bytes(result)


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


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


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
