"""HLO text as computations: each computation's instruction lines and how often it runs per
step (a ``while`` body through its trip count, a ``conditional``'s branches by their weights),
the bytes of a shape, and the small parsers the collective and matmul readers share.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from ...._branches import EVEN_SCOPE, STAGE_SCOPE

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "bf16": 2, "f16": 2, "s16": 2,
                "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8,
                "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_OP_NAME = re.compile(r'metadata=\{op_name="([^"]*)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PRED_ARMS = ("true_computation", "false_computation")  # a two-way conditional on a pred
_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s")


def innermost_scope(line: str, markers) -> str | None:
    """Of the named scopes ``markers``, the one that appears last in ``line`` (an op's
    ``op_name`` lists its scopes outermost first), or None."""
    found = [(line.rfind(m), m) for m in markers if m in line]
    return max(found)[1] if found else None


class HloParseError(ValueError):
    """A compiled program holds a collective whose device groups this reader cannot parse."""


def shape_bytes(text: str) -> int:
    """Bytes of every array shape written in ``text`` (a result type, a tuple of them)."""
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
    fraction of calls that take each branch (e.g. from a pipeline's schedule table). A
    building block's switch whose branches run equally often, or one branch per stage
    (``_branches.EVEN_SCOPE``, ``STAGE_SCOPE``), weights each of its ``n`` branches ``1/n``.
    The innermost marker of a line decides (a switch inside a pipeline's branch is its own)."""
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
            arms = [role for role, _ in found if role.startswith("branch") or role in _PRED_ARMS]
            w = {}
            if arms:
                marker = innermost_scope(line, (EVEN_SCOPE, STAGE_SCOPE, *(branch_weights or {})))
                if marker in (EVEN_SCOPE, STAGE_SCOPE):
                    w = dict.fromkeys(arms, 1.0 / len(arms))
                elif len(ws := (branch_weights or {}).get(marker, ())) == len(arms):
                    w = {f"branch{i}": x for i, x in enumerate(ws)}
            for role, callee in found:
                calls[name].append((callee, n if (role == "body" and n is not None) else w.get(role, 1)))

    def visit(name: str, m: int, depth: int = 0):
        if depth > 64 or name not in comps:
            return
        mult[name] += m
        for callee, k in calls.get(name, ()):
            visit(callee, m * k, depth + 1)

    visit(entry, 1)
    return comps, mult


def _ints(text: str | None) -> list[int]:
    return [int(t) for t in re.findall(r"\d+", text or "")]


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
