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

from . import _axes, _describe, _model, _zero, offload as _offload
from ._describe import shard_shape as shard_shape  # noqa: F401  (imported from here by sk.cost)
from .precision import Precision
from .rules import (AxisRules, LeafLayout, PathRules, ShardingError, entry_axes, leaf_info,
                    resolve, spec_axes, validate)

_DATA_LIKE = ("replica", "data", "fsdp")
STANDARD_AXES = _axes.STANDARD
_ACTIVE: contextvars.ContextVar["Plan | None"] = contextvars.ContextVar("shardkit_plan", default=None)
_NOTES: contextvars.ContextVar["dict | None"] = contextvars.ContextVar("shardkit_trace_notes", default=None)
_DETAIL: contextvars.ContextVar[bool] = contextvars.ContextVar("shardkit_detailed_notes", default=False)


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
        rules: ``PathRules``, a list of ``(regex, spec)`` or a ``{regex: spec}`` dict (in its
            order); consulted first.
        axis_rules: ``AxisRules``, a dict or ``(name, mesh axes)`` pairs mapping logical axis
            names (from Flax metadata and ``sk.constrain``) to mesh axes; a name listed more
            than once is an ordered list of fallbacks (see ``AxisRules``). Mesh axis names map
            to themselves by default. A name mapped to an axis the mesh lacks is an error
            (every one listed), unless the table is ``sk.AxisRules(..., drop_missing=True)``:
            then a standard axis (``STANDARD_AXES``) the mesh lacks is dropped, so one table
            serves several layouts, and ``describe`` lists what was dropped.
        zero: 0 (data parallel), 1 (optimizer state sharded over the data axes), 2 (+ gradients
            reduce-scattered), 3 (+ parameters sharded, FSDP).
        precision: a preset name or ``sk.Precision``.
        batch_axes: mesh axes the batch's leading dimension is split over; default: the
            data-like axes (``replica``, ``data``, ``fsdp``) present in the mesh; ``()``
            replicates the batch. ZeRO shards state over these axes too.
        strict: what happens to a leaf ZeRO should shard but cannot (no dimension divisible
            by any data axis): every optimizer-state leaf from ZeRO-1 on (whatever its shape:
            Adam moments, Adafactor's factored moments, preconditioners), and the parameters
            themselves under ZeRO-3. With ``True`` (the default) all such leaves are listed in
            one ``ShardingError`` before compiling; with ``False`` they are kept replicated
            over the data axes and ``describe(params, opt_state=...)`` notes each. Scalars and
            one-element leaves (step counts) are replicated by design, and leaves with fewer
            than 128 elements per data device (a PRNG key, a 10-class head's bias) are
            replicated with a note even under ``strict``: their replica is noise next to any
            weight matrix. Gradients under ZeRO-2 follow the parameters' ZeRO shard.
        offload: what lives in pinned host memory between steps: ``("opt_state",)`` keeps the
            optimizer state there (ZeRO's specs, host memory), brought to the device for the
            update inside the step and written back (``sk.offload``). Default ``()``.
        unused_axes: mesh axes no rule or batch axis uses, kept on purpose: their devices repeat
            the same work, or the step's own ``shard_map`` uses them (the plan cannot see it).
            Any other axis of size > 1 that no rule, batch axis, parameter spec, ``sk.constrain``
            or building block (``sk.pipeline``, ``sk.context_attention``, ``sk.moe``,
            ``sk.DiLoCo``) uses is a ``ShardingError`` when the step is traced, before it
            compiles. ``describe`` lists them.
    """

    mesh: Mesh
    rules: PathRules | Sequence | None = None
    axis_rules: AxisRules | dict | None = None
    zero: int = 0
    precision: Precision | str = "fp32"
    batch_axes: Sequence[str] | str | None = None
    strict: bool = True
    offload: Sequence[str] | str = ()
    unused_axes: Sequence[str] | str = ()

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
        object.__setattr__(self, "offload", _offload.check(self.offload))
        # A name mapped to an axis the mesh lacks is an error: a typo, or a table written for
        # another mesh. With drop_missing one table serves many meshes, and a standard axis the
        # mesh lacks is dropped when specs are resolved; any other unknown name is still a typo.
        entries = list(axis_rules.entries) if axis_rules else []
        typos = [f"{logical!r} -> {a!r}" for logical, axes in entries for a in axes
                 if a not in names and a not in STANDARD_AXES]
        if typos:
            raise ValueError(f"AxisRules map to mesh axes that are neither in the mesh {dict(self.mesh.shape)} "
                             f"nor standard axis names {STANDARD_AXES}: {', '.join(typos)}")
        absent = axis_rules.absent(dict(self.mesh.shape)) if axis_rules else []
        if absent and not axis_rules.drop_missing:
            raise ShardingError(
                f"{len(absent)} AxisRules entr(y/ies) name mesh axes the mesh {dict(self.mesh.shape)} lacks:", absent,
                fix="map them to axes of this mesh (or None to replicate), add the axis to the mesh at size 1 "
                    "(make_mesh('data=8,tensor=1')), or use one table for several meshes with "
                    "sk.AxisRules({...}, drop_missing=True)")
        object.__setattr__(self, "_dropped", absent)
        # Mesh axis names map to themselves unless the table says otherwise.
        named = {logical for logical, _ in entries}
        table = AxisRules([(a, (a,)) for a in names if a not in named] + entries,
                          drop_missing=bool(axis_rules and axis_rules.drop_missing))
        object.__setattr__(self, "_axis_table", table)
        # Logical axis names of the models this plan laid out, by their parameters' (paths,
        # shapes): ``state.params`` is a plain tree without Flax's metadata, and
        # ``describe(state.params)`` must resolve it as the step did.
        object.__setattr__(self, "_seen", {})
        self._check_unused_axes(names)

    def _check_unused_axes(self, names: tuple[str, ...]) -> None:
        unused = (self.unused_axes,) if isinstance(self.unused_axes, str) else tuple(self.unused_axes)
        unknown = [a for a in unused if a not in names]
        if unknown:
            raise ValueError(f"unused_axes {unknown} are not mesh axes; the mesh has {dict(self.mesh.shape)}")
        used = _axes.plan_axes(self, unused=False)
        contradicted = [a for a in unused if a in used]
        if contradicted:
            raise ValueError(f"unused_axes {contradicted} are used by the plan's rules or batch axes "
                             f"{self.batch_axes}; list only axes nothing uses")
        object.__setattr__(self, "unused_axes", unused)

    def check_axes_used(self, also=()) -> None:
        """Raises ``ShardingError`` naming every mesh axis of size > 1 that nothing uses: no
        rule, batch axis or ``unused_axes`` entry, nor any of ``also`` (the axes a traced step
        used). ``sk.train_step`` and ``sk.jit`` call it when they trace, before compiling."""
        _axes.check(self, also)

    # ---- resolution -------------------------------------------------------------------------

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes ZeRO shards state over (the batch axes)."""
        return self.batch_axes

    @property
    def batch_size_multiple(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    def _layout(self, tree, logical: dict, prefix: str = "", what: str = "parameter",
                check: bool = True) -> ParamLayout:
        paths, shapes, dtypes, treedef = leaf_info(tree)
        if what == "parameter" and (logical or prefix):
            self._seen[(tuple(paths), tuple(shapes))] = (prefix, logical)
        rule_paths = [prefix + p for p in paths]
        names = [logical.get(p) for p in rule_paths]
        leaves = resolve(rule_paths, shapes, dtypes, names, self.rules, self._axis_table, what,
                         dict(self.mesh.shape))
        validate(leaves, self.mesh, what)
        if what != "parameter":  # ZeRO shards parameters and their optimizer state only
            return ParamLayout(treedef, leaves, [l.spec for l in leaves])
        placed = [_zero.zero_spec(self, l.shape, l.spec) for l in leaves]
        leaves = [dataclasses.replace(l, note=n) for l, (_, n, _) in zip(leaves, placed)]
        if check and self.zero == 3:
            _zero.refuse_replicated(self, [(f"parameter {l.path}", l.shape, l.source)
                                     for l, (_, _, bad) in zip(leaves, placed) if bad], "parameter")
        return ParamLayout(treedef, leaves, [s for s, _, _ in placed])

    def _unpack(self, model) -> _model.Unpacked:
        """``model`` split into plain trees; a plain tree with the parameters' paths and shapes
        of a model this plan laid out (``state.params`` of an NNX or Linen model) gets that
        model's logical names and path prefix back."""
        u = _model.unpack(model)
        if u.adapter.kind != "pytree" or u.logical:
            return u
        paths, shapes, _, _ = leaf_info(u.params)
        seen = self._seen.get((tuple(paths), tuple(shapes)))
        if seen is None:
            return u
        prefix, logical = seen
        return dataclasses.replace(u, adapter=_model.Adapter("pytree", param_prefix=prefix), logical=logical)

    def param_layout(self, model) -> ParamLayout:
        u = self._unpack(model)
        return self._layout(u.params, u.logical, u.adapter.param_prefix)

    def leaf_layouts(self, model) -> list[LeafLayout]:
        """Per leaf of the model's parameters and state: path, shape, spec, and which rule
        decided it (a parameter ZeRO cannot shard is listed with its note, never raised)."""
        u = self._unpack(model)
        lay = self._layout(u.params, u.logical, u.adapter.param_prefix, check=False)
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

    def opt_state_layouts(self, opt_state, params, layout: ParamLayout | None = None) -> list[LeafLayout]:
        """Per optimizer-state leaf: path, shape, spec, what decided it and any note.

        A leaf is matched to the parameter whose path is the longest suffix of its own path
        (``0/mu/mlp/w1`` → ``mlp/w1``). Then, in order:

        * a scalar, one-element or empty leaf (step counts, placeholders) is replicated;
        * a leaf of the parameter's shape (Adam's moments, momentum, ``MultiSteps``'
          accumulated gradients) follows the parameter's spec;
        * a leaf of the parameter's shape with one dimension removed or set to 1 (Adafactor's
          factored moments) keeps the parameter's axes on the dimensions it shares with it;
          where two dimensions could have been removed (a square matrix) it keeps only the axes
          both readings agree on;
        * any other leaf (preconditioners, low-rank states, states under no parameter's path)
          starts replicated.

        From ZeRO-1 on, every leaf then gets the data axes it does not use yet on the largest
        dimension they divide, as parameters do under ZeRO-3 (all axes together, else the
        largest one alone). A leaf no dimension of which any data axis divides is an error
        under ``strict`` (raised by ``opt_state_specs``; listed here with its note), unless
        it has fewer than 128 elements per data device; otherwise it is replicated with a note.

        Args:
            opt_state: the optimizer state (arrays or ``ShapeDtypeStruct``s, e.g.
                ``jax.eval_shape(tx.init, params)``).
            params: the parameters it was built from (a tree, NNX module or Linen variables).
            layout: the parameters' resolved layout, when the caller has it.
        """
        return _zero.opt_layout(self, opt_state, params, layout, check=False)[1]

    def opt_state_specs(self, opt_state, params, layout: ParamLayout | None = None):
        """Optimizer-state specs, leaf by leaf as ``opt_state_layouts`` places them: a
        parameter's moments follow it, factored moments the dimensions they keep, and from
        ZeRO-1 on every leaf is sharded over the data axes.

        Raises:
            ShardingError: under ``strict``, every leaf ZeRO cannot shard (no dimension
                divisible by the data axes) and not small enough to replicate, in one error.
        """
        treedef, rows = _zero.opt_layout(self, opt_state, params, layout, check=True)
        return jax.tree_util.tree_unflatten(treedef, [r.spec for r in rows])

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
        return self._axis_table.spec(names, mesh_sizes=dict(self.mesh.shape))

    def constrain(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        """``with_sharding_constraint`` on ``x`` by logical axis names; axes that do not divide
        the dimension are dropped for that array (activations vary in shape, e.g. the last
        microbatch of decoding), so the constraint never fails a compile."""
        if len(names) != x.ndim:
            raise ValueError(f"constrain: {len(names)} names {tuple(names)} for an array of rank {x.ndim}")
        spec = self._axis_table.spec(names, x.shape, dict(self.mesh.shape), lenient=True)
        _axes.claim_axes(*spec_axes(spec))
        # Inside a shard_map (e.g. sk.pipeline's stages) some axes are manual: constrain only
        # over the others, on the context's abstract mesh.
        context = jax.sharding.get_abstract_mesh()
        manual = set() if context.empty else {
            a for a, t in zip(context.axis_names, context.axis_types) if t == jax.sharding.AxisType.Manual}
        if manual and len(manual) == len(context.axis_names):
            # Every axis is manual (a building block's shard_map over the whole mesh, e.g.
            # sk.moe's experts on expert=8): nothing is left for the compiler to place, and a
            # constraint there (vmap adds an UNCONSTRAINED dim) is rejected by JAX.
            return x
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

    def describe(self, model, opt_state=None):
        """A table of each leaf's path, shape, spec, per-device shape and deciding rule (a
        ``rich`` Table; ``print()`` renders it as text, notebooks as HTML).

        Args:
            model: the parameters (a tree, NNX module or Linen variables, or ``state.params``
                of a model a step of this plan was initialised with: it is resolved as that
                model, logical axis names included).
            opt_state: the optimizer state built from them (e.g. ``jax.eval_shape(tx.init,
                params)``): its leaves are listed too, under ``opt_state/``. Leaves ZeRO
                cannot shard are listed with a note here instead of raising.
        """
        return _describe.table(self, model, opt_state)

    def __repr__(self) -> str:
        axes = ",".join(f"{n}={s}" for n, s in self.mesh.shape.items())
        offload = f", offload={self.offload}" if self.offload else ""
        unused = f", unused_axes={self.unused_axes}" if self.unused_axes else ""
        return (f"Plan(mesh='{axes}', zero={self.zero}, precision={self.precision.name!r}, "
                f"batch_axes={self.batch_axes}{offload}{unused})")


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation by logical axis names through the active plan (inside a
    shardkit step); outside one it returns ``x`` unchanged, so models run anywhere."""
    plan = _ACTIVE.get()
    return x if plan is None else plan.constrain(x, names)


def active_plan() -> Plan | None:
    """The plan whose step is being traced, if any."""
    return _ACTIVE.get()


def noted(key: str) -> Any:
    """What the step being traced has noted under ``key`` so far (None outside a trace)."""
    notes = _NOTES.get()
    return None if notes is None else notes.get(key)


def note(key: str, value: Any) -> None:
    """Records a fact about the program being traced (e.g. ``sk.pipeline``'s microbatches and
    schedule) for ``explain()``; a no-op outside a shardkit step's trace."""
    notes = _NOTES.get()
    if notes is not None:
        notes[key] = value


def noting(detail: bool = False) -> bool:
    """Whether ``note()`` calls are being collected (a shardkit step is being traced); with
    ``detail``, whether the costlier facts are wanted too (``detailed_notes``)."""
    return _NOTES.get() is not None and (not detail or _DETAIL.get())


@contextlib.contextmanager
def detailed_notes():
    """Inside, ``noting(detail=True)``: a trace for an estimate that reads traced sub-programs
    (``sk.pipeline``'s backward op for a GPU/TPU target), which an ordinary trace skips."""
    token = _DETAIL.set(True)
    try:
        yield
    finally:
        _DETAIL.reset(token)


@contextlib.contextmanager
def collecting_notes():
    """Collects ``note()`` calls made while tracing inside this context into a dict."""
    notes: dict = {}
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)
