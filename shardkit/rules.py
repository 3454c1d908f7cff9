"""Per-layer partition specs: path rules, logical-axis rules, resolution and validation.

A leaf's spec comes from, in order: the first ``PathRules`` regex that ``re.search``es its
``/``-joined path; else its Flax logical axis names mapped through ``AxisRules``; else it is an
error. Replication is something a rule says (``(r".*", ())``), never a fallback.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

SpecLike = P | Sequence[str | Sequence[str] | None] | None
MeshAxes = str | Sequence[str] | None


class ShardingError(ValueError):
    """A layout that cannot work; the message lists every offender and the fix."""

    def __init__(self, headline: str, problems: Sequence[str] = (), fix: str = ""):
        self.headline, self.problems, self.fix = headline, list(problems), fix
        lines = [headline] + [f"  - {p}" for p in self.problems]
        if fix:
            lines.append(f"Fix: {fix}")
        super().__init__("\n".join(lines))


def to_spec(spec: SpecLike) -> P:
    """Normalises a spec given as a PartitionSpec, tuple/list of entries, or None (= replicated)."""
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, str):
        return P(spec)
    if not isinstance(spec, Sequence):
        raise ShardingError(f"spec {spec!r} is not a PartitionSpec or a tuple of axis names")
    entries = []
    for e in spec:
        if e is None or isinstance(e, str):
            entries.append(e)
        elif isinstance(e, Sequence) and all(isinstance(a, str) for a in e):
            entries.append(tuple(e) if len(e) != 1 else e[0])
        else:
            raise ShardingError(f"spec {spec!r}: entry {e!r} is not an axis name, a tuple of names or None")
    return P(*entries)


def spec_axes(spec: P) -> list[str]:
    """Mesh axes a spec uses, in order (with repeats, so callers can detect duplicates)."""
    out = []
    for e in spec:
        if e is None or e is P.UNCONSTRAINED:
            continue
        out.extend((e,) if isinstance(e, str) else e)
    return out


def entry_axes(entry) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


class PathRules:
    """Ordered ``(regex, spec)`` pairs; the first regex that ``re.search``es a leaf's path wins.

    Example:
        ``PathRules([(r"attn/(q|k|v)/kernel", (None, "tensor")), (r".*", ())])``

    Args:
        rules: pairs of a regex (string or compiled) and a spec (PartitionSpec, tuple of mesh
            axis names / tuples of names / None, or ``()`` / None for replicated).
    """

    def __init__(self, rules: Iterable[tuple[str | re.Pattern, SpecLike]]):
        self.rules: list[tuple[re.Pattern, P]] = []
        for i, item in enumerate(rules):
            try:
                pattern, spec = item
            except (TypeError, ValueError):
                raise ValueError(f"PathRules entry {i} is {item!r}; each entry is a (regex, spec) pair") from None
            try:
                rx = pattern if isinstance(pattern, re.Pattern) else re.compile(pattern)
            except re.error as e:
                raise ValueError(f"PathRules entry {i}: {pattern!r} is not a valid regex ({e})") from None
            self.rules.append((rx, to_spec(spec)))

    def match(self, path: str) -> tuple[int, P] | None:
        """Returns ``(rule index, spec)`` of the first rule matching ``path``, or None."""
        for i, (rx, spec) in enumerate(self.rules):
            if rx.search(path):
                return i, spec
        return None

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        body = ", ".join(f"({rx.pattern!r}, {spec})" for rx, spec in self.rules)
        return f"PathRules([{body}])"


class AxisRules:
    """Maps logical axis names (``"embed"``, ``"mlp"``, ``"batch"``) to mesh axes.

    Args:
        mapping: logical name → a mesh axis, a tuple of mesh axes, or None (replicated).
    """

    def __init__(self, mapping: Mapping[str, MeshAxes] | Iterable[tuple[str, MeshAxes]]):
        items = mapping.items() if isinstance(mapping, Mapping) else mapping
        self.mapping: dict[str, tuple[str, ...]] = {}
        for name, axes in items:
            if axes is None:
                self.mapping[name] = ()
            elif isinstance(axes, str):
                self.mapping[name] = (axes,)
            elif isinstance(axes, Sequence) and all(isinstance(a, str) for a in axes):
                self.mapping[name] = tuple(axes)
            else:
                raise ValueError(f"AxisRules[{name!r}] = {axes!r}; map a logical axis to a mesh axis name, a tuple of names, or None")

    def spec(self, names: Sequence[str | None]) -> P:
        """The PartitionSpec for a leaf whose dimensions carry these logical names.

        Raises:
            ShardingError: a name has no mapping.
        """
        missing = [n for n in names if n is not None and n not in self.mapping]
        if missing:
            raise ShardingError(
                f"logical axis name(s) {missing} have no AxisRules entry",
                fix=f"add them to AxisRules, e.g. {{{missing[0]!r}: None}} to replicate that dimension")
        entries = []
        for n in names:
            axes = () if n is None else self.mapping[n]
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def __repr__(self) -> str:
        return f"AxisRules({self.mapping!r})"


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one leaf is laid out.

    Attributes:
        path: ``/``-joined key path.
        shape: the leaf's global shape.
        dtype: its dtype.
        spec: the resolved PartitionSpec (None when unresolved).
        source: what decided it (``"rule 2: attn/.*"``, ``"logical ('embed', 'mlp')"``).
        note: extra information (e.g. why ZeRO could not shard it further).
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: P | None
    source: str
    note: str = ""


def key_to_str(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(keypath) -> str:
    return "/".join(key_to_str(k) for k in keypath)


def resolve(paths: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[Any],
            logical: Sequence[Sequence[str | None] | None], path_rules: PathRules | None,
            axis_rules: AxisRules | None, what: str = "parameter") -> list[LeafLayout]:
    """Resolves every leaf's spec (path rules, then logical names); raises on unmatched leaves."""
    out, unmatched, bad_logical = [], [], []
    for path, shape, dtype, names in zip(paths, shapes, dtypes, logical):
        hit = path_rules.match(path) if path_rules is not None else None
        if hit is not None:
            i, spec = hit
            out.append(LeafLayout(path, shape, dtype, spec, f"rule {i}: {path_rules.rules[i][0].pattern}"))
        elif names is not None:
            if axis_rules is None:
                bad_logical.append(f"{path} {shape}: logical axes {tuple(names)} but the Plan has no axis_rules")
                out.append(LeafLayout(path, shape, dtype, None, "logical"))
                continue
            try:
                spec = axis_rules.spec(names)
            except ShardingError as e:
                bad_logical.append(f"{path} {shape}: {e.headline}")
                out.append(LeafLayout(path, shape, dtype, None, "logical"))
                continue
            out.append(LeafLayout(path, shape, dtype, spec, f"logical {tuple(names)}"))
        else:
            unmatched.append(f"{path} {shape}")
            out.append(LeafLayout(path, shape, dtype, None, "unmatched"))
    problems = [f"{p}: no PathRules entry matches and it has no logical axis names" for p in unmatched] + bad_logical
    if problems:
        raise ShardingError(
            f"{len(problems)} {what}(s) have no sharding rule:", problems,
            fix="add a PathRules entry (regex → spec) or an AxisRules entry for them, or end the "
                "rules with (r'.*', ()) to replicate the rest on purpose")
    return out


