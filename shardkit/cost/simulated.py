"""Compiled figures for a mesh that is not here: the step is compiled for N simulated devices.

XLA's buffer assignment and collective choices are only modelled by XLA itself, so for a
layout that does not exist yet (``data=64,tensor=8`` on a laptop) the step is compiled for it:

1. the step is re-planned on a ``jax.sharding.AbstractMesh`` of the target sizes (same rules,
   precision and ZeRO stage unless overridden; ``TrainStep.with_plan``);
2. traced with abstract inputs (``ShapeDtypeStruct``\\ s with the new shardings: nothing is
   allocated) and exported for XLA:CPU (``jax.export``);
3. a subprocess with N simulated CPU devices (``python -m shardkit.cost.simulated``)
   compiles it with the step's donation and reads memory, collectives (through loops) and
   flops off the compiled program (``explain.report_from_compiled``), returning a small JSON
   summary — never the HLO itself.

What is read is what XLA:CPU compiles: the collectives it picks (an all-reduce plus a slice
where a GPU reduce-scatters; ``Report.roles`` counts bytes reduced, the same either way) and
its buffers (it runs 16-bit dots in f32). The report says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, PartitionSpec as P

from ..explain import Collective, Report, Traffic, report_from_compiled, shard_bytes
from ..mesh import parse_mesh_spec
from ..plan import Plan

MAX_DEVICES = 4096
_CPU = AbstractDevice(device_kind="cpu", num_cores=None, platform="cpu")
_SAME: Any = object()
_CPU_NOTE = ("XLA:CPU's program: its collective choices (all-reduce + slice where GPUs "
             "reduce-scatter) and buffers (16-bit dots run in f32)")


class SimulationError(RuntimeError):
    """The subprocess that compiles for the simulated mesh failed (its stderr is in the message)."""


def abstract_mesh(spec, *, max_devices: int = MAX_DEVICES) -> AbstractMesh:
    """An ``AbstractMesh`` (Auto axis types, XLA:CPU devices) for a mesh spec.

    Args:
        spec: ``"data=64,tensor=8"``, a dict or ``(axis, size)`` pairs (no ``-1``), or an
            ``AbstractMesh`` / ``Mesh`` whose sizes and names are taken.
        max_devices: refuse larger meshes (each simulated device is a thread in the compiler).

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
    return AbstractMesh(tuple(s for _, s in pairs), names, axis_types=(AxisType.Auto,) * len(names),
                        abstract_device=_CPU)


def simulated_plan(plan: Plan, mesh: AbstractMesh, *, zero: int | None = None,
                   batch_axes=_SAME) -> Plan:
    """``plan`` on another mesh: same rules, axis rules, precision and strictness; ``zero`` and
    ``batch_axes`` kept unless given. Batch axes the plan derived by default (the mesh's
    data-like axes) are derived again for the new mesh."""
    if batch_axes is _SAME:
        default = Plan(plan.mesh, rules=plan.rules, axis_rules=plan.axis_rules).batch_axes
        batch_axes = None if plan.batch_axes == default else plan.batch_axes
    return Plan(mesh, rules=plan.rules, axis_rules=plan.axis_rules,
                zero=plan.zero if zero is None else zero, precision=plan.precision,
                batch_axes=batch_axes, strict=plan.strict)


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


def _export(step, state, batch) -> jax.export.Exported:
    """The step as an XLA:CPU module over flat leaves (built-in containers only, so it
    serializes without registering TrainState). Donation is not exported: the child adds it."""
    state_leaves, state_tree = jax.tree.flatten(state)
    batch_leaves, batch_tree = jax.tree.flatten(batch)

    def flat(state_leaves, batch_leaves):
        new_state, metrics = step.step_function()(state_tree.unflatten(state_leaves), batch_tree.unflatten(batch_leaves))
        return jax.tree.leaves(new_state), jax.tree.leaves(metrics)

    fn = jax.jit(flat, in_shardings=([x.sharding for x in state_leaves], [x.sharding for x in batch_leaves]),
                 out_shardings=([x.sharding for x in state_leaves], step.plan.sharding(P())))
    with _on(step.plan):
        return jax.export.export(fn, platforms=["cpu"])(state_leaves, batch_leaves)


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


