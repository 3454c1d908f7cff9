"""Accelerator figures: peak dense bf16 flop/s, HBM, link bandwidths; a measured CPU peak.

One table, shared by the recipes' MFU and the cost model. Figures per chip, dense (no
sparsity), from the vendors' data sheets (NVIDIA H100/H200/A100, Google Cloud TPU system
architecture pages) and the JAX scaling book ("How to Scale Your Model", Austin et al. 2025).
Add your own with ``register_hardware``.

On CPU there is no data sheet: ``measure_cpu_peak`` times a large float32 matmul. Simulated
CPU devices (``sk.use_cpu_devices``) share the host's cores, so each gets an equal share of
the host's peak and MFU over all of them is achieved/host peak.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One accelerator chip.

    Attributes:
        name: short name used as the table key (``"h100"``).
        peak_flops: dense bf16 flop/s per chip.
        hbm_bytes: device memory per chip.
        intra_node_bw: bytes/s per chip, one direction, over the fast links (NVLink / ICI).
        inter_node_bw: bytes/s per chip, one direction, across nodes/slices (InfiniBand / DCN).
        device_kinds: lower-case substrings of ``jax.Device.device_kind`` that identify it.
        hbm_bandwidth: bytes/s of device memory (what memory-bound kernels run at; 0: unknown).
        fp8_flops: dense fp8 flop/s per chip (0: no fp8 matmuls; ``precision="fp8"`` is refused).
    """

    name: str
    peak_flops: float
    hbm_bytes: float
    intra_node_bw: float
    inter_node_bw: float
    device_kinds: tuple[str, ...] = ()
    hbm_bandwidth: float = 0.0
    fp8_flops: float = 0.0


HARDWARE: dict[str, Hardware] = {}


def register_hardware(hw: Hardware, *, overwrite: bool = False) -> Hardware:
    """Adds ``hw`` to ``HARDWARE`` (keyed by ``hw.name.lower()``).

    Raises:
        ValueError: the name is taken and ``overwrite`` is false.
    """
    key = hw.name.lower()
    if key in HARDWARE and not overwrite:
        raise ValueError(f"hardware {hw.name!r} is already registered; pass overwrite=True to replace it")
    HARDWARE[key] = dataclasses.replace(hw, name=key)
    return HARDWARE[key]


# GPUs: InfiniBand ~400 GB/s per 8-GPU node (8 × 400 Gb/s) → 50 GB/s per GPU. HBM bandwidths
# from the data sheets (H100 SXM 3.35 TB/s, H200 4.8, A100 80 GB SXM 2.039; TPU v4 1.2, v5e
# 0.819, v5p 2.765, v6e 1.64).
TB = 1e12
for _hw in (
    # Dense FP8 (data sheets, without sparsity): H100/H200 SXM 1,979 TFLOP/s, B200 4.5 PFLOP/s;
    # A100 and the TPUs here have no fp8 matmuls.
    Hardware("h100", 989e12, 80 * GB, 450 * GB, 50 * GB, ("h100",), 3.35 * TB, 1979e12),
    Hardware("h200", 989e12, 141 * GB, 450 * GB, 50 * GB, ("h200",), 4.8 * TB, 1979e12),
    Hardware("a100", 312e12, 80 * GB, 300 * GB, 25 * GB, ("a100",), 2.039 * TB),
    # HGX B200 data sheet: 2.25 PFLOP/s dense BF16 and 180 GB HBM3e (7.7 TB/s) per GPU, NVLink 5
    # 1.8 TB/s both ways (900 GB/s one way), one 400 Gb/s NIC per GPU (50 GB/s).
    Hardware("b200", 2250e12, 180 * GB, 900 * GB, 50 * GB, ("b200",), 7.7 * TB, 4500e12),
    # Google Cloud A3 High (a3-highgpu-8g): H100 SXM over NVLink, but GPUDirect-TCPX between
    # VMs, 4 GPU NICs x 200 Gb/s per 8 GPUs → 12.5 GB/s per GPU (Google Cloud, "Networking and
    # GPU machines"). Same chip as "h100", so looked up by name only.
    Hardware("h100-a3", 989e12, 80 * GB, 450 * GB, 12.5 * GB, (), 3.35 * TB, 1979e12),
    # TPUs: ICI per chip = links × one-way per-link bandwidth (scaling book), DCN ~6.25 GB/s
    # per chip.
    Hardware("tpu-v4", 275e12, 32 * GB, 6 * 45 * GB, 6.25 * GB, ("tpu v4",), 1.2 * TB),
    Hardware("tpu-v5e", 197e12, 16 * GB, 4 * 45 * GB, 6.25 * GB, ("tpu v5 lite", "tpu v5e"), 0.819 * TB),
    # v5p: "95 GB" in Google's table is binary: XLA:TPU's out-of-memory verdict reads "available
    # HBM (95.74G)" (XLA prints GiB), so fitting is judged against what its compiler allows.
    Hardware("tpu-v5p", 459e12, 95.74 * 2**30, 6 * 90 * GB, 6.25 * GB, ("tpu v5p", "tpu v5"), 2.765 * TB),
    Hardware("tpu-v6e", 918e12, 32 * GB, 4 * 90 * GB, 6.25 * GB, ("tpu v6 lite", "tpu v6e"), 1.64 * TB),
):
    register_hardware(_hw)


