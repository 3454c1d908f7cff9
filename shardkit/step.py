"""``@train_step``: a user's loss function → one compiled, sharded, donated SPMD train step.

The step casts parameters and float inputs to the compute dtype, takes gradients in the grads
dtype (accumulating microbatches in f32 with ``lax.scan``), unscales them under fp16, clips the
global norm, runs the Optax update on ZeRO's shards and writes everything back in the layout the
plan gives. Under ``jax.jit`` with explicit in/out shardings, XLA's SPMD partitioner inserts the
collectives (all-reduce for DP, reduce-scatter for ZeRO-2, all-gather for ZeRO-3, Megatron's
all-reduces for TP).
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import PartitionSpec as P

from . import _axes, _model, _update, offload
from .diloco import DiLoCo, DiLoCoStep
from .plan import ParamLayout, Plan, collecting_notes
from .precision import LossScale, cast_floats, cast_input
from .rules import ShardingError, spec_axes
from .xla import GPU_MEMORY_FRACTION, compiler_options, target_platform


@struct.dataclass
class TrainState:
    """Everything a training run carries from step to step (a pytree; checkpoint it whole).

    Attributes:
        step: number of steps taken (int32 scalar).
        params: trainable parameters in the plan's layout and the master dtype.
        opt_state: the Optax state, moments sharded like their parameters (plus ZeRO).
        model_state: non-trainable model variables (BatchNorm statistics, NNX RNG state).
        rng: raw key data of the base PRNG key; each step folds in its step number.
        skipped: steps whose update was skipped because the loss or gradients were not finite.
        streak: consecutive skipped steps (reset by a finite step).
        loss_scale: the dynamic loss scale under fp16, else None.
        outer: ``sk.DiLoCo``'s outer parameters and optimizer state (``diloco.OuterState``),
            else None. Under DiLoCo every per-replica field (params, opt_state, model_state,
            skipped, streak, loss_scale) has a leading replica dimension.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array
    skipped: jax.Array
    streak: jax.Array
    loss_scale: LossScale | None = None
    outer: Any = None


_CPU_MAX_IN_FLIGHT = 2


def _signature(batch) -> tuple:
    """What selects a compiled step for a batch: its structure, shapes and (canonical) dtypes."""
    leaves, treedef = jax.tree.flatten(batch)
    return treedef, tuple((tuple(x.shape), jax.dtypes.canonicalize_dtype(x.dtype)) for x in leaves)


def _in_flight_queue(plan: Plan):
    """The queue that bounds steps in flight on XLA:CPU (see ``__call__``); None elsewhere.
    An AbstractMesh names its platform in ``abstract_device`` (or nothing: it never runs)."""
    device = plan.mesh.abstract_mesh.abstract_device
    return collections.deque() if device is None or device.platform == "cpu" else None


class NonFiniteError(FloatingPointError):
    """Too many consecutive non-finite steps. ``.state`` holds a good state: the skipped
    steps left it unchanged, and the one step run after them (the check reads a step late)
    was skipped too or applied a finite update."""

    def __init__(self, msg: str, state: TrainState):
        super().__init__(msg)
        self.state = state