def validate(layouts: Sequence[LeafLayout], mesh: Mesh, what: str = "parameter") -> None:
    """Checks every resolved spec against the mesh and the leaf's shape; reports all offenders.

    Raises:
        ShardingError: unknown mesh axis, an axis used twice, a spec longer than the rank, or a
            dimension not divisible by the product of its axes' sizes.
    """
    sizes = dict(mesh.shape)
    problems = []
    for lay in layouts:
        spec, shape = lay.spec, lay.shape
        where = f"{lay.path} shape={shape} spec={spec} ({lay.source})"
        axes = spec_axes(spec)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            problems.append(f"{where}: unknown mesh axis {', '.join(map(repr, unknown))}; the mesh has {sizes}")
            continue
        dup = sorted({a for a in axes if axes.count(a) > 1})
        if dup:
            problems.append(f"{where}: mesh axis {', '.join(map(repr, dup))} used more than once in one spec")
        if len(spec) > len(shape):
            problems.append(f"{where}: spec has {len(spec)} entries but the array has rank {len(shape)}")
            continue
        for d, entry in enumerate(spec):
            ax = entry_axes(entry)
            n = math.prod(sizes[a] for a in ax)
            if n > 1 and shape[d] % n:
                desc = " x ".join(f"{a}={sizes[a]}" for a in ax)
                problems.append(f"{where}: dim {d} of size {shape[d]} is not divisible by {desc} (= {n})")
    if problems:
        raise ShardingError(
            f"{len(problems)} {what}(s) cannot be sharded as the rules say:", problems,
            fix="change the rule's spec (a different mesh axis or dimension, or None), or the mesh sizes")


def leaf_info(tree) -> tuple[list[str], list[tuple[int, ...]], list[Any], Any]:
    """Paths, shapes, dtypes and treedef of a pytree of arrays / ShapeDtypeStructs."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths = [path_str(k) for k, _ in flat]
    shapes = [tuple(getattr(v, "shape", ())) for _, v in flat]
    dtypes = [getattr(v, "dtype", None) for _, v in flat]
    return paths, shapes, dtypes, treedef
