"""Per-layer partition specs: path rules, logical-axis rules, resolution and validation.

A leaf's spec comes from, in order: the first ``PathRules`` regex that ``re.search``es its
``/``-joined path; else its Flax logical axis names mapped through ``AxisRules``; else it is an
error. Replication is something a rule says (``(r".*", ())``), never a fallback.
"""

from __future__ import annotations

import collections
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
            axis names / tuples of names / None, or ``()`` / None for replicated), or a dict
            ``{regex: spec}`` (its order is the rules' order).

    Raises:
        ValueError: an entry that is not a ``(regex, spec)`` pair, or a regex that does not compile.
    """

    def __init__(self, rules: Mapping[str | re.Pattern, SpecLike] | Iterable[tuple[str | re.Pattern, SpecLike]]):
        self.rules: list[tuple[re.Pattern, P]] = []
        if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise ValueError(f"PathRules takes (regex, spec) pairs or a {{regex: spec}} dict, got {rules!r}; "
                             "e.g. sk.PathRules([(r'w1', ('fsdp', 'tensor')), (r'.*', ())])")
        # A dict reads like AxisRules' table; its insertion order is the rules' order.
        items = rules.items() if isinstance(rules, Mapping) else rules
        for i, item in enumerate(items):
            # A bare string unpacks into two characters ("w1" -> regex "w", spec "1"): refuse it.
            pair = not isinstance(item, (str, bytes)) and isinstance(item, Sequence) and len(item) == 2
            if not pair or not isinstance(item[0], (str, re.Pattern)):
                raise ValueError(f"PathRules entry {i} is {item!r}; each entry is a (regex, spec) pair, "
                                 "e.g. (r'mlp/w1', ('fsdp', 'tensor')) or (r'.*', ()) to replicate the rest")
            pattern, spec = item
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

    A name listed once is a fixed mapping: its dimension goes to those mesh axes, and a clash
    with another dimension or a size they do not divide is reported by validation. A name listed
    more than once (pairs, as Flax/MaxText tables write ``("embed", "fsdp"), ("embed", "data")``)
    is an ordered list of fallbacks, tried in table order as ``flax.linen.logical_to_mesh_axes``
    tries its rules: the first entry whose mesh axes are not used by another dimension of the
    same spec (Flax's check), are in the mesh and divide the dimension (checks Flax leaves out)
    wins. Fixed names are placed first (they have no alternative), then fallback entries in
    table order. If no entry of a name fits, resolution fails naming every entry and why;
    ``(name, None)`` as the last entry replicates that dimension on purpose.

    A fixed name mapped to a mesh axis the mesh lacks is an error (``"mlp": "tensor"`` on a
    mesh whose axis is spelled ``tensr`` would otherwise replicate every MLP silently), and so
    is a repeated name none of whose entries the mesh has. One table for several meshes (the
    recipes' layouts, ``explain(mesh=...)``) says so: ``drop_missing=True`` drops the axes a
    mesh lacks from each entry (a name left with none is replicated; ``plan.describe`` lists
    what was dropped), or the mesh carries the axis at size 1 (``"data=8,tensor=1"``).

    Args:
        mapping: a dict, or ``(name, mesh axes)`` pairs (names may repeat), where mesh axes is
            a mesh axis, a tuple of mesh axes, or None (replicated).
        drop_missing: drop the mesh axes a mesh lacks instead of refusing the table there.

    Attributes:
        entries: the ``(name, mesh axes)`` pairs in table order.
        mapping: each name's first entry (its only one unless the name repeats).
        drop_missing: as the argument.
    """

    def __init__(self, mapping: Mapping[str, MeshAxes] | Iterable[tuple[str, MeshAxes]], *,
                 drop_missing: bool = False):
        self.drop_missing = bool(drop_missing)
        if isinstance(mapping, (str, bytes)) or not isinstance(mapping, Iterable):
            raise ValueError(f"AxisRules takes a {{logical name: mesh axes}} dict or (name, mesh axes) pairs, "
                             f"got {mapping!r}; e.g. sk.AxisRules({{'batch': 'data', 'mlp': 'tensor'}})")
        items = mapping.items() if isinstance(mapping, Mapping) else mapping
        self.entries: list[tuple[str, tuple[str, ...]]] = []
        for i, item in enumerate(items):
            # A bare string would unpack into two characters ("ab" -> 'a' mapped to 'b').
            if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2 \
                    or not isinstance(item[0], str):
                raise ValueError(f"AxisRules entry {i} is {item!r}; each entry is a (logical name, mesh axes) pair")
            name, axes = item
            if axes is None:
                axes = ()
            elif isinstance(axes, str):
                axes = (axes,)
            elif isinstance(axes, Sequence) and all(isinstance(a, str) for a in axes):
                axes = tuple(axes)
            else:
                raise ValueError(f"AxisRules[{name!r}] = {axes!r}; map a logical axis to a mesh axis name, a tuple of names, or None")
            self.entries.append((name, axes))
        self.mapping: dict[str, tuple[str, ...]] = {}
        for name, axes in self.entries:
            self.mapping.setdefault(name, axes)
        counts = collections.Counter(name for name, _ in self.entries)
        self.fallbacks: frozenset[str] = frozenset(n for n, c in counts.items() if c > 1)

    def _here(self, axes: tuple[str, ...], mesh_sizes: Mapping[str, int] | None) -> tuple[str, ...] | None:
        """The entry's axes on this mesh; None where it names an axis the mesh lacks and
        ``drop_missing`` is off (the entry cannot be used here)."""
        if mesh_sizes is None:
            return axes
        kept = tuple(a for a in axes if a in mesh_sizes)
        return None if len(kept) < len(axes) and not self.drop_missing else kept

    def absent(self, mesh_sizes: Mapping[str, int]) -> list[str]:
        """Each fixed name mapped to axes the mesh lacks, and each repeated name none of whose
        entries the mesh has (``(name, None)`` counts as one it has), described."""
        out = []
        for name, axes in self.entries:
            lacking = [a for a in axes if a not in mesh_sizes]
            if name not in self.fallbacks and lacking:
                out.append(f"{name!r} -> {axes if len(axes) > 1 else axes[0]!r}: the mesh has no "
                           f"{', '.join(map(repr, lacking))}")
        for name in sorted(self.fallbacks):
            options = [axes for n, axes in self.entries if n == name]
            if not any(all(a in mesh_sizes for a in axes) for axes in options):
                out.append(f"{name!r}: none of its entries {options} has all its axes in the mesh")
        return out

    def spec(self, names: Sequence[str | None], shape: Sequence[int] | None = None,
             mesh_sizes: Mapping[str, int] | None = None, *, lenient: bool = False) -> P:
        """The PartitionSpec for an array whose dimensions carry these logical names.

        Args:
            names: one logical name (or None) per dimension.
            shape: the array's shape; without it a fallback's divisibility is not checked.
            mesh_sizes: the mesh's axis sizes; without them every axis counts as present.
            lenient: a repeated name none of whose entries fits is left unsharded instead of
                raising (activations, whose shapes vary).

        Raises:
            ShardingError: a name has no entry, or a repeated name has no entry that fits.
        """
        missing = [n for n in names if n is not None and n not in self.mapping]
        if missing:
            raise ShardingError(
                f"logical axis name(s) {missing} have no AxisRules entry",
                fix=f"add them to AxisRules, e.g. {{{missing[0]!r}: None}} to replicate that dimension")
        dims = {n: d for d, n in enumerate(names) if n is not None}
        repeated = [n for n in dims if list(names).count(n) > 1]
        if repeated:
            raise ShardingError(f"logical axis name(s) {repeated} name more than one dimension of {tuple(names)}")
        fixed = {n: self._here(self.mapping[n], mesh_sizes) for n in dims if n not in self.fallbacks}
        lacking = [n for n, axes in fixed.items() if axes is None]
        if lacking:
            mesh = dict(mesh_sizes)
            raise ShardingError(
                f"logical axis name(s) {lacking} map to mesh axes the mesh {mesh} lacks: "
                + ", ".join(f"{n!r} -> {self.mapping[n]}" for n in lacking),
                fix="map them to axes of this mesh or None, add the axis at size 1, or build the table "
                    "with sk.AxisRules(..., drop_missing=True) to use it on meshes without some of its axes")
        result: list[tuple[str, ...] | None] = [None if n is None or n in self.fallbacks else fixed[n]
                                                for n in names]
        used = {a for axes in result if axes for a in axes}
        tried: dict[str, list[str]] = {n: [] for n in dims if n in self.fallbacks}
        for name, axes in self.entries:
            if name not in tried or result[dims[name]] is not None:
                continue
            d, here = dims[name], self._here(axes, mesh_sizes)
            if here is None or axes and not here:
                tried[name].append(f"{axes} not in the mesh")
                continue
            taken = [a for a in here if a in used]
            if taken:
                owner = next(names[i] for i, r in enumerate(result) if r and taken[0] in r)
                tried[name].append(f"{axes}: {taken[0]!r} is used by {owner!r}")
                continue
            n = math.prod(mesh_sizes[a] for a in here) if mesh_sizes is not None else 1
            if shape is not None and shape[d] % n:
                tried[name].append(f"{axes} (= {n}) does not divide {shape[d]}")
                continue
            result[dims[name]] = here
            used.update(here)
        # With drop_missing, a name all of whose entries name axes this mesh lacks is replicated,
        # as a fixed name is.
        unplaced = [n for n in tried if result[dims[n]] is None
                    and not (self.drop_missing and all(t.endswith("not in the mesh") for t in tried[n]))]
        if unplaced and not lenient:
            details = "; ".join(f"{n!r} (dim {dims[n]}" + (f", size {shape[dims[n]]}" if shape is not None else "")
                                + f"): {', '.join(tried[n])}" for n in unplaced)
            raise ShardingError(
                f"no AxisRules entry fits logical axis {details}",
                fix=f"add ({unplaced[0]!r}, None) as its last entry to replicate it on purpose, or a mesh axis that fits")
        entries = [None if not axes else axes[0] if len(axes) == 1 else axes for axes in result]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def __repr__(self) -> str:
        flag = ", drop_missing=True" if self.drop_missing else ""
        if self.fallbacks:
            return f"AxisRules({self.entries!r}{flag})"
        return f"AxisRules({self.mapping!r}{flag})"


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
            axis_rules: AxisRules | None, what: str = "parameter",
            mesh_sizes: Mapping[str, int] | None = None) -> list[LeafLayout]:
    """Resolves every leaf's spec (path rules, then logical names); raises on unmatched leaves.

    ``mesh_sizes`` lets ``AxisRules`` fallbacks check that their axes exist and divide.
    """
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
                spec = axis_rules.spec(names, shape, mesh_sizes)
            except ShardingError as e:
                bad_logical.append(f"{path} {shape}: {e.headline}" + (f" ({e.fix})" if e.fix else ""))
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