def simulate(step, state, batch, mesh, *, zero: int | None = None, batch_axes=_SAME,
             microbatches: int | None = None, estimate: bool = True, flops_per_token: float | None = None,
             timeout: float = 1800.0, max_devices: int = MAX_DEVICES) -> Report:
    """Compiles ``step`` for a mesh that is not here and reports what it costs per device.

    Args:
        step: a ``TrainStep`` after ``step.init`` (or ``abstract_state``).
        state: its ``TrainState`` (arrays or ``ShapeDtypeStruct``\\ s; only shapes are read).
        batch: one global batch (arrays or ``ShapeDtypeStruct``\\ s).
        mesh: the target mesh, ``"data=64,tensor=8"`` (see ``abstract_mesh``).
        zero: a ZeRO stage for the target layout (default: the step's).
        batch_axes: the target plan's batch axes (default: the step's, re-derived if default).
        microbatches: gradient-accumulation steps for the target layout (default: the step's).
        estimate: also compute the analytic estimate for the target layout.
        flops_per_token: passed to the estimate.
        timeout: seconds the compiling subprocess may take.
        max_devices: see ``abstract_mesh``.

    Returns:
        An ``sk.Report`` whose compiled figures come from XLA:CPU's program for the simulated
        mesh (``Report.compiled_on`` says which), with the analytic estimate beside them.

    Raises:
        ValueError: a malformed mesh spec or too many devices.
        ShardingError: the rules, batch or ZeRO stage do not fit the target mesh.
        SimulationError: the subprocess failed or timed out (with its stderr).
    """
    step.layout  # raises before init
    amesh = abstract_mesh(mesh, max_devices=max_devices)
    sim = step.with_plan(simulated_plan(step.plan, amesh, zero=zero, batch_axes=batch_axes))
    if microbatches is not None:
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive integer, got {microbatches!r}")
        sim.microbatches = microbatches
    abs_state, abs_batch = abstract_inputs(sim, state, batch)
    t0 = time.perf_counter()
    exported = _export(sim, abs_state, abs_batch)
    t_export = time.perf_counter() - t0
    plan = sim.plan
    pipe = sim.trace_notes.get("pipeline")
    request = {
        "mesh": [[a, int(s)] for a, s in amesh.shape.items()],
        "donate": bool(sim.donate), "groups": _groups(abs_state),
        "title": f"{plan!r}, microbatches={sim.microbatches}", "data_axes": list(plan.batch_axes),
        # The branch weights need only these; the rest of the note is not JSON.
        "pipeline": {k: pipe[k] for k in ("schedule", "stages", "microbatches", "repeats", "axis")
                     if k in pipe} if pipe else None,
    }
    out = run_child(exported.serialize(), request, timeout=timeout)
    grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, plan.precision.grads, sharding=plan.sharding(s)),
                         abs_state.params, sim.specs("grads"))
    # In explain()'s order: the state's kinds, grads (bookkeeping), then the compiled figures.
    memory = {k: out["memory"].pop(k) for k in ("params", "opt_state", "model_state")}
    memory["grads"] = shard_bytes(grads)
    memory.update(out["memory"])
    axes = ",".join(f"{a}={s}" for a, s in amesh.shape.items())
    report = Report(
        out["title"], memory, [Collective(**c) for c in out["collectives"]], out["flops"],
        traffic=[Traffic(**{**t, "axes": tuple(t["axes"])}) for t in out["traffic"]],
        matmul_flops=out["matmul_flops"], data_axes=tuple(plan.batch_axes),
        pipe_axis=(pipe or {}).get("axis"),
        compiled_on=f"simulated mesh {axes}: {amesh.size} XLA:CPU devices in a subprocess, abstract inputs",
        notes=[f"compiled figures are {_CPU_NOTE}",
               f"export {t_export:.1f} s; subprocess {out['seconds']['total']:.1f} s "
               f"(compile {out['seconds']['compile']:.1f} s)"],
        seconds={"export": t_export, "compile": out["seconds"]["compile"],
                 "subprocess": out["seconds"]["total"]})
    if estimate:
        from .fromstep import step_estimate

        with _on(plan):
            est = step_estimate(sim, abs_state, abs_batch, flops_per_token=flops_per_token)
        report.estimate, report.caveats = est.as_dict(), dict(est.caveats)
        report.notes.extend(est.notes)
    return report


