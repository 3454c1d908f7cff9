"""XLA settings that depend on the platform: opt-in GPU performance flags, and which platform
the program being traced compiles for (what platform-gated code paths ask)."""

from __future__ import annotations

import math
import os

import jax

from .mesh import backend_started as _backend_started  # a name tests can stub
from .plan import active_plan

# XLA:GPU flags for overlapping communication with compute; each name was checked against the
# flag table compiled into jaxlib 0.10.2 and a 2025 openxla/xla debug_options_flags.cc (where
# the high-priority stream, pipelined reduce-scatter and multi-streamed windowed einsum are
# already on by default: set anyway for jaxlibs where they are not). XLA aborts at start on an
# unknown flag, so a name XLA drops must go from here too.
GPU_FLAGS: dict[str, str] = {
    # Schedules collectives early/late around independent compute instead of in program order.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Collectives on a high-priority stream, so compute kernels do not starve them.
    "xla_gpu_enable_highest_priority_async_stream": "true",
    # Moves a loop's (layer scan's) all-reduce / all-gather / reduce-scatter into the
    # neighbouring iteration, where it overlaps that iteration's matmuls.
    "xla_gpu_enable_pipelined_all_reduce": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    # Unrolls while loops by two so the pipelined collectives have an iteration to hide in.
    "xla_gpu_enable_while_loop_double_buffering": "true",
    # Collective matmul: an all-gather or reduce-scatter feeding a matmul becomes a loop of
    # partial matmuls and collective-permutes (windowed einsum) above this size (MiB; 0: all).
    "xla_gpu_threshold_for_windowed_einsum_mib": "0",
    "xla_gpu_multi_streamed_windowed_einsum": "true",
}

_FLAGS = {"gpu": GPU_FLAGS}


def xla_flags(platform: str = "gpu", *, apply: bool = True) -> list[str]:
    """The XLA performance flags for ``platform``, appended to ``XLA_FLAGS`` (opt-in).

    XLA reads ``XLA_FLAGS`` once, when JAX's backend starts, so call this at the top of the
    program, before the first JAX operation. Flags already in ``XLA_FLAGS`` keep the value
    given there (the user's choice wins); calling it again changes nothing. The flags are
    listed in ``GPU_FLAGS`` (and the README); they matter for multi-device runs, where they
    overlap collectives with compute.

    Args:
        platform: ``"gpu"`` (the only platform with a table so far).
        apply: False returns the flags without touching the environment.

    Returns:
        The flags as ``--name=value`` strings (those for ``platform``, whether or not they
        were already set).

    Raises:
        ValueError: an unknown ``platform``.
        RuntimeError: ``apply`` while JAX's backend is already running (the flags would be
            ignored silently); set them before importing anything that runs JAX.
    """
    if platform not in _FLAGS:
        raise ValueError(f"xla_flags: no flags for platform {platform!r}; choose one of {sorted(_FLAGS)}")
    flags = [f"--{name}={value}" for name, value in _FLAGS[platform].items()]
    if not apply:
        return flags
    if _backend_started():
        raise RuntimeError(
            f"xla_flags({platform!r}): JAX's backend ({jax.default_backend()}) has already started, "
            "and XLA reads XLA_FLAGS only when it starts. Call sk.xla_flags() before the first JAX "
            "operation (top of the script, or a fresh notebook kernel), or export XLA_FLAGS='"
            + " ".join(flags) + "' before launching Python.")
    current = os.environ.get("XLA_FLAGS", "").split()
    present = {f.lstrip("-").split("=", 1)[0] for f in current}
    added = [f for f in flags if f.lstrip("-").split("=", 1)[0] not in present]
    os.environ["XLA_FLAGS"] = " ".join(current + added)
    return flags


# XLA:GPU recomputes values, matmuls included, wherever a program's peak passes its scheduler
# memory limit: (80% of the device less the program's arguments and outputs) x a slop factor of
# 95% (``GetSchedulerMemoryLimit``, xla/service/gpu/gpu_hlo_schedule.cc) — about 60 GiB of an
# H100's 79.1, so a program that fits is still recomputed: Llama 3 405B with keep="lean" on 16,384
# H100s compiles to 1.17x the model's matmul flops at 67.5 GiB, 1.07x with the limit raised
# (BENCHMARKS.md). The fraction of the device shardkit lets it plan for instead; JAX's allocator
# needs the same share (``XLA_PYTHON_CLIENT_MEM_FRACTION``, 0.75 by default).
GPU_MEMORY_FRACTION = 0.95


def compiler_options(platform: str, memory_fraction: float | None = GPU_MEMORY_FRACTION) -> dict:
    """The XLA compile options shardkit's steps compile with on ``platform`` (``"gpu"`` or
    ``"cuda"``; none elsewhere): XLA:GPU's scheduling and rematerialization limit raised from
    76% of the device to ``memory_fraction`` of it (less the program's arguments and outputs),
    so XLA recomputes only what does not fit that share. ``None`` keeps XLA's own limit, and so
    does ``--xla_gpu_memory_limit_slop_factor`` in ``XLA_FLAGS`` (the user's choice wins).

    Raises:
        ValueError: a fraction outside (0, 1].
    """
    if memory_fraction is None:
        return {}
    if isinstance(memory_fraction, bool) or not isinstance(memory_fraction, (int, float)) or not 0 < memory_fraction <= 1:
        raise ValueError(f"gpu_memory_fraction={memory_fraction!r}: give a fraction of the device in (0, 1] "
                         "(e.g. 0.95, with XLA_PYTHON_CLIENT_MEM_FRACTION=.95), or None for XLA's own limit")
    if platform not in ("gpu", "cuda") or "xla_gpu_memory_limit_slop_factor" in os.environ.get("XLA_FLAGS", ""):
        return {}  # no such limit; or the user's flag stands (a compile option would override it)
    # XLA's limit is 80% of the device times the slop factor (in percent).
    return {"xla_gpu_memory_limit_slop_factor": math.ceil(100 * memory_fraction / 0.8)}


def target_platform() -> str:
    """The platform the program being traced compiles for: the active shardkit plan's mesh's
    (inside a step), else the ambient mesh's, else JAX's default backend. An
    ``AbstractMesh`` names its platform in ``abstract_device``, so a step planned on an
    abstract GPU mesh answers ``"gpu"`` on a CPU host.

    Platform-gated code paths (XLA:CPU workarounds, cuDNN attention) ask this at trace time,
    so what they build follows the mesh the step is compiled for."""
    plan = active_plan()
    for mesh in ((plan.mesh.abstract_mesh,) if plan is not None else ()) + (jax.sharding.get_abstract_mesh(),):
        device = getattr(mesh, "abstract_device", None)
        if device is not None:
            return device.platform
    return jax.default_backend()