class TrainStep:
    """The object ``@sk.train_step`` returns: ``init``, ``__call__``, ``lower``, ``explain``.

    ``gpu_memory_fraction`` (default ``sk.xla.GPU_MEMORY_FRACTION``, 0.95): the share of a GPU
    XLA:GPU may plan the step for before it recomputes values (``xla.compiler_options``; its
    own limit is ~76% of the device), on the GPU and in GPU-target compiles (``explain``,
    ``sk.cost.simulate``, ``sk.search(verify=)``); set it on the step before it compiles,
    ``None`` for XLA's limit. Run with ``XLA_PYTHON_CLIENT_MEM_FRACTION`` at least as large."""

    gpu_memory_fraction: float | None = GPU_MEMORY_FRACTION

    def __init__(self, fn: Callable, plan: Plan, optimizer: optax.GradientTransformation, *,
                 microbatches: int = 1, clip_norm: float | None = None,
                 skip_nonfinite: bool = False, max_nonfinite: int | None = None, donate: bool = True,
                 outer=None, gpu_memory_fraction: float | None = GPU_MEMORY_FRACTION):
        _update.check_options(plan, optimizer, microbatches, clip_norm, max_nonfinite)
        compiler_options("gpu", gpu_memory_fraction)  # a bad fraction fails here, not at the first compile
        self.gpu_memory_fraction = gpu_memory_fraction
        if outer is not None and plan.offload:
            raise ValueError(f"offload={plan.offload} with outer=sk.DiLoCo(...) is not supported: DiLoCo keeps "
                             "per-replica state on the device; drop one of the two")
        self.fn, self.plan, self.tx = fn, plan, optimizer
        self.microbatches, self.clip_norm, self.donate = microbatches, clip_norm, donate
        self.skip_nonfinite = skip_nonfinite or plan.precision.loss_scaling or max_nonfinite is not None
        self.max_nonfinite = max_nonfinite
        self._takes_rng = "rng" in inspect.signature(fn).parameters
        self._adapter: _model.Adapter | None = None
        self._layout: ParamLayout | None = None
        self._overwrite = None
        self._logical: dict = {}
        self._state_shardings = None
        self._jitted: dict = {}
        self._executables: dict = {}  # step.compile()'s, run by __call__ for batches of their shapes
        self._batch_shardings: dict = {}
        self.trace_notes: dict = {}
        self._in_flight = _in_flight_queue(plan)
        self._last_streak: jax.Array | None = None  # the previous step's, read one step late
        self.outer = outer
        self._diloco = None if outer is None else DiLoCoStep(self, outer)
        functools.update_wrapper(self, fn)

    # ---- initialisation ---------------------------------------------------------------------

    def init(self, model: Any, *, seed: int = 0) -> TrainState:
        """Creates the sharded ``TrainState``.

        Args:
            model: parameters (pytree), an NNX module, Linen variables, or a function building
                one of those (called with no arguments, or with a PRNG key if it takes one).
                A function is traced abstractly first and then run under ``jit`` with the
                plan's output shardings, so a model larger than one device never materialises
                on one device.
            seed: seeds the state's PRNG key (passed to the loss as ``rng`` if it takes one).

        Raises:
            ShardingError: the rules do not cover the model, or specs do not fit the mesh.
        """
        make, args = self._prepare(model, seed)
        make = make if self._diloco is None else self._diloco.wrap_make(make)
        shardings = self.state_shardings(jax.eval_shape(make, *args))
        with self.plan.active():
            state = jax.jit(make, out_shardings=shardings)(*args)
        self._state_shardings, self._last_streak = shardings, None
        return state

    def abstract_state(self, model: Any, *, seed: int = 0) -> TrainState:
        """The ``TrainState`` ``init`` would build, as ``ShapeDtypeStruct``s with shardings and
        without allocating anything: a restore target for checkpoints of large models.

        Args and Raises: as ``init``.
        """
        make, args = self._prepare(model, seed)
        make = make if self._diloco is None else self._diloco.wrap_make(make)
        abstract = jax.eval_shape(make, *args)
        shardings = self.state_shardings(abstract)
        self._state_shardings = shardings
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)

    def _prepare(self, model: Any, seed: int):
        """Resolves the layout and returns ``(make, args)``: ``make(*args)`` builds the state."""
        prec = self.plan.precision
        key = jax.random.key(seed)
        if callable(model) and not isinstance(model, (nnx.Module, dict)) and not hasattr(model, "shape"):
            build = model
            call = (lambda: build(key)) if inspect.signature(build).parameters else build
            with nnx.use_eager_sharding(False):
                self._setup(_model.unpack(nnx.eval_shape(call)))

            def parts():
                with nnx.use_eager_sharding(False):
                    v = _model.unpack(call())
                return v.params, v.model_state
            args = ()
        else:
            u = _model.unpack(model)
            self._setup(u)
            parts, args = (lambda p, s: (p, s)), (u.params, u.model_state)

        def make(*a) -> TrainState:
            params, model_state = parts(*a)
            params = cast_floats(params, prec.params)
            zero = jnp.zeros((), jnp.int32)
            return TrainState(
                step=zero, params=params, opt_state=self._cast_opt(self.tx.init(params)),
                model_state=model_state, rng=jax.random.key_data(key), skipped=zero, streak=zero,
                loss_scale=LossScale.create(prec) if prec.loss_scaling else None)
        return make, args

    def _setup(self, u: _model.Unpacked):
        self._adapter, self._logical = u.adapter, u.logical
        self._layout = self.plan._layout(u.params, u.logical, u.adapter.param_prefix)
        if self.plan.precision.fp8 and not u.overwrite:
            raise ValueError("precision='fp8' but the model has no fp8 matmul (sk.fp8.Fp8Dot): the step cannot "
                             "rewrite a model's matmuls; use sk.fp8.Fp8Dot where they should run in fp8, or "
                             "precision='bf16'")
        # Parameters the step overwrites with their gradient (sk.fp8's amax histories).
        self._overwritten = [l.path in u.overwrite for l in self._layout.leaves]
        self._overwrite = self._layout.tree(self._overwritten) if u.overwrite else None
        self.plan.state_specs(u.model_state, u.logical)  # validates the model state's rules now
        if self._diloco is not None:
            self._diloco.setup()

    def _specs(self, kind: str):
        lay, zero = self._layout, self.plan.zero
        base = [l.spec for l in lay.leaves]
        use_zero = {"params": zero >= 3, "grads": zero >= 2, "update": zero >= 1}[kind]
        # ZeRO shards nothing the step overwrites (sk.fp8's histories: a few floats, never
        # optimized): a sharded history's gradient would move inside the layer loop, where
        # each matmul reads its scales (tests/test_fp8.py, the recipe on H100).
        return lay.tree([b if o else z for z, b, o in zip(lay.zero_specs, base, self._overwritten)]
                        if use_zero else base)

    def _param_shardings(self, kind: str = "params"):
        return self.plan.shardings(self._specs(kind))

    def _opt_shardings(self, params, memory: bool = True):
        """The optimizer state's shardings; in host memory where the plan offloads it
        (``memory=False``: the same specs in device memory, where the update runs)."""
        abstract = jax.eval_shape(self.tx.init, params)
        shardings = self.plan.shardings(self.plan.opt_state_specs(abstract, params, self._layout))
        return offload.to_host(shardings) if memory and "opt_state" in self.plan.offload else shardings

    def _cast_opt(self, opt_state):
        dtype = self.plan.precision.opt_state
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x,
                            opt_state)

    def state_shardings(self, state: TrainState):
        """The ``NamedSharding`` of every leaf of ``state`` under this plan (for restores)."""
        self._require_init()
        if self._diloco is not None:
            return self._diloco.state_shardings(state)
        rep = self.plan.sharding(P())
        return TrainState(
            step=rep, params=self._param_shardings(), opt_state=self._opt_shardings(state.params),
            model_state=self.plan.shardings(self.plan.state_specs(state.model_state, self._logical)),
            rng=rep, skipped=rep, streak=rep,
            loss_scale=None if state.loss_scale is None else LossScale(rep, rep))

    def model(self, state: TrainState):
        """What the loss function receives, rebuilt from ``state`` (an NNX module, Linen
        variables or the parameter tree), in the master dtype. Under DiLoCo: the outer
        parameters θ_outer (``step.diloco.consensus``)."""
        self._require_init()
        if self._diloco is not None:
            state = self._diloco.consensus(state)
        return self._adapter.assemble(state.params, state.model_state)

    def with_plan(self, plan: Plan) -> "TrainStep":
        """This step — same loss, optimizer, options and the model structure ``init`` learned —
        laid out by another ``plan``, e.g. one on a ``jax.sharding.AbstractMesh`` to compile
        for a mesh that is not here (``sk.cost.simulate``).

        Raises:
            ShardingError: the plan's rules do not fit the model on its mesh.
        """
        self._require_init()
        if not isinstance(plan, Plan):
            raise ValueError(f"with_plan needs an sk.Plan, got {type(plan).__name__}")
        new = copy.copy(self)
        new.plan, new._in_flight, new._last_streak = plan, _in_flight_queue(plan), None
        new._jitted, new._batch_shardings, new._state_shardings, new.trace_notes = {}, {}, None, {}
        new._executables = {}
        lay = self._layout
        params = lay.tree([jax.ShapeDtypeStruct(l.shape, l.dtype) for l in lay.leaves])
        new._layout = plan._layout(params, self._logical, self._adapter.param_prefix)
        if self._diloco is not None:  # the replicas' machinery, rebuilt on the new plan
            new._diloco = None
            new._diloco = DiLoCoStep(new, self._diloco.outer)
            new._diloco.setup()
        return new

    @property
    def diloco(self) -> DiLoCoStep | None:
        """With ``outer=sk.DiLoCo(...)``: its programs (``hlo``) and replica-axis bytes (``traffic``)."""
        return self._diloco

    def _require_init(self):
        if self._adapter is None:
            raise RuntimeError("call step.init(model_or_init_fn) first: the step learns the model's structure there")

    # ---- what analysis reads (sk.cost, explain) ------------------------------------------------

    @property
    def layout(self) -> ParamLayout:
        """Each parameter leaf's path, shape, resolved spec and ZeRO shard (after ``init``)."""
        self._require_init()
        return self._layout

    def specs(self, kind: str):
        """PartitionSpecs of the parameters as ``kind`` lays them out: ``"params"`` (stored),
        ``"grads"`` (reduced gradients) or ``"update"`` (the optimizer's shard)."""
        self._require_init()
        if kind not in ("params", "grads", "update"):
            raise ValueError(f"specs(kind={kind!r}): kind is 'params', 'grads' or 'update'")
        return self._specs(kind)

    def microbatch_loss(self, state: TrainState) -> Callable:
        """``(params, microbatch) -> loss``: the loss exactly as the step differentiates it
        (parameters in the gradient dtype, cast to compute; a fixed key when the loss takes
        ``rng``), for tracing — e.g. ``jax.make_jaxpr`` of its gradient."""
        self._require_init()
        key = jax.random.key(0) if self._takes_rng else None
        return lambda params, batch: self._loss(params, state.model_state, batch, key, None)[0]

    def step_function(self) -> Callable:
        """The un-jitted ``(state, batch) -> (state, metrics)`` the step compiles (to trace it
        under other shardings, e.g. ``jax.export`` for a simulated mesh)."""
        self._require_init()
        return self._step

    def place_batch(self, batch):
        """``(batch on the plan's batch shardings, the shardings)``: host arrays put on the
        devices (each host's slice under multi-host), arrays already there left as they are."""
        return self._place_batch(batch)

    # ---- the compiled step ------------------------------------------------------------------

    def _place_batch(self, batch):
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, tuple(tuple(getattr(x, "shape", ())) for x in leaves))
        shardings = self._batch_shardings.get(key)
        if shardings is None:  # validated once per batch structure and shape
            shardings = self.plan.shardings(self.plan.batch_specs(_update.global_view(batch, self.plan), self.microbatches))
            self._batch_shardings[key] = shardings

        def put(x, s):
            x = cast_input(x)
            if isinstance(x, jax.Array):
                return x if x.sharding == s else jax.device_put(x, s)
            if jax.process_count() > 1:  # each host holds its slice of the global batch
                return jax.make_array_from_process_local_data(s, x)
            return jax.device_put(x, s)
        return jax.tree.map(put, batch, shardings), shardings

    def _compiled_fn(self, state: TrainState, batch_shardings):
        key = jax.tree.structure(batch_shardings)
        if key not in self._jitted:
            state_sh = self._state_shardings or self.state_shardings(state)
            self._jitted[key] = jax.jit(
                self._step, in_shardings=(state_sh, batch_shardings),
                out_shardings=(state_sh, self.plan.sharding(P())),
                donate_argnums=(0,) if self.donate else (),
                compiler_options=compiler_options(target_platform(), self.gpu_memory_fraction) or None)
        return self._jitted[key]

    def lower(self, state: TrainState, batch) -> jax.stages.Lowered:
        """JAX's ``Lowered`` for this step (``.compile().memory_analysis()``, ``.as_text()``)."""
        self._require_init()
        if self._diloco is not None:
            raise ValueError("a DiLoCo step runs several programs: read them with step.diloco.hlo(state, batch) "
                             "and their replica-axis bytes with step.diloco.traffic(state, batch)")
        batch, shardings = self._place_batch(batch)
        with self.plan.active():
            return self._compiled_fn(state, shardings).lower(state, batch)

    def compile(self, state: TrainState, batch) -> jax.stages.Compiled:
        """This step compiled for ``batch``'s shapes (``.memory_analysis()``, ``.as_text()``),
        and the executable later calls on batches of those shapes run. JAX reuses a lowering's
        compile for a call only while the compile options in effect match; kept here, the
        program whose memory a report read (the recipes' memory line, ``explain``) is the one
        that trains, with no second compile. ``state`` and ``batch`` may be ``ShapeDtypeStruct``s."""
        compiled = self.lower(state, batch).compile()
        self._executables[_signature(batch)] = compiled
        return compiled

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """Runs one step; ``state`` is donated (do not use it afterwards)."""
        self._require_init()
        if not isinstance(state, TrainState):
            raise ValueError(f"expected the TrainState from step.init, got {type(state).__name__}")
        batch, shardings = self._place_batch(batch)
        with self.plan.active():
            if self._diloco is not None:
                new_state, metrics = self._diloco.run(state, batch, shardings)
            else:
                run = self._executables.get(_signature(batch)) if self._executables else None
                new_state, metrics = (run or self._compiled_fn(state, shardings))(state, batch)
        if self._in_flight is not None:
            # XLA:CPU deadlocks in a collective's rendezvous when thousands of steps are queued
            # (seen with jax 0.10 on 8 simulated devices: "only 7 of 8 threads arrived"); keep
            # at most a couple of steps in flight there. Accelerators keep full async dispatch.
            self._in_flight.append(metrics["loss"])
            if len(self._in_flight) > _CPU_MAX_IN_FLIGHT:
                self._in_flight.popleft().block_until_ready()
        if self.max_nonfinite is not None:
            # Reading this step's streak would wait for it to finish and leave the device idle
            # until the host dispatches the next one; the previous step's streak is read
            # instead, once this step is queued behind it (it is done, or nearly).
            previous, self._last_streak = self._last_streak, metrics["nonfinite_streak"]
            if previous is not None and int(previous) >= self.max_nonfinite:
                self._last_streak = None
                raise NonFiniteError(
                    f"{int(previous)} consecutive steps had a non-finite loss or gradients "
                    f"(max_nonfinite={self.max_nonfinite}); their updates were skipped. Lower the "
                    "learning rate, enable clip_norm, or check the data. The state after this "
                    "call's step (applied if it was finite, skipped if not) is in this error's .state",
                    new_state)
        return new_state, metrics

    def explain(self, state: TrainState, batch, *, flops_per_token: float | None = None,
                mesh=None, **simulate):
        """An ``sk.Report``: per-device memory, executed collectives and flops of the compiled
        step, beside the analytic estimate (``flops_per_token``: the model's figure, for one
        token's forward and backward; default 6 × parameters).

        With ``mesh`` (``"data=64,tensor=8"``) the step is compiled for that mesh instead, on
        simulated CPU devices in a subprocess, from abstract inputs: what this exact step
        would cost there. ``**simulate`` goes to ``sk.cost.simulate`` (``zero=``,
        ``batch_axes=``, ``timeout=``)."""
        if mesh is not None:
            from .cost.beside import simulate as _simulate

            return _simulate(self, state, batch, mesh, flops_per_token=flops_per_token, **simulate)
        if simulate:
            raise ValueError(f"explain() takes {sorted(simulate)} only with mesh=... (a simulated layout)")
        from .explain import explain_step

        return explain_step(self, state, batch, flops_per_token=flops_per_token)

    def _loss(self, params_g, model_state, batch, key, scale):
        return _update.loss(self, params_g, model_state, batch, key, scale)

    def _step(self, state: TrainState, batch):
        # Runs at trace time only: what the loss's building blocks note (e.g. sk.pipeline's
        # schedule) is kept for explain().
        # ... and every mesh axis must be used by something, checked before compiling.
        with _axes.checking_axes(self.plan, self._leaf_axes(state)), collecting_notes() as notes:
            out = self._step_body(state, batch)
        self.trace_notes = notes
        if self._overwrite is not None and "pipeline" in notes:
            raise ValueError("sk.fp8's amax histories (Fp8Meta parameters) inside sk.pipeline are not supported: "
                             "the pipeline sums its microbatches' gradients, the histories need their max; "
                             "run the fp8 layers outside the pipeline or use precision='bf16'")
        return out

    def _leaf_axes(self, state: TrainState) -> set[str]:
        """Mesh axes the parameters' and model state's resolved specs use (Flax metadata may
        name mesh axes directly, without a rule)."""
        specs = [l.spec for l in self._layout.leaves]
        specs += jax.tree.leaves(self.plan.state_specs(state.model_state, self._logical),
                                 is_leaf=lambda x: isinstance(x, P))
        return {a for spec in specs for a in spec_axes(spec)}

    def _step_body(self, state: TrainState, batch):
        return _update.step_body(self, state, batch)


