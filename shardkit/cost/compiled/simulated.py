"""Compiled figures for a mesh that is not here: the step is compiled for N devices of a target
that need not be present — the GPU or TPU compiler itself, deviceless (``targets``), or N
simulated CPU devices.

XLA's buffer assignment and collective choices are only modelled by XLA itself, so for a
layout that does not exist yet (``data=64,tensor=8`` on a laptop) the step is compiled for it:

1. the step is re-planned on a ``jax.sharding.AbstractMesh`` of the target sizes (same rules,
   precision and ZeRO stage unless overridden; ``TrainStep.with_plan``);
2. traced with abstract inputs (``ShapeDtypeStruct``\\ s with the new shardings: nothing is
   allocated) and exported for the target's platform (``jax.export``: ``cuda``, ``tpu``,
   ``cpu``);
3. a subprocess (``python -m shardkit.cost.compiled.child``) makes N compile-only devices of the
   target (a GPU target config or a TPU slice topology; for ``cpu``, N simulated CPU devices),
   compiles the module with the step's donation and reads memory, collectives (through
   loops) and flops off the compiled program (``explain.report_from_compiled``), returning a
   small JSON summary — never the HLO itself. The user's process keeps its own backend.

With ``target="cpu"`` what is read is XLA:CPU's program: the collectives it picks (an
all-reduce plus a slice where a GPU reduce-scatters) and its buffers (it runs 16-bit dots in
f32). The report says which compiler it read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P

from .branches import BranchCollective
from .hlo.collectives import Collective, Traffic
from .report import Report, shard_bytes
from ...mesh import parse_mesh_spec
from ... import offload
from ...plan import Plan, detailed_notes
from ...xla import compiler_options
from . import targets as targets_lib
from .child import DoesNotFit as DoesNotFit, SimulationError as SimulationError, compile_error, run_child

MAX_DEVICES = 4096
# Compile-only GPU/TPU devices are descriptions, not threads: far more of them fit.
MAX_TARGET_DEVICES = 65536
_CPU = AbstractDevice(device_kind="cpu", num_cores=None, platform="cpu")
# ``batch_axes=SAME``: the step's own batch axes (re-derived where they were the default).
SAME: Any = object()
# What a caller sets beside a report's compiled figures: ``beside(report, step, state, batch,
# hardware=)`` with the re-planned step and its abstract inputs (``shardkit.cost.beside``).
Beside = Callable[..., None]
_CPU_NOTE = ("XLA:CPU's program: its collective choices (all-reduce + slice where GPUs "
             "reduce-scatter) and buffers (16-bit dots run in f32)")


def abstract_mesh(spec, *, max_devices: int = MAX_DEVICES, target="cpu") -> AbstractMesh:
    """An ``AbstractMesh`` (Auto axis types) of ``target``'s devices for a mesh spec.

    Args:
        spec: ``"data=64,tensor=8"``, a dict or ``(axis, size)`` pairs (no ``-1``), or an
            ``AbstractMesh`` / ``Mesh`` whose sizes and names are taken.
        max_devices: refuse larger meshes (each simulated device is a thread in the compiler).
        target: whose devices (``sk.cost.targets``; a step traced on the mesh sees their
            platform in ``sk.target_platform()``).

    Raises:
        ValueError: a malformed spec, or more than ``max_devices`` devices.
    """
    if isinstance(spec, (jax.sharding.Mesh, AbstractMesh)):
        pairs = list(spec.shape.items())
    else:
        pairs = parse_mesh_spec(spec)
    n = math.prod(s for _, s in pairs)
    if n > max_devices:
        raise ValueError(f"mesh {spec!r} has {n} devices; simulate() compiles for at most "
                         f"max_devices={max_devices} simulated CPU devices. Pass a larger "
                         "max_devices= if this machine has the memory for it")
    names = tuple(a for a, _ in pairs)
    t = targets_lib.get(target)
    device = _CPU if t.platform == "cpu" else AbstractDevice(device_kind=t.name, num_cores=None,
                                                              platform=t.device_platform)
    return AbstractMesh(tuple(s for _, s in pairs), names, axis_types=(AxisType.Auto,) * len(names),
                        abstract_device=device)


def simulated_plan(plan: Plan, mesh: AbstractMesh, *, zero: int | None = None,
                   batch_axes=SAME) -> Plan:
    """``plan`` on another mesh: same rules, axis rules, precision and strictness; ``zero`` and
    ``batch_axes`` kept unless given. Batch axes the plan derived by default (the mesh's
    data-like axes) are derived again for the new mesh."""
    if batch_axes is SAME:
        default = Plan(plan.mesh, rules=plan.rules, axis_rules=plan.axis_rules).batch_axes
        batch_axes = None if plan.batch_axes == default else plan.batch_axes
    return Plan(mesh, rules=plan.rules, axis_rules=plan.axis_rules,
                zero=plan.zero if zero is None else zero, precision=plan.precision,
                batch_axes=batch_axes, strict=plan.strict, offload=plan.offload)


@contextlib.contextmanager
def _on(plan: Plan):
    """``plan.active()`` with its abstract mesh current (``jax.set_mesh`` takes concrete
    meshes only; ``sk.pipeline``'s shard_map and ``sk.constrain`` read the abstract one)."""
    with plan.active(), jax.sharding.use_abstract_mesh(plan.mesh):
        yield


def abstract_inputs(step, state, batch):
    """``(state, batch)`` as ``ShapeDtypeStruct``\\ s with ``step.plan``'s shardings (float64
    host arrays become float32, as the step casts them)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    state_sh = step.state_shardings(abstract)
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, state_sh)

    def host(x):
        dtype = np.dtype(x.dtype)
        return jax.ShapeDtypeStruct(np.shape(x), np.float32 if dtype == np.float64 else dtype)
    batch = jax.tree.map(host, batch)
    batch_sh = step.plan.batch_shardings(batch, step.microbatches)
    batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, batch_sh)
    return state, batch


def _export(step, state, batch, platform: str = "cpu") -> jax.export.Exported:
    """The step as a module for ``platform`` over flat leaves (built-in containers only, so it
    serializes without registering TrainState). Donation is not exported: the child adds it."""
    state_leaves, state_tree = jax.tree.flatten(state)
    batch_leaves, batch_tree = jax.tree.flatten(batch)

    # A DiLoCo step's every-step program is its inner step (the replicas apart, metrics per
    # replica); its syncs are other programs, run once per interval.
    body = step.step_function() if step.diloco is None else step.diloco._inner_fn
    metrics = P() if step.diloco is None else P(step.diloco.axis)

    def flat(state_leaves, batch_leaves):
        new_state, metrics = body(state_tree.unflatten(state_leaves), batch_tree.unflatten(batch_leaves))
        return jax.tree.leaves(new_state), jax.tree.leaves(metrics)

    fn = jax.jit(flat, in_shardings=([x.sharding for x in state_leaves], [x.sharding for x in batch_leaves]),
                 out_shardings=([x.sharding for x in state_leaves], step.plan.sharding(metrics)))
    # Pallas Triton kernels (sk.attention on a GPU target) and ragged all-to-alls (sk.moe's
    # dropless dispatch on a target) are custom calls jax.export does not promise to keep
    # stable across versions; the module is compiled at once by this very jax.
    unstable = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
                jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    with _on(step.plan):
        return jax.export.export(fn, platforms=[platform], disabled_checks=unstable)(state_leaves, batch_leaves)


def _pipeline_note(step) -> dict | None:
    """``sk.pipeline``'s trace note of the program exported (a DiLoCo step's is its replicas')."""
    return (step.trace_notes if step.diloco is None else step.diloco.inner.trace_notes).get("pipeline")


def _groups(state) -> dict[str, list[int]]:
    """Indices of the state's flat leaves by kind (``params``, ``opt_state``, ``model_state``)."""
    labels = jax.tree.map(lambda _: "", state)
    labels = labels.replace(**{k: jax.tree.map(lambda _, k=k: k, getattr(state, k))
                               for k in ("params", "opt_state", "model_state")})
    out: dict[str, list[int]] = {"params": [], "opt_state": [], "model_state": []}
    for i, label in enumerate(jax.tree.leaves(labels)):
        if label:
            out[label].append(i)
    return out


def simulate(step, state, batch, mesh, *, zero: int | None = None, batch_axes=SAME,
             microbatches: int | None = None, beside: Beside | None = None, timeout: float = 1800.0,
             max_devices: int | None = None, target: str = "cpu") -> Report:
    """The compiled figures of ``shardkit.cost.simulate`` (its arguments, but ``beside``).

    Args:
        beside: ``beside(report, step, state, batch, hardware=)`` sets figures beside the
            compiled ones, the re-planned ``step`` and its abstract inputs at hand
            (``shardkit.cost.beside``: the analytic estimate); ``hardware`` is the target's
            accelerator name, None for simulated CPU devices.
    """
    tgt = targets_lib.get(target)
    job = _prepare(step, state, batch, mesh, tgt, zero=zero, batch_axes=batch_axes,
                   microbatches=microbatches, max_devices=max_devices, detail=beside is not None)
    out = run_child([job.module], [job.request], timeout=timeout)[0]
    if "error" in out:
        raise compile_error(out)
    return _assemble(job, out, beside=beside)


def simulate_many(jobs, *, target: str = "cpu", beside: Beside | None = None,
                  timeout: float = 3600.0) -> list[Report | Exception]:
    """The compiled figures of ``shardkit.cost.simulate_many`` (its arguments, but ``beside``:
    as ``simulate``'s)."""
    tgt = targets_lib.get(target)
    targets_lib.require(tgt)
    prepared: list[Any] = []
    for job in jobs:
        kw = dict(job) if isinstance(job, dict) else dict(zip(("step", "state", "batch", "mesh"), job))
        try:
            prepared.append(_prepare(kw.pop("step"), kw.pop("state"), kw.pop("batch"), kw.pop("mesh"), tgt,
                                     detail=beside is not None, **kw))
        except Exception as err:  # noqa: BLE001 — a layout that fails to plan or trace is that job's answer
            prepared.append(err)
    ready = [p for p in prepared if isinstance(p, _Job)]
    outs = iter(run_child([j.module for j in ready], [j.request for j in ready], timeout=timeout) if ready else [])
    results: list[Report | Exception] = []
    for p in prepared:
        if not isinstance(p, _Job):
            results.append(p)
            continue
        out = next(outs)
        results.append(compile_error(out) if "error" in out else _assemble(p, out, beside=beside))
    return results


@dataclasses.dataclass
class _Job:
    """One layout traced and exported for a target, ready for the child."""

    sim: Any
    target: targets_lib.Target
    amesh: AbstractMesh
    state: Any
    batch: Any
    module: bytes
    request: dict
    export_seconds: float


def _prepare(step, state, batch, mesh, tgt: targets_lib.Target, *, zero: int | None = None,
             batch_axes=SAME, microbatches: int | None = None, max_devices: int | None = None,
             detail: bool = False) -> _Job:
    """Re-plans ``step`` on ``mesh`` of ``tgt``'s devices, traces it abstractly and exports it;
    ``detail``: with the trace notes an estimate for a GPU/TPU target reads (``detailed_notes``)."""
    step.layout  # raises before init
    if step.plan.precision.fp8 and tgt.platform != "cpu":
        from .. import hardware

        if not hardware.lookup(tgt.hardware).fp8_flops:
            raise targets_lib.TargetError(
                f"precision='fp8': {tgt.name} has no fp8 matmuls; compile for an fp8 target "
                f"(h100, h200, b200) or use precision='bf16' on {tgt.name}")
    if max_devices is None:
        max_devices = MAX_DEVICES if tgt.platform == "cpu" else MAX_TARGET_DEVICES
    amesh = abstract_mesh(mesh, max_devices=max_devices, target=tgt)
    # A device count the target has no topology for fails here, before tracing, as a TargetError
    # (whether or not its compiler is installed).
    if tgt.platform == "tpu":
        targets_lib.tpu_topology(tgt, amesh.size)
    elif tgt.platform == "cuda":
        targets_lib.gpu_hosts(tgt, amesh.size)
    targets_lib.require(tgt)
    sim = step.with_plan(simulated_plan(step.plan, amesh, zero=zero, batch_axes=batch_axes))
    if microbatches is not None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        sim.microbatches = microbatches
    abs_state, abs_batch = abstract_inputs(sim, state, batch)
    t0 = time.perf_counter()
    with detailed_notes() if detail and tgt.platform != "cpu" else contextlib.nullcontext():
        exported = _export(sim, abs_state, abs_batch, tgt.platform)
    t_export = time.perf_counter() - t0
    plan = sim.plan
    pipe = _pipeline_note(sim)
    request = {
        "mesh": [[a, int(s)] for a, s in amesh.shape.items()], "target": tgt.name,
        "donate": bool(sim.donate), "groups": _groups(abs_state),
        "title": f"{plan!r}, microbatches={sim.microbatches}", "data_axes": list(plan.batch_axes),
        # The exported module's shardings lose their memory kinds: offloaded state's are sent.
        "memory_kinds": [x.sharding.memory_kind for x in jax.tree.leaves(abs_state)] if plan.offload else None,
        # The branch weights need only these; the rest of the note is not JSON.
        "pipeline": {k: pipe[k] for k in ("schedule", "stages", "microbatches", "repeats", "axis")
                     if k in pipe} if pipe else None,
        # What the step compiles with on the target's devices (``TrainStep.gpu_memory_fraction``).
        "compiler_options": compiler_options(tgt.platform, sim.gpu_memory_fraction),
    }
    return _Job(sim, tgt, amesh, abs_state, abs_batch, exported.serialize(), request, t_export)


def _assemble(job: _Job, out: dict, *, beside: Beside | None) -> Report:
    """The ``Report`` from the child's summary of one compiled job."""
    sim, tgt, amesh, abs_state, abs_batch = job.sim, job.target, job.amesh, job.state, job.batch
    plan, t_export = sim.plan, job.export_seconds
    pipe = _pipeline_note(sim)
    grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, plan.precision.grads, sharding=plan.sharding(s)),
                         abs_state.params, sim.specs("grads"))
    # In explain()'s order: the state's kinds, grads (bookkeeping), then the compiled figures.
    memory = {k: out["memory"].pop(k) for k in ("params", "opt_state", "model_state")}
    memory["grads"] = shard_bytes(grads)
    memory.update(out["memory"])
    axes = ",".join(f"{a}={s}" for a, s in amesh.shape.items())
    if tgt.platform == "cpu":
        compiled_on = f"simulated mesh {axes}: {amesh.size} XLA:CPU devices in a subprocess, abstract inputs"
        notes = [f"compiled figures are {_CPU_NOTE}"]
    else:
        compiler = "XLA:GPU" if tgt.platform == "cuda" else "XLA:TPU"
        compiled_on = (f"mesh {axes} of {amesh.size} × {tgt.name}: {compiler}, deviceless in a "
                       "subprocess, abstract inputs")
        notes = [f"compiled by {compiler} for {tgt.name} without the device: " + "; ".join(out["layout"])]
        if job.request["compiler_options"]:
            notes.append(f"XLA:GPU recomputes past {sim.gpu_memory_fraction:.0%} of the device (the step's "
                         f"gpu_memory_fraction: {job.request['compiler_options']})")
        if tgt.platform == "cuda":
            notes.append("XLA:GPU compiled without the device: no autotuning of matmul tiles, no cuDNN "
                         "(fused attention needs the device); its executables have no cost analysis, "
                         "so flops are the matmuls read off the program")
    report = Report(
        out["title"], memory, [Collective(**c) for c in out["collectives"]], out["flops"],
        traffic=[Traffic(**{**t, "axes": tuple(t["axes"]), "after_axes": tuple(t.get("after_axes", ()))})
                 for t in out["traffic"]],
        matmul_flops=out["matmul_flops"], data_axes=tuple(plan.batch_axes),
        fp8_matmul_flops=out.get("fp8_matmul_flops", 0.0), unread_matmuls=out.get("unread_matmuls", 0),
        kernels=[tuple(k) for k in out.get("kernels", ())],
        pipe_axis=(pipe or {}).get("axis"),
        branch_collectives=[BranchCollective(**{**c, "axes": tuple(c["axes"])}) for c in out["branch_collectives"]],
        compiled_on=compiled_on,
        notes=[*notes,
               f"export {t_export:.1f} s; subprocess {out['seconds']['total']:.1f} s "
               f"(compile {out['seconds']['compile']:.1f} s)"],
        seconds={"export": t_export, "compile": out["seconds"]["compile"],
                 "subprocess": out["seconds"]["total"]})
    if tgt.platform != "cpu":
        report.target, report.device_memory = tgt.name, tgt.memory_bytes()
    if sim.diloco is not None:
        report.notes.append(f"DiLoCo: the compiled program is the inner step every step runs (the "
                            f"replicas apart over {sim.diloco.axis!r}); the syncs are separate programs run "
                            f"every {sim.diloco.outer.every} steps (step.diloco.traffic), not in these figures")
        beside = None  # the analytic model has no DiLoCo term yet
    if beside is not None:
        with _on(plan):
            beside(report, sim, abs_state, abs_batch, hardware=None if tgt.platform == "cpu" else tgt.hardware)
    if out.get("optimal_seconds", 0.0) > 0:  # XLA:TPU answers -2 where it has no estimate
        # XLA:TPU's own figure counts a while body once (a 10-trip matmul loop came out below
        # the 1-trip one), so a scanned or accumulating step is under-timed: shown, not used.
        report.notes.append(f"XLA:TPU's own estimate, optimal_seconds {out['optimal_seconds'] * 1e3:.3g} ms, "
                            "counts each loop body once (layer scans, microbatches): not the step time")
        report.seconds["xla_tpu_optimal"] = out["optimal_seconds"]
    offload.annotate(report, plan)
    return report