def run_child(module: bytes, request: dict, *, timeout: float) -> dict:
    """Runs ``python -m shardkit.cost.simulated`` on a serialized module and returns its JSON."""
    n = math.prod(s for _, s in request["mesh"])
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n))
    # The child imports this very shardkit, installed or not (e.g. a script's sys.path insert).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    # The parent's device-count flag would fight the child's.
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    with tempfile.TemporaryDirectory(prefix="shardkit-sim-") as tmp:
        with open(os.path.join(tmp, "module.bin"), "wb") as f:
            f.write(module)
        with open(os.path.join(tmp, "request.json"), "w") as f:
            json.dump(request, f)
        cmd = [sys.executable, "-m", "shardkit.cost.simulated", tmp]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise SimulationError(f"compiling for the simulated mesh {request['mesh']} took more than "
                                  f"{timeout:.0f} s (timeout=); stderr tail:\n{_tail(e.stderr)}") from None
        if proc.returncode != 0:
            raise SimulationError(f"compiling for the simulated mesh {request['mesh']} failed (exit "
                                  f"{proc.returncode}); stderr tail:\n{_tail(proc.stderr)}")
        with open(os.path.join(tmp, "report.json")) as f:
            return json.load(f)


def _tail(text, n: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-n:]


def _child(directory: str) -> None:
    """The subprocess: deserialize, compile with donation on N CPU devices, summarise."""
    t0 = time.perf_counter()
    with open(os.path.join(directory, "request.json")) as f:
        req = json.load(f)
    n = math.prod(s for _, s in req["mesh"])
    jax.config.update("jax_num_cpu_devices", n)
    from ..mesh import make_mesh

    with open(os.path.join(directory, "module.bin"), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    mesh = make_mesh([tuple(p) for p in req["mesh"]])
    (args_sh, _) = exported.in_tree.unflatten(exported.in_shardings_jax(mesh))
    out_sh = exported.out_tree.unflatten(exported.out_shardings_jax(mesh))
    (args, _) = exported.in_tree.unflatten(exported.in_avals)
    t1 = time.perf_counter()
    compiled = jax.jit(exported.call, in_shardings=args_sh, out_shardings=out_sh,
                       donate_argnums=(0,) if req["donate"] else ()).lower(*args).compile()
    t_compile = time.perf_counter() - t1
    (state_sh, batch_sh), _ = compiled.input_shardings
    placed = lambda avals, shs: [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
                                 for a, s in zip(avals, shs)]
    state, batch = placed(args[0], state_sh), placed(args[1], batch_sh)
    memory = {k: shard_bytes([state[i] for i in idx]) for k, idx in req["groups"].items()}
    memory["batch"] = shard_bytes(batch)
    report = report_from_compiled(compiled, req["title"], memory, mesh, tuple(req["data_axes"]),
                                  pipeline=req["pipeline"])
    out = {"title": report.title, "memory": report.memory, "flops": report.flops,
           "matmul_flops": report.matmul_flops,
           "collectives": [dataclasses.asdict(c) for c in report.collectives],
           "traffic": [dataclasses.asdict(t) for t in report.traffic],
           "seconds": {"compile": t_compile, "total": time.perf_counter() - t0}}
    with open(os.path.join(directory, "report.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    _child(sys.argv[1])
