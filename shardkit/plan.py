"""``Plan``: a mesh, rules, a ZeRO stage, a precision and batch axes → the spec of every leaf.

The plan is pure bookkeeping: it never touches device memory, so ``plan.param_specs`` works on
abstract shapes (``jax.eval_shape`` / ``nnx.eval_shape``) of models too big for one device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import _model
from .precision import Precision
from .rules import (AxisRules, LeafLayout, PathRules, ShardingError, entry_axes, leaf_info,
                    resolve, spec_axes, validate)

_DATA_LIKE = ("replica", "data", "fsdp")
STANDARD_AXES = ("replica", "data", "fsdp", "tensor", "sequence", "pipe", "expert")
_ACTIVE: contextvars.ContextVar["Plan | None"] = contextvars.ContextVar("shardkit_plan", default=None)
_NOTES: contextvars.ContextVar["dict | None"] = contextvars.ContextVar("shardkit_trace_notes", default=None)


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """Resolved layout of a parameter-like tree.

    Attributes:
        treedef: the tree's structure.
        leaves: one ``LeafLayout`` per leaf, in tree order (``spec`` = the rules' spec).
        zero_specs: each leaf's spec with the data axes added (what ZeRO shards state by).
    """

    treedef: Any
    leaves: list[LeafLayout]
    zero_specs: list[P]

    def tree(self, specs: Sequence[P]):
        return jax.tree_util.tree_unflatten(self.treedef, list(specs))


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """Where every array of a training run lives.

    Attributes:
        mesh: the device mesh (``sk.make_mesh``).
        rules: ``PathRules`` or a list of ``(regex, spec)``; consulted first.
        axis_rules: ``AxisRules`` or a dict mapping logical axis names (from Flax metadata and
            ``sk.constrain``) to mesh axes. Mesh axis names map to themselves by default. A
            standard axis (``STANDARD_AXES``) the mesh lacks is dropped, so one table serves
            every layout; any other unknown axis is an error.
        zero: 0 (data parallel), 1 (optimizer state sharded over the data axes), 2 (+ gradients
            reduce-scattered), 3 (+ parameters sharded, FSDP).
        precision: a preset name or ``sk.Precision``.
        batch_axes: mesh axes the batch's leading dimension is split over; default: the
            data-like axes (``replica``, ``data``, ``fsdp``) present in the mesh; ``()``
            replicates the batch. ZeRO shards state over these axes too.
    """

    mesh: Mesh
    rules: PathRules | Sequence | None = None
    axis_rules: AxisRules | dict | None = None
    zero: int = 0
    precision: Precision | str = "fp32"
    batch_axes: Sequence[str] | str | None = None

    def __post_init__(self):
        # An AbstractMesh (sizes and names, no devices) plans for a mesh that is not here (sk.cost.simulate).
        if not isinstance(self.mesh, (Mesh, jax.sharding.AbstractMesh)):
            raise ValueError(f"Plan(mesh=...) needs a jax.sharding.Mesh (sk.make_mesh), got {type(self.mesh).__name__}")
        rules = self.rules
        if rules is not None and not isinstance(rules, PathRules):
            rules = PathRules(rules)
        axis_rules = self.axis_rules
        if axis_rules is not None and not isinstance(axis_rules, AxisRules):
            axis_rules = AxisRules(axis_rules)
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"unknown ZeRO stage {self.zero!r}; zero is 0 (DP), 1, 2 or 3 (FSDP)")
        names = tuple(self.mesh.axis_names)
        if self.batch_axes is None:
            batch_axes = tuple(a for a in names if a in _DATA_LIKE)
        else:
            batch_axes = (self.batch_axes,) if isinstance(self.batch_axes, str) else tuple(self.batch_axes)
            unknown = [a for a in batch_axes if a not in names]
            if unknown:
                raise ValueError(f"batch_axes {unknown} are not mesh axes; the mesh has {dict(self.mesh.shape)}")
        object.__setattr__(self, "rules", rules)
        object.__setattr__(self, "axis_rules", axis_rules)
        object.__setattr__(self, "precision", Precision.resolve(self.precision))
        object.__setattr__(self, "batch_axes", batch_axes)
        # One AxisRules table serves many meshes: a standard axis the mesh lacks is dropped
        # (size 1); any other unknown name is a typo and an error.
        mapping = {a: (a,) for a in names}
        typos = []
        for logical, axes in (axis_rules.mapping if axis_rules else {}).items():
            typos += [f"{logical!r} -> {a!r}" for a in axes if a not in names and a not in STANDARD_AXES]
            mapping[logical] = tuple(a for a in axes if a in names)
        if typos:
            raise ValueError(f"AxisRules map to mesh axes that are neither in the mesh {dict(self.mesh.shape)} "
                             f"nor standard axis names {STANDARD_AXES}: {', '.join(typos)}")
        object.__setattr__(self, "_axis_table", AxisRules(mapping))

    # ---- resolution -------------------------------------------------------------------------

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes ZeRO shards state over (the batch axes)."""
        return self.batch_axes

    @property
    def batch_size_multiple(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def _layout(self, tree, logical: dict, prefix: str = "", what: str = "parameter") -> ParamLayout:
        paths, shapes, dtypes, treedef = leaf_info(tree)
        rule_paths = [prefix + p for p in paths]
        names = [logical.get(p) for p in rule_paths]
        leaves = resolve(rule_paths, shapes, dtypes, names, self.rules, self._axis_table, what)
        validate(leaves, self.mesh, what)
        zero, notes = zip(*[self._zero_spec(l) for l in leaves]) if leaves else ((), ())
        leaves = [dataclasses.replace(l, note=n) for l, n in zip(leaves, notes)]
        return ParamLayout(treedef, leaves, list(zero))

    def _zero_spec(self, leaf: LeafLayout) -> tuple[P, str]:
        """Adds the unused data axes to the largest dimension they divide (ZeRO's shard)."""
        used = set(spec_axes(leaf.spec))
        free = tuple(a for a in self.data_axes if a not in used and self.mesh.shape[a] > 1)
        if not free or not leaf.shape:
            return leaf.spec, ""
        entries = list(leaf.spec) + [None] * (len(leaf.shape) - len(leaf.spec))
        sizes = dict(self.mesh.shape)
        # Try all free axes together, then each alone (largest first), on the largest dim.
        options = [free] + [(a,) for a in sorted(free, key=lambda a: -sizes[a])] if len(free) > 1 else [free]
        dims = sorted(range(len(leaf.shape)), key=lambda d: -leaf.shape[d])
        for axes in options:
            n = math.prod(sizes[a] for a in axes)
            for d in dims:
                cur = entry_axes(entries[d])
                if leaf.shape[d] % (n * math.prod(sizes[a] for a in cur)) == 0:
                    # After the dim's own axes: a ZeRO shard is then a slice of the device's
                    # tensor shard, where the gradient's reduce-scatter over data leaves it
                    # (data-major order would need collective-permutes to reorder the blocks).
                    new = cur + axes
                    entries[d] = new[0] if len(new) == 1 else new
                    while entries and entries[-1] is None:
                        entries.pop()
                    note = "" if axes == free else f"ZeRO shards over {axes} only (no dim divisible by all of {free})"
                    return P(*entries), note
        return leaf.spec, f"ZeRO cannot shard it: no dim divisible by {free}; kept replicated over them"

    def param_layout(self, model) -> ParamLayout:
        u = _model.unpack(model)
        return self._layout(u.params, u.logical, u.adapter.param_prefix)

    def leaf_layouts(self, model) -> list[LeafLayout]:
        """Per leaf of the model's parameters and state: path, shape, spec, and which rule decided it."""
        u = _model.unpack(model)
        lay = self._layout(u.params, u.logical, u.adapter.param_prefix)
        rows = [dataclasses.replace(l, spec=(z if self.zero == 3 else l.spec))
                for l, z in zip(lay.leaves, lay.zero_specs)]
        if jax.tree.leaves(u.model_state):
            rows += self._layout(u.model_state, u.logical, what="model-state leaf").leaves
        return rows

    # ---- specs per kind of array ---------------------------------------------------------------

    def param_specs(self, model):
        """PartitionSpecs of the parameters (ZeRO-3 adds the data axes).

        Args:
            model: a pytree of arrays or ``ShapeDtypeStruct``s, an NNX module or State, or Linen
                variables. For modules and Linen variables the result mirrors the parameter
                tree (a nested dict, without the ``params`` collection level).

        Raises:
            ShardingError: unmatched leaves or specs that do not fit the mesh (all listed).
        """
        lay = self.param_layout(model)
        return lay.tree(lay.zero_specs if self.zero == 3 else [l.spec for l in lay.leaves])

    def grad_specs(self, model):
        """Gradient specs: the parameters' specs, or ZeRO's shard from stage 2 on."""
        lay = self.param_layout(model)
        return lay.tree(lay.zero_specs if self.zero >= 2 else [l.spec for l in lay.leaves])

    def state_specs(self, model_state, logical: dict | None = None):
        """Specs of non-trainable model state (BatchNorm statistics): the rules, no ZeRO."""
        lay = self._layout(model_state, logical or {}, what="model-state leaf")
        return lay.tree([l.spec for l in lay.leaves])

    def opt_state_specs(self, opt_state, params, layout: ParamLayout | None = None):
        """Optimizer-state specs: a leaf that mirrors a parameter (same path suffix and shape)
        follows it, sharded over the data axes from ZeRO-1 on; other leaves are replicated.
        """
        lay = layout or self.param_layout(params)
        ppaths, pshapes, _, _ = leaf_info(_model.unpack(params).params if layout is None else params)
        by_path = {p: i for i, p in enumerate(ppaths)}
        flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
        specs = []
        for keypath, leaf in flat:
            parts = [str(_key(k)) for k in keypath]
            shape = tuple(getattr(leaf, "shape", ()))
            spec = P()
            for i in range(len(parts) + 1):
                j = by_path.get("/".join(parts[i:]))
                if j is not None and pshapes[j] == shape and shape:
                    spec = lay.zero_specs[j] if self.zero >= 1 else lay.leaves[j].spec
                    break
            specs.append(spec)
        return jax.tree_util.tree_unflatten(treedef, specs)

    def batch_specs(self, batch, microbatches: int = 1):
        """Batch specs: each leaf's leading dimension over ``batch_axes``.

        Raises:
            ShardingError: a leaf's leading dimension is not divisible by the batch axes' size
                times ``microbatches`` (every such leaf listed).
        """
        n = self.batch_size_multiple
        spec = P(self.batch_axes if len(self.batch_axes) != 1 else self.batch_axes[0]) if self.batch_axes else P()
        paths, shapes, _, treedef = leaf_info(batch)
        problems, specs = [], []
        axes_txt = " x ".join(f"{a}={self.mesh.shape[a]}" for a in self.batch_axes) or "no axes"
        for path, shape in zip(paths, shapes):
            if not shape:
                specs.append(P())
                continue
            need = n * microbatches
            if shape[0] % need:
                why = f"batch axes {axes_txt}" + (f" x {microbatches} microbatches" if microbatches > 1 else "")
                problems.append(f"batch leaf '{path or '<root>'}' shape={shape}: leading dim {shape[0]} is not divisible by {need} ({why})")
            specs.append(spec)
        if problems:
            raise ShardingError(
                f"{len(problems)} batch leaf/leaves do not split evenly:", problems,
                fix=f"use a global batch that is a multiple of {n * microbatches}, or change microbatches / batch_axes")
        return jax.tree_util.tree_unflatten(treedef, specs)

    def microbatch_spec(self) -> P:
        """Spec of a ``(microbatches, batch/microbatches, ...)`` batch leaf."""
        return P(None, self.batch_axes if len(self.batch_axes) != 1 else self.batch_axes[0]) if self.batch_axes else P()

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def shardings(self, specs):
        """Turns a tree of PartitionSpecs into NamedShardings on this plan's mesh."""
        return jax.tree.map(self.sharding, specs, is_leaf=lambda x: isinstance(x, P))

    def param_shardings(self, model):
        return self.shardings(self.param_specs(model))

    def batch_shardings(self, batch, microbatches: int = 1):
        return self.shardings(self.batch_specs(batch, microbatches))

    # ---- activations -------------------------------------------------------------------------

    def logical_spec(self, names: Sequence[str | None]) -> P:
        """The PartitionSpec for logical axis names, through this plan's AxisRules."""
        return self._axis_table.spec(names)

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """``with_sharding_constraint`` on ``x`` by logical axis names; axes that do not divide
        the dimension are dropped for that array (activations vary in shape, e.g. the last
        microbatch of decoding), so the constraint never fails a compile."""
        if len(names) != x.ndim:
            raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
        spec = self.logical_spec(names)
        # Inside a shard_map (e.g. sk.pipeline's stages) some axes are manual: constrain only
        # over the others, on the context's abstract mesh.
        context = jax.sharding.get_abstract_mesh()
        manual = set() if context.empty else {
            a for a, t in zip(context.axis_names, context.axis_types) if t == jax.sharding.AxisType.Manual}
        entries = []
        for d, e in enumerate(spec):
            axes = tuple(a for a in entry_axes(e) if a not in manual)
            n = math.prod(self.mesh.shape[a] for a in axes)
            entries.append(None if not axes or x.shape[d] % n else axes[0] if len(axes) == 1 else axes)
        if manual:
            return jax.lax.with_sharding_constraint(x, NamedSharding(context, P(*entries)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*entries)))

    @contextlib.contextmanager
    def active(self):
        """Makes this plan the one ``sk.constrain`` uses, and its mesh the current mesh."""
        token = _ACTIVE.set(self)
        try:
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(jax.set_mesh(self.mesh))
                except ValueError:  # already inside a jit trace: the caller set the mesh
                    pass
                yield self
        finally:
            _ACTIVE.reset(token)

    # ---- presentation -------------------------------------------------------------------------

    def describe(self, model):
        """A table of each leaf's path, shape, spec, per-device shape and deciding rule (a
        ``rich`` Table; ``print()`` renders it as text, notebooks as HTML)."""
        t = _Table(title=f"{self} — per-leaf sharding")
        for col in ("path", "shape", "dtype", "spec", "per device", "source"):
            t.add_column(col)
        for l in self.leaf_layouts(model):
            t.add_row(l.path, str(l.shape), str(getattr(l.dtype, "name", l.dtype)), str(l.spec),
                      str(shard_shape(l.shape, l.spec, self.mesh)), l.source + (f" — {l.note}" if l.note else ""))
        return t

    def __repr__(self) -> str:
        axes = ",".join(f"{n}={s}" for n, s in self.mesh.shape.items())
        return f"Plan(mesh='{axes}', zero={self.zero}, precision={self.precision.name!r}, batch_axes={self.batch_axes})"


try:
    from rich.table import Table as _RichTable
except ImportError:  # pragma: no cover - rich ships with flax
    _RichTable = object


class _Table(_RichTable):
    """A ``rich`` table that also prints as text with plain ``print`` and renders in notebooks."""

    def _export(self, html: bool) -> str:
        import io

        from rich.console import Console

        console = Console(file=io.StringIO(), width=160, record=True)
        console.print(self)
        return console.export_html(inline_styles=True) if html else console.export_text()

    def __str__(self) -> str:
        return self._export(html=False)

    def _repr_html_(self) -> str:
        return self._export(html=True)


def _key(k):
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def shard_shape(shape: Sequence[int], spec: P, mesh: Mesh) -> tuple[int, ...]:
    """The per-device block shape of an array of ``shape`` laid out by ``spec``."""
    out = list(shape)
    for d, e in enumerate(spec):
        out[d] //= math.prod(mesh.shape[a] for a in entry_axes(e))
    return tuple(out)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation by logical axis names through the active plan (inside a
    shardkit step); outside one it returns ``x`` unchanged, so models run anywhere."""
    plan = _ACTIVE.get()
    return x if plan is None else plan.constrain(x, names)


def active_plan() -> Plan | None:
    """The plan whose step is being traced, if any."""
    return _ACTIVE.get()


def note(key: str, value: Any) -> None:
    """Records a fact about the program being traced (e.g. ``sk.pipeline``'s microbatches and
    schedule) for ``explain()``; a no-op outside a shardkit step's trace."""
    notes = _NOTES.get()
    if notes is not None:
        notes[key] = value


def noting() -> bool:
    """Whether ``note()`` calls are being collected (a shardkit step is being traced)."""
    return _NOTES.get() is not None


@contextlib.contextmanager
def collecting_notes():
    """Collects ``note()`` calls made while tracing inside this context into a dict."""
    notes: dict = {}
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)
