"""Which collective's result a ``collective-permute`` moves, read off the compiled program.

XLA sometimes reduces a gradient in another layout than the one ZeRO keeps it in: an
embedding's scatter-add or an output head's weight gradient computed split over ``tensor``
(each device sums its block over the data axes with an all-reduce), then a permute carries each
reduced block to the device whose ZeRO shard it is (``source_target_pairs`` crossing the data
and tensor axes). That permute is part of the gradient reduction, not a relayout of
activations: ``hlo.traffic_from_hlo`` records, for each permute, the collectives whose results
it moves (``Traffic.after``), and the report counts it with the reduction
(``Report.roles``). A pipeline's microbatch sends and a context ring's K/V blocks move computed
values (activations, partial attention sums), which trace to no collective: their roles stay.

The trace walks a permute's operands back through data movement only — bitcasts, copies,
slices, get-tuple-element, async done/start pairs, and fusions whose float-typed instructions
are all movement (XLA:GPU's ``wrapped_slice``, a ``dynamic-slice`` of this device's block at
an index computed from ``partition-id``) — and stops at the first collective; a float value
computed on the way (an add, a dot) ends the trace with no source.
"""

from __future__ import annotations

import re

# Ops that carry values without computing new floats.
_MOVES = frozenset({"parameter", "constant", "bitcast", "copy", "copy-start", "copy-done", "reshape", "transpose",
                    "slice", "dynamic-slice", "concatenate", "get-tuple-element", "tuple", "convert",
                    "broadcast", "partition-id", "replica-id"})
_REDUCING = ("all-reduce", "reduce-scatter", "all-gather")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z\-]+)\((.*)$")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_INDEX_TYPE = re.compile(r"^\(?(?:s|u)\d+\[|^\(?pred\[")  # index arithmetic, not values moved


def _operands(rest: str) -> list[str]:
    """Names in an instruction's operand list (the text after ``op(`` up to its closing
    parenthesis: attributes follow it)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


def definitions(comps: dict[str, list[str]]) -> dict[str, tuple[str, str, list[str], str | None, str]]:
    """Every instruction of the module (HLO names are unique module-wide): name -> (result
    type, op, operand names, called computation or None, line)."""
    defs = {}
    for lines in comps.values():
        for line in lines:
            if (d := _DEF.match(line)) is not None:
                calls = _CALLS.search(line)
                defs[d.group(1)] = (d.group(2), d.group(3), _operands(d.group(4)),
                                    calls.group(1) if calls else None, line)
    return defs


def _moves_only(comp: list[str]) -> bool:
    """A fused computation that computes no float value: movement, and index arithmetic."""
    for line in comp:
        d = _DEF.match(line)
        if d is not None and d.group(3) not in _MOVES and not _INDEX_TYPE.match(d.group(2)):
            return False
    return True


def _collective_in(comp: list[str]) -> tuple[str, str] | None:
    """(kind, line) of the collective an async computation wraps (XLA:GPU's ``async-start``
    around a reduce-scatter)."""
    for line in comp:
        d = _DEF.match(line)
        if d is not None and d.group(3) in _REDUCING:
            return d.group(3), line
    return None


def moved_from(line: str, defs: dict, comps: dict[str, list[str]], depth: int = 16) -> list[tuple[str, str]]:
    """The collectives (kind, line) whose results the permute on ``line`` moves, or ``[]`` when
    any of its float operands is computed rather than moved from one."""
    d = _DEF.match(line)
    if d is None:
        return []
    found: list[tuple[str, str]] = []
    todo = [(n, depth) for n in _operands(d.group(4))]
    seen = set()
    while todo:
        name, left = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in defs or left == 0:
            return []
        rtype, op, operands, called, text = defs[name]
        base = op[:-len("-done")] if op.endswith("-done") else op[:-len("-start")] if op.endswith("-start") else op
        if base in _REDUCING:
            found.append((base, defs[operands[0]][4] if op.endswith("-done") and operands[0] in defs else text))
        elif op == "fusion" and called and called.startswith("all-reduce-scatter"):
            # XLA:TPU's reduce-scatter: a fusion around an all-reduce and this device's slice.
            inner = _collective_in(comps.get(called, []))
            if inner is None:
                return []
            found.append(("reduce-scatter", inner[1]))
        elif op in ("async-done", "async-start"):
            if op == "async-done":
                todo.extend((n, left - 1) for n in operands)
                continue
            inner = _collective_in(comps.get(called or "", []))
            if inner is None:
                return []
            found.append(inner)
        elif _INDEX_TYPE.match(rtype) or op in ("constant", "partition-id", "replica-id"):
            continue
        elif op == "parameter":  # the step's input or a loop's carry: moved, but from no collective
            return []
        elif op in _MOVES or (op == "fusion" and called and _moves_only(comps.get(called, []))):
            todo.extend((n, left - 1) for n in operands)
        else:
            return []
    return found
