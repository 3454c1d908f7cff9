"""Accelerators a step can be compiled for without having them (deviceless ahead-of-time).

XLA:GPU and XLA:TPU both compile on a CPU-only machine for devices that are described rather
than present: ``jax.experimental.topologies.get_topology_desc`` gives compile-only devices
(a GPU target config for CUDA, a slice topology for libtpu), and a step lowered for a mesh of
them compiles down to sm_90 or TPU machine code, with the target compiler's own buffer
assignment, collective choices and fusion. ``simulate(..., target=)`` uses this module in its
subprocess; the parent only checks that the compiler is installed (``require``).

GPU device descriptions ship as data (``gpu_specs/<name>.txtpb``, one per device, each naming
its source). GPUs come 8 to a host: a mesh's outer axes span hosts, its inner ones stay on
NVLink. TPU slices take the torus shape for the chip count (``tpu_topology``); a mesh is laid
onto the torus with ``jax.experimental.mesh_utils`` where its axes map onto the physical ones,
else in device-id order (and the report says so).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re

import numpy as np

_SPECS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs")


class TargetError(ValueError):
    """A target that cannot be compiled for here: unknown name, device count the target has no
    topology for, or its compiler is not installed (the message names the pip extra)."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One accelerator to compile for.

    Attributes:
        name: what users pass (``"h100"``, ``"tpu-v5p"``, ``"cpu"``).
        platform: the lowering platform (``"cuda"``, ``"tpu"``, ``"cpu"``).
        hardware: its entry in ``sk.cost.hardware.HARDWARE`` (peak flops, links) for step time.
        device_platform: what its devices report as ``jax.Device.platform`` (what
            ``sk.target_platform()`` answers while the step is traced for it).
        per_host: devices per host (GPUs per node; TPU chips per host).
        tpu: the libtpu topology prefix (``"v5p"``); ``torus``: its torus rank (2 or 3).
        extra: the ``pip install 'shardkit[...]'`` extra that brings its compiler.
    """

    name: str
    platform: str
    hardware: str
    device_platform: str
    per_host: int = 8
    tpu: str = ""
    torus: int = 0
    extra: str = ""

    @property
    def spec_file(self) -> str:
        return os.path.join(_SPECS, f"{self.name}.txtpb")

    def gpu_config(self) -> str:
        """The GPU target config text proto (XLA's ``GpuTargetConfigProto``)."""
        with open(self.spec_file) as f:
            return f.read()

    def memory_bytes(self) -> float:
        """Device memory per device: the GPU spec's ``device_memory_size`` (what the driver
        reports), else the hardware table's HBM."""
        if self.platform == "cuda":
            m = re.search(r"device_memory_size:\s*(\d+)", self.gpu_config())
            if m:
                return float(m.group(1))
        from .. import hardware

        return hardware.lookup(self.hardware).hbm_bytes


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("cpu", "cpu", "cpu", "cpu"),
    Target("h100", "cuda", "h100", "gpu", extra="cuda12"),
    Target("h200", "cuda", "h200", "gpu", extra="cuda12"),
    Target("a100", "cuda", "a100", "gpu", extra="cuda12"),
    Target("b200", "cuda", "b200", "gpu", extra="cuda12"),
    Target("tpu-v5e", "tpu", "tpu-v5e", "tpu", per_host=4, tpu="v5e", torus=2, extra="tpu"),
    Target("tpu-v5p", "tpu", "tpu-v5p", "tpu", per_host=4, tpu="v5p", torus=3, extra="tpu"),
    Target("tpu-v6e", "tpu", "tpu-v6e", "tpu", per_host=4, tpu="v6e", torus=2, extra="tpu"),
)}