def train_step(plan: Plan, optimizer: optax.GradientTransformation, *, microbatches: int = 1,
               clip_norm: float | None = None, skip_nonfinite: bool = False,
               max_nonfinite: int | None = None, donate: bool = True,
               outer: DiLoCo | None = None,
               gpu_memory_fraction: float | None = GPU_MEMORY_FRACTION) -> Callable[[Callable], TrainStep]:
    """Decorates ``loss_fn(model, batch[, rng]) -> loss | (loss, aux)`` into a sharded train step.

    Args:
        plan: the ``sk.Plan`` (mesh, rules, ZeRO stage, precision, batch axes).
        optimizer: any Optax ``GradientTransformation``.
        microbatches: gradient accumulation steps per call (``lax.scan``, f32 accumulation); the
            loss is the mean over microbatches, so it matches one big batch for mean losses.
        clip_norm: clip the global gradient norm (computed over all shards) to this value.
        skip_nonfinite: skip (and count in ``state.skipped``) updates whose loss or gradients
            are not finite. Always on under fp16 loss scaling.
        max_nonfinite: raise ``sk.NonFiniteError`` after this many skipped steps in a row.
            The check does not block the host: a call reads the previous step's count
            (``metrics["nonfinite_streak"]``) after queueing its own step, so the error comes
            at most one step late — from the call after the ``max_nonfinite``-th skip — and
            that extra step cannot corrupt the state (skipped if non-finite, a normal update
            if not). The last step of a run is not checked: read its
            ``metrics["nonfinite_streak"]`` if it matters.
        donate: donate the input state's buffers to the output (halves peak state memory).
        outer: an ``sk.DiLoCo``: the optimizer above becomes each replica's inner optimizer,
            replicas train alone for ``every`` steps and then sync over the DiLoCo axis
            (``step.diloco`` has its programs and their traffic; metrics add the replicas'
            ``replica_loss`` and ``diloco/replica_bytes``, ``diloco/steps_to_sync``,
            ``diloco/synced_fragment``).
        gpu_memory_fraction: the share of a GPU's memory XLA:GPU may plan the step for before
            it recomputes values (``TrainStep.gpu_memory_fraction``; ``None``: XLA's own ~76%).

    Returns:
        A decorator producing a ``TrainStep``: ``init``, ``__call__``, ``lower``, ``explain``.

    The loss receives the model in the compute dtype: the parameter tree, an NNX module (its
    mutations of non-parameter variables, e.g. BatchNorm statistics, are kept) or Linen
    variables (with mutable collections, return ``(loss, aux, updated_collections)``). A loss
    with an ``rng`` parameter gets a fresh key each step (and each microbatch).
    """
    _update.check_options(plan, optimizer, microbatches, clip_norm, max_nonfinite)

    def wrap(fn: Callable) -> TrainStep:
        return TrainStep(fn, plan, optimizer, microbatches=microbatches, clip_norm=clip_norm,
                         skip_nonfinite=skip_nonfinite, max_nonfinite=max_nonfinite, donate=donate,
                         outer=outer, gpu_memory_fraction=gpu_memory_fraction)
    return wrap


__all__ = ["TrainState", "TrainStep", "train_step", "NonFiniteError", "ShardingError"]