def lookup(name_or_device: str | jax.Device) -> Hardware:
    """The table entry for a name (``"h100"``) or a device (matched by its device_kind).

    Raises:
        ValueError: nothing matches; the message lists the known names.
    """
    if isinstance(name_or_device, str):
        key = name_or_device.lower()
        if key in HARDWARE:
            return HARDWARE[key]
        kind = key
    else:
        kind = str(getattr(name_or_device, "device_kind", "")).lower()
    # Longest pattern first, so "tpu v5 lite" wins over "tpu v5".
    candidates = sorted(((pat, hw) for hw in HARDWARE.values() for pat in hw.device_kinds),
                        key=lambda ph: -len(ph[0]))
    for pat, hw in candidates:
        if pat in kind:
            return hw
    raise ValueError(
        f"no hardware entry for {name_or_device!r}; known: {', '.join(sorted(HARDWARE))}. "
        "Add one with sk.cost.hardware.register_hardware(Hardware(name, peak_flops, hbm_bytes, "
        "intra_node_bw, inter_node_bw, device_kinds=(...)))")


def peak_flops(name_or_device: str | jax.Device) -> float:
    """Peak flop/s of one device: the table's dense bf16 figure, or for a CPU device its
    share of the measured host matmul peak (``"cpu"`` gives the whole host's)."""
    if isinstance(name_or_device, str) and name_or_device.lower() == "cpu":
        return measure_cpu_peak()
    if not isinstance(name_or_device, str) and name_or_device.platform == "cpu":
        n_cpu = max(1, len(jax.devices("cpu")))
        return measure_cpu_peak() / n_cpu
    return lookup(name_or_device).peak_flops


def total_peak_flops(devices) -> float:
    """Peak flop/s of a set of devices (e.g. ``mesh.devices.flat``): the table's figures
    summed, except that CPU devices of one process count as one host, whether the set holds
    one of its simulated devices or all of them (a 1-device program also uses every core)."""
    devices = list(devices)
    hosts = {d.process_index for d in devices if d.platform == "cpu"}
    return (sum(lookup(d).peak_flops for d in devices if d.platform != "cpu")
            + len(hosts) * measure_cpu_peak())


@functools.lru_cache(maxsize=None)
def measure_cpu_peak(n: int = 1024, repeats: int = 10) -> float:
    """The host's float32 matmul flop/s: best of ``repeats`` timed ``n×n @ n×n`` products on
    one CPU device (XLA spreads one large dot over all the host's cores). Cached."""
    dev = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), dev)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best