def get(name: str | Target) -> Target:
    """The target called ``name``.

    Raises:
        TargetError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, Target):
        return name
    key = str(name).lower()
    if key == "tpu-v4":
        # libtpu 0.0.42 describes a v4 chip as two devices (its TensorCores, no megacore),
        # where JAX on a v4 slice sees one device per chip: per-device figures would be per core.
        raise TargetError("target 'tpu-v4' is not supported: libtpu's compile-only v4 topology has two "
                          "devices per chip (no megacore), unlike a v4 slice under JAX; use tpu-v5p "
                          "(the same 3-D torus) or tpu-v5e / tpu-v6e")
    if key not in TARGETS:
        raise TargetError(f"unknown target {name!r}; choose one of {', '.join(TARGETS)}")
    return TARGETS[key]


# The largest single slice per TPU generation (chips), beyond which slices are joined over DCN.
_MAX_SLICE = {"v5p": 8192, "v5e": 256, "v6e": 256}


def tpu_topology(target: Target, devices: int) -> tuple[str, int]:
    """``(topology name, slices)`` for ``devices`` chips: the most cube-like torus of the
    generation (``v5p:2x4x4`` for 32), starting from one host's ``2x2x1`` / ``2x2``; beyond the
    largest slice, equal slices joined over the data-center network.

    Raises:
        TargetError: a count that is not 4 × a power of two (one host has 4 chips).
    """
    if devices < 4 or devices & (devices - 1):
        valid = ", ".join(str(4 << i) for i in range(8))
        raise TargetError(f"{target.name}: no TPU slice has {devices} chips; a slice has 4 × 2^k chips "
                          f"({valid}, ...): size the mesh to one of those")
    per_slice = min(devices, _MAX_SLICE[target.tpu])
    dims = [2, 2, 1] if target.torus == 3 else [2, 2]
    while math.prod(dims) < per_slice:
        i = min(range(len(dims)), key=lambda j: (dims[j], -j))
        dims[i] *= 2
    # libtpu names a one-host slice 2x2x1 (it refuses 1x2x2), larger ones smallest dimension first.
    name = "x".join(str(d) for d in sorted(dims, key=lambda d: (d == 1, d)))
    return f"{target.tpu}:{name}", devices // per_slice


def gpu_hosts(target: Target, devices: int) -> int:
    """GPUs per host for ``devices`` GPUs of ``target``: a full host of ``per_host``, or one
    host holding fewer.

    Raises:
        TargetError: a count that does not fill whole hosts (12 H100s: one and a half hosts).
    """
    per_host = min(target.per_host, devices)
    if devices % per_host:
        raise TargetError(f"{target.name}: {devices} GPUs do not fill hosts of {target.per_host}; use a "
                          f"multiple of {target.per_host} (or fewer than {target.per_host} on one host)")
    return per_host


def require(target: Target) -> None:
    """Checks, in the parent, that ``target``'s compiler is installed and matches jax.

    Raises:
        TargetError: naming the extra to install and the versions found.
    """
    if target.platform == "cpu":
        return
    jax_version = importlib.metadata.version("jax")
    fix = f"pip install 'shardkit[{target.extra}]' (or: pip install {_pins(target, jax_version)})"
    if target.platform == "tpu":
        found = _version("libtpu")
        if found is None:
            raise TargetError(f"target {target.name!r} compiles with XLA:TPU, which comes with libtpu, "
                              f"not installed here. {fix}")
        want = _required_libtpu()
        if want and not re.fullmatch(want.replace(".", r"\.").replace(r"\.*", r"(\.\d+)*"), found):
            raise TargetError(f"target {target.name!r}: libtpu {found} is installed but jax "
                              f"{jax_version} needs libtpu=={want}. {fix}")
        return
    missing = [p for p in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12") if _version(p) is None]
    if missing:
        raise TargetError(f"target {target.name!r} compiles with XLA:GPU, which needs {', '.join(missing)} "
                          f"(not installed here; ptxas comes from nvidia-cuda-nvcc-cu12). {fix}")
    for p in ("jax-cuda12-plugin", "jax-cuda12-pjrt"):
        if _version(p) != jax_version:
            raise TargetError(f"target {target.name!r}: {p} {_version(p)} does not match jax {jax_version}. {fix}")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _required_libtpu() -> str | None:
    """The libtpu version jax's ``tpu`` extra pins (``0.0.42.*``)."""
    for req in importlib.metadata.requires("jax") or ():
        m = re.match(r"libtpu\s*==\s*([0-9.*]+)\s*;.*extra\s*==\s*['\"]tpu['\"]", req)
        if m:
            return m.group(1)
    return None


def _pins(target: Target, jax_version: str) -> str:
    if target.platform == "tpu":
        return f"'jax[tpu]=={jax_version}'"
    return (f"jax-cuda12-plugin=={jax_version} jax-cuda12-pjrt=={jax_version} nvidia-cuda-nvcc-cu12")


# ---- in the compiling subprocess -------------------------------------------------------------

def device_mesh(target: Target, pairs: list[tuple[str, int]]):
    """A ``jax.sharding.Mesh`` of compile-only devices of ``target`` with the named axes, and
    notes on how it was laid out (hosts, torus). Call only where JAX runs on CPU
    (``JAX_PLATFORMS=cpu``): the compile-only devices come from the target's PJRT plugin."""
    from jax.experimental import mesh_utils, topologies
    from jax.sharding import Mesh

    names = tuple(a for a, _ in pairs)
    shape = tuple(int(s) for _, s in pairs)
    n = math.prod(shape)
    notes = []
    if target.platform == "cuda":
        per_host = gpu_hosts(target, n)
        topo = topologies.get_topology_desc(platform="cuda", target_config=target.gpu_config(),
                                            topology=f"1x{n // per_host}x{per_host}")
        devices = np.array(topo.devices[:n]).reshape(shape)
        notes.append(f"{n // per_host} host(s) × {per_host} {topo.devices[0].device_kind}; "
                     + _host_axes(names, shape, per_host))
        return Mesh(devices, names), notes
    name, slices = tpu_topology(target, n)
    kwargs = {"num_slices": slices} if slices > 1 else {}
    topo = topologies.get_topology_desc(topology_name=name, platform="tpu", **kwargs)
    if len(topo.devices) != n:
        raise TargetError(f"{target.name}: topology {name} has {len(topo.devices)} devices, not the "
                          f"mesh's {n} (this generation exposes more than one device per chip)")
    where = f"{slices} slices of {name}" if slices > 1 else name
    try:
        if slices > 1:
            raise ValueError("several slices")
        devices = mesh_utils.create_device_mesh(shape, topo.devices, allow_split_physical_axes=True)
        notes.append(f"{where}: mesh axes laid onto the torus")
    except (ValueError, NotImplementedError, AssertionError) as err:
        devices = np.array(topo.devices).reshape(shape)
        reason = "slices in order, outer axes across slices" if slices > 1 else f"does not map onto the torus ({err})"
        notes.append(f"{where}: mesh {dict(pairs)} {reason}; devices in id order")
    return Mesh(devices, names), notes


def _host_axes(names, shape, per_host: int) -> str:
    """Which mesh axes span hosts when devices fill the mesh in id order (row-major)."""
    inner, across = 1, []
    for a, s in reversed(list(zip(names, shape))):
        if inner * s > per_host and s > 1:
            across.append(a)
        inner *= s
    return (f"axes across hosts: {', '.join(reversed(across))}" if across
            else "every axis within one host (NVLink)")
