"""The cost model: what a layout costs per device — memory, collective bytes, flops, step time.

Two kinds of figures, always labelled:

* **compiled** — read from an XLA program: ``step.explain()`` compiles this exact step;
  ``simulate``/``step.explain(mesh=..., target=...)`` compiles it for a mesh that does not
  exist here, by the compiler of the accelerator named (XLA:GPU for ``"h100"``, XLA:TPU for
  ``"tpu-v5p"``, deviceless; ``"cpu"``: N simulated CPU devices), in a subprocess, from
  abstract inputs, nothing allocated.
* **modelled** — one set of per-role formulas (``roles``: ZeRO state, data and tensor-parallel
  traffic, step temporaries, activations, MoE and context traffic), fed either by a
  ``ModelShape`` (``from_shape.estimate``, ``search``: thousands of layouts in seconds) or by a
  real step's leaf sums and traced program (``from_step``, ``estimate_for_step``). Step time is only ever modelled: ``steptime`` turns flops and
  collective bytes into seconds with each accelerator's ``Efficiency`` and link table.

The house, one folder per job, imports pointing down (``docs/cost_house.md``):

* at the top, shared by all: ``terms`` (ModelShape, Layout, Estimate, the collective roles and
  ``RoleTraffic``), ``hardware`` (accelerator figures), ``flash_flops`` (a flash kernel call's
  flops, which the program reader and the compiled-HLO reader both count) and ``pipeline_note``
  (``sk.pipeline``'s trace note and the schedule table it runs, which the analytic model and
  the compiled-HLO reader both read);
* ``program/``: reading the traced jaxpr (``reader`` and its rules);
* ``analytic/``: the modelled figures (``roles``, ``from_shape``, ``diloco_cost``, ``from_step``,
  ``leaf_sizes``, ``pipeline_cost``, ``pipeline_memory``, ``gpu_combining``, ``caveats``,
  ``steptime``), reading the program through ``program/``;
* ``compiled/``: the compiled figures (``targets``, ``child``, ``simulated``, ``hlo/``,
  ``executable``, ``report``, ``bands``), which never import ``analytic/``;
* ``beside``: the one join — the estimate set beside a compiled report (``simulate``);
* ``search/``: ``rank`` (layout search) and ``plan_cli`` (``shardkit plan``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import hardware as hardware
from .analytic.from_shape import estimate as estimate
from .analytic.roles import activation_bytes as activation_bytes
from .terms import (DECODER_SIZES as DECODER_SIZES, ROLES as ROLES, Estimate as Estimate,
                     Layout as Layout, ModelShape as ModelShape, model_shape as model_shape,
                     tokens_in as tokens_in)
from .analytic.steptime import (EFFICIENCY as EFFICIENCY, LINKS as LINKS, ROOFLINE as ROOFLINE,
                       Efficiency as Efficiency, collective_time as collective_time,
                       efficiency_for as efficiency_for, register_efficiency as register_efficiency,
                       register_links as register_links, times as times)

__all__ = ["Efficiency", "Estimate", "Layout", "ModelShape", "estimate", "estimate_for_step",
           "model_shape", "collective_time", "search", "simulate", "simulate_many", "SimulationError", "DoesNotFit",
           "TARGETS", "TargetError", "weak_scaling", "plan_main", "DECODER_SIZES",
           "EFFICIENCY", "ROOFLINE", "register_efficiency", "register_links", "hardware"]
hw_lib = hardware

if TYPE_CHECKING:
    from .search.rank import SearchResult


def estimate_for_step(step, state, batch, *, pipeline: tuple[int, str, int] | None = None,
                      hardware: str | hw_lib.Hardware | None = None,
                      flops_per_token: float | None = None) -> Estimate:
    """The analytic estimate for a ``sk.train_step`` on its plan, leaf by leaf.

    Parameter, gradient and optimizer-state bytes follow ZeRO's accounting on each leaf's
    resolved spec (Rajbhandari et al. 2020); temporaries are the larger of the backward phase
    (gradient buffer + saved activations, + one gathered layer and its full gradient under
    ZeRO-3) and the update phase (gradient buffer + new parameters before they are written
    back); tensor-parallel traffic follows Megatron's rule (Shoeybi et al. 2019): every
    row-parallel weight (a tensor-sharded dim that is not its last) costs one all-reduce of
    its output in the forward pass and one of its block's input gradient in the backward pass.

    Args:
        step: the ``TrainStep`` (after ``step.init``).
        state: its ``TrainState`` (arrays or ``ShapeDtypeStruct``s).
        batch: one global batch (shapes are enough).
        pipeline: overrides ``(microbatches, schedule, repeats)`` (or a dict like the note) of
            the ``sk.pipeline`` inside the loss; by default read from ``step.trace_notes``
            (the step is lowered once if it has not been traced yet).
        hardware: the accelerator for the time estimate (default: the plan's devices; a CPU
            mesh is timed as H100s).
        flops_per_token: training flops per token; default 6 × parameters (Kaplan et al.).

    Returns:
        An ``Estimate``; ``.as_dict()`` uses ``Report.comparison``'s quantity names.
    """
    from .analytic.from_step import step_estimate

    return step_estimate(step, state, batch, pipeline=pipeline, hardware=hardware,
                         flops_per_token=flops_per_token)


def search(model: Any, devices: int, hardware: str | hw_lib.Hardware = "h100", *,
           global_batch: int, memory_limit: float | None = None, seq: int | None = None,
           precision: str = "bf16", top: int | None = None, **options) -> "SearchResult":
    """Ranks every layout of ``model`` on ``devices`` accelerators by estimated step time.

    Enumerates ``data × fsdp × context × tensor × pipe`` factorizations of ``devices`` (tensor
    within a node, context where the sequence is long), ZeRO stages, microbatches, remat
    policies, pipeline schedules with their chunks per stage and, for the explicit ones, what
    each in-flight microbatch keeps (``Layout.keep``); see ``search.candidates.layouts``.

    Args:
        model: a recipe size name (``"1b"``, ``"7b"``), a recipe ``Config``, a
            ``ModelShape``, or a parameter pytree (give ``flops_per_token=`` then).
        devices: accelerator count.
        hardware: a ``HARDWARE`` name or a ``Hardware``.
        global_batch: sequences (examples) per step.
        memory_limit: per-device bytes a layout may use (default: the chip's HBM × 0.9).
        seq: tokens per sequence (default: the model's).
        precision: a ``sk.Precision`` preset.
        top: keep only the best ``top`` rows.
        **options: restrict the enumeration (``zero=(1, 3)``, ``remat=("none",)``,
            ``microbatches=(1, 8)``, ``tensor=(1, 8)``, ``pipe=(1,)``, ``context=(1, 16)``,
            ``repeats=(4, 8)``, ``keep=("input", "all")``, ``schedules=``, ``flops_per_token=``),
            or verify the best ones: ``verify=k`` compiles the top ``k`` layouts on simulated
            meshes (``simulate``) and re-ranks them by compiled peak memory (layouts that do
            not fit go last) and by the step time re-timed with their compiled collective
            bytes; the step comes from ``build=layout -> (step, state, batch)`` (a step
            planned on ``abstract_mesh(layout.mesh)``: the way to honour remat, schedules,
            ``keep`` and sequence parallelism), or ``step=, state=, batch=`` (re-planned on each
            layout's mesh, ZeRO stage and microbatches); ``timeout=`` per compile.

    Returns:
        A ``SearchResult``: ``.rows`` (ranked dicts), ``.best``, ``.verified``, printable as a
        rich table (analytic and, with ``verify``, compiled columns).
    """
    from .search.rank import search as _search

    return _search(model, devices, hardware, global_batch=global_batch, memory_limit=memory_limit,
                   seq=seq, precision=precision, top=top, **options)


def weak_scaling(model: Any, layout: Layout, hardware: str | hw_lib.Hardware = "h100", *,
                 per_device_batch: float, devices=(8, 64, 256), **kw) -> list[dict]:
    """Predicted weak-scaling efficiency: tokens/s per device at N devices over that at the
    smallest N, growing the data axis (and the global batch) with N."""
    from .search.rank import weak_scaling as _ws

    return _ws(model, layout, hardware, per_device_batch=per_device_batch, devices=devices, **kw)


def plan_main(argv: list[str], build_for=None) -> int:
    """``shardkit plan``: rank layouts of a bundled recipe size on N accelerators;
    ``build_for(size, global_batch, seq, precision, target)`` gives ``--verify`` the recipe's
    step builder (``plan_cli.plan_main``)."""
    from .search.plan_cli import plan_main as _main

    return _main(argv, build_for=build_for)


# Each module of the package by its name (``sk.cost.bands``, ``sk.cost.targets``,
# ``sk.cost.steptime``), wherever it lives, as the README writes them.
_SUBPACKAGES = ("compiled", "program", "analytic", "search")


def __getattr__(name):
    if name == "SearchResult":
        from .search.rank import SearchResult

        return SearchResult
    # Imported on first use: a plain ``import shardkit`` stays light, and the compiling
    # subprocess (``python -m shardkit.cost.compiled.child``) does not find its module imported twice.
    if name in ("simulate", "simulate_many"):
        from . import beside

        return getattr(beside, name)
    if name in ("SimulationError", "DoesNotFit", "abstract_mesh"):
        from .compiled import simulated

        return getattr(simulated, name)
    import importlib
    import importlib.util

    if name in ("TARGETS", "TargetError"):
        return getattr(importlib.import_module(f"{__name__}.compiled.targets"), name)
    # Any module of the package as an attribute, without importing them all with ``import shardkit``.
    if not name.startswith("_"):
        for where in ("", *(f".{p}" for p in _SUBPACKAGES)):
            if importlib.util.find_spec(f"{__name__}{where}.{name}") is not None:
                return importlib.import_module(f"{__name__}{where}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
