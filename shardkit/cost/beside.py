"""The analytic estimate beside the compiled figures: the one place the two meet.

``compiled`` reads what XLA built and ``analytic`` models it; neither imports the other. Here a
``Report``'s compiled figures get the estimate beside them (``estimate``, ``caveats``, the
model's notes) and, for a GPU or TPU target, a step time: the step-time model fed with the
compiled flops and collectives. ``step.explain()`` (``explain_step``) and ``simulate`` /
``simulate_many`` (a mesh that is not here) both join them through ``add_estimate``.
"""

from __future__ import annotations

import functools

from . import hardware as hw_lib
from .analytic.from_step import step_estimate
from .analytic.steptime import roofline_excess, times
from .compiled import simulated
from .compiled.report import Report
from .compiled.simulated import SAME


def add_estimate(report: Report, step, state, batch, *, hardware: str | None = None,
                 flops_per_token: float | None = None) -> None:
    """Sets ``step``'s analytic estimate beside ``report``'s compiled figures, and for a
    program compiled for (or on) GPUs or TPUs the step time of the compiled flops, kernels and
    collectives on them.

    Args:
        report: the compiled ``Report`` of ``step``.
        step, state, batch: what was compiled (a ``TrainStep``; arrays or abstract inputs).
        hardware: a ``HARDWARE`` name; None: the plan's devices (simulated CPU devices get
            no step time: the hardware table has no CPU entry).
        flops_per_token: as ``estimate_for_step``.
    """
    est = step_estimate(step, state, batch, flops_per_token=flops_per_token, hardware=hardware)
    report.estimate, report.caveats = est.as_dict(), dict(est.caveats)
    report.notes.extend(est.notes)
    device = getattr(step.plan.mesh.abstract_mesh, "abstract_device", None)
    xla_cpu = report.target in ("", "cpu") and (device is None or device.platform == "cpu")
    if hardware is None:
        # A program compiled on this process's GPUs or TPUs is timed on them too.
        if xla_cpu:
            return
        try:
            hardware = hw_lib.lookup(device).name
        except ValueError:
            return
    chip = hw_lib.lookup(hardware)
    # fp8 GEMMs run at the chip's fp8 peak: counted as the bf16 flops that take as long.
    flops = report.matmul_flops - report.fp8_matmul_flops * (1 - chip.peak_flops / chip.fp8_flops) \
        if report.fp8_matmul_flops and chip.fp8_flops else report.matmul_flops
    # Each kernel at the longer of its flops and its device-memory bytes (the roofline).
    memory = roofline_excess(report.kernels, chip) if chip.hbm_bandwidth > 0 else 0.0
    # XLA:CPU all-reduces and slices where the GPU and TPU compilers reduce-scatter: its
    # program's reductions are timed as the model's collectives, a target's as what they are.
    report.step_time = times(report.roles(), report.role_counts(), flops, chip, est.layout, memory_seconds=memory,
                             all_reduced=None if xla_cpu else report.all_reduced())
    report.step_time_source = (f"step-time model (sk.cost.steptime) on the compiled flops, kernels' "
                               f"memory traffic and collectives, {hardware} links")


def _beside(estimate: bool, flops_per_token: float | None):
    return functools.partial(add_estimate, flops_per_token=flops_per_token) if estimate else None


def simulate(step, state, batch, mesh, *, zero: int | None = None, batch_axes=SAME,
             microbatches: int | None = None, estimate: bool = True, flops_per_token: float | None = None,
             timeout: float = 1800.0, max_devices: int | None = None, target: str = "cpu") -> Report:
    """Compiles ``step`` for a mesh that is not here and reports what it costs per device.

    ``target`` picks the compiler: ``"h100"``, ``"h200"``, ``"a100"``, ``"b200"`` (XLA:GPU with
    that device's target config, 8 GPUs per host), ``"tpu-v5e"``, ``"tpu-v5p"``,
    ``"tpu-v6e"`` (XLA:TPU through libtpu, a slice of that many chips), or ``"cpu"`` (N
    simulated CPU devices). Nothing of the target needs to be present: its compiler runs
    deviceless in a subprocess (``pip install 'shardkit[cuda12]'`` / ``'shardkit[tpu]'``).
    The report then holds that compiler's per-device memory against the device's
    (``Report.fits``), its collectives, the matmul flops, and a step time: XLA:TPU's own
    estimate where it gives one, else ``steptime.times`` fed with the compiled flops and
    collectives (and the target's links).

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
        max_devices: see ``abstract_mesh`` (default 4,096 CPU devices, 65,536 GPUs or chips).
        target: the accelerator to compile for (``sk.cost.targets.TARGETS``).

    Returns:
        An ``sk.Report`` whose compiled figures come from the target compiler's program
        (``Report.compiled_on`` says which), with the analytic estimate beside them.

    Raises:
        ValueError: a malformed mesh spec or too many devices.
        TargetError: an unknown target, a device count it has no topology for, or its
            compiler is not installed (the message names the extra).
        ShardingError: the rules, batch or ZeRO stage do not fit the target mesh.
        SimulationError: the subprocess failed or timed out (with its stderr); ``DoesNotFit``
            (a subclass) where the target's compiler refused the program for want of device
            memory (XLA:TPU does), with the bytes it needed.
    """
    return simulated.simulate(step, state, batch, mesh, zero=zero, batch_axes=batch_axes,
                              microbatches=microbatches, beside=_beside(estimate, flops_per_token),
                              timeout=timeout, max_devices=max_devices, target=target)


def simulate_many(jobs, *, target: str = "cpu", estimate: bool = False, flops_per_token: float | None = None,
                  timeout: float = 3600.0) -> list[Report | Exception]:
    """``simulate`` for several layouts, compiled one after another in one subprocess (one
    start-up of JAX and the target's compiler instead of one per layout).

    Args:
        jobs: ``(step, state, batch, mesh)`` tuples, or dicts with those keys and any of
            ``simulate``'s ``zero``, ``batch_axes``, ``microbatches``.
        target: as ``simulate``, one for all jobs.
        estimate, flops_per_token: as ``simulate`` (off by default: the compiled figures).
        timeout: seconds for the whole subprocess.

    Returns:
        One entry per job, in order: its ``Report``, or the exception that job raised
        (``ShardingError`` while planning, ``TargetError`` for a device count the target has
        no topology for, ``SimulationError`` when its compile failed) — one layout that does
        not fit does not lose the others.

    Raises:
        TargetError: as ``simulate``.
        SimulationError: the subprocess itself died or timed out.
    """
    return simulated.simulate_many(jobs, target=target, beside=_beside(estimate, flops_per_token), timeout=timeout)
