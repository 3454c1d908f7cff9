"""Device meshes: parse a layout string, build a ``jax.sharding.Mesh`` with Auto axes.

``make_mesh("data=2,fsdp=2,tensor=2")`` is the whole interface; ``dcn=`` adds outer axes
that cross slices or hosts (the slow links), so a layout can keep its fast axes inside a node.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MeshSpec = str | Mapping[str, int] | Sequence[tuple[str, int]]

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def use_cpu_devices(n: int) -> None:
    """Simulates ``n`` CPU devices for this process.

    Must run before the first JAX computation: XLA fixes the device count when its backend
    starts. Calling it again with the same ``n`` is a no-op.

    Raises:
        ValueError: ``n`` is not a positive integer.
        RuntimeError: JAX already started with a different number of devices.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"use_cpu_devices(n) needs a positive integer, got {n!r}")
    if backend_started():
        have = jax.device_count()
        if have != n or jax.default_backend() != "cpu":
            raise RuntimeError(
                f"JAX already started with {have} {jax.default_backend()} device(s); "
                f"use_cpu_devices({n}) must run before the first JAX operation. Call it at the "
                "top of your script or notebook (before creating any array), or restart the "
                "kernel.")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)
    from ._quiet import register_plugins

    register_plugins()  # now, quietly: the CUDA plugin logs to stderr as it registers


_VMAPPED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("shardkit_vmapped_axes",
                                                                         default=frozenset())


def vmapped_axes() -> frozenset[str]:
    """Mesh axes an enclosing ``jax.vmap(..., spmd_axis_name=...)`` maps over while a function is
    traced (``sk.DiLoCo``'s replica axis around its replicas' step; see ``vmapping_over``)."""
    return _VMAPPED.get()


@contextlib.contextmanager
def vmapping_over(*axes: str) -> Iterator[None]:
    """Declares that what is traced inside runs under ``jax.vmap(spmd_axis_name=axes)``.

    A building block that opens its own ``jax.shard_map`` manual over some axes (``sk.pipeline``,
    ``sk.moe``, ``sk.context_attention``; all through ``block_shard_map``) adds these axes to
    its manual set: jax 0.10.2 rejects
    a shard_map that leaves a vmap's spmd axis to the compiler ("Axes mentioned in
    `manual_axis_type` ... should be of type `Manual`"), while one that makes it manual too
    batches correctly (each slice of the mapped dimension on its own devices, no collective over
    the mapped axis). The block's own specs never name these axes: vmap adds them.
    """
    token = _VMAPPED.set(_VMAPPED.get() | frozenset(axes))
    try:
        yield
    finally:
        _VMAPPED.reset(token)


def block_shard_map(body, *, mesh, axis_names, in_specs, out_specs, check_vma: bool = True):
    """``jax.shard_map`` for a building block manual over ``axis_names`` (its own axis, a
    pipeline's data axes), the rest left to the compiler.

    Under ``vmapping_over(...)`` the vmap's axes are made manual too, and the varying-axes
    check is off there: jax 0.10.2's batching of the body broadcasts unbatched values without
    casting them to vary over the vmap's axis (nor infers that its outputs do), then rejects
    mixing them. It is a type check only: every block at H=1 under DiLoCo still equals data
    parallelism (tests/test_diloco.py). ``check_vma=False`` turns it off for a body that calls
    Pallas kernels, whose outputs carry no varying axes (``sk.moe``'s grouped matmuls).
    """
    mapped = vmapped_axes()
    return jax.shard_map(body, mesh=mesh, axis_names=set(axis_names) | mapped, in_specs=in_specs,
                         out_specs=out_specs, check_vma=check_vma and not mapped)


def backend_started() -> bool:
    """Whether JAX has started its backends (after which the device set and ``XLA_FLAGS`` are
    fixed). Asks a private JAX function (jax 0.10 has no public query that does not start the
    backend); if it moves this raises instead of answering wrongly."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def parse_mesh_spec(spec: MeshSpec, n_devices: int | None = None) -> list[tuple[str, int]]:
    """Parses a mesh layout into ``[(axis, size), ...]``, inferring one ``-1`` size.

    Args:
        spec: ``"data=2,tensor=4"``, ``{"data": 2, "tensor": 4}`` or ``[("data", 2), ...]``.
        n_devices: the device count the sizes must multiply to (also fills in ``-1``).

    Raises:
        ValueError: naming the bad entry: empty or duplicate names, non-integer or
            non-positive sizes, more than one ``-1``, or a product that is not ``n_devices``.
    """
    pairs = _pairs(spec)
    if not pairs:
        raise ValueError(f"mesh spec {spec!r} names no axes; write e.g. 'data=8' or 'data=2,tensor=4'")
    names = [n for n, _ in pairs]
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"mesh axis name {name!r} in {spec!r} is not an identifier; use names like 'data', 'fsdp', 'tensor', 'pipe'")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"mesh spec {spec!r} names axis {', '.join(map(repr, dup))} more than once")
    sizes = []
    for name, size in pairs:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ValueError(f"mesh axis {name!r} has size {size!r}; sizes are integers (or -1 for 'the rest')")
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis {name!r} has size {size}; sizes are positive (or -1 for 'the rest')")
        sizes.append(int(size))
    unknown = [n for n, s in zip(names, sizes) if s == -1]
    if len(unknown) > 1:
        raise ValueError(f"mesh spec {spec!r} has -1 for {unknown}; at most one axis can be inferred")
    known = math.prod(s for s in sizes if s != -1)
    if unknown:
        if n_devices is None:
            raise ValueError(f"mesh spec {spec!r} has a -1 axis but no device count to infer it from")
        if n_devices % known:
            raise ValueError(
                f"mesh spec {spec!r}: cannot infer {unknown[0]!r}: {n_devices} devices are not "
                f"divisible by the other axes' product {known}")
        sizes = [n_devices // known if s == -1 else s for s in sizes]
    elif n_devices is not None and known != n_devices:
        sizes_txt = " x ".join(f"{n}={s}" for n, s in zip(names, sizes))
        raise ValueError(
            f"mesh spec {spec!r} needs {known} devices ({sizes_txt}) but {n_devices} are "
            f"available; make the sizes multiply to {n_devices}, or use -1 for one axis")
    return list(zip(names, sizes))


def _pairs(spec: MeshSpec) -> list[tuple[str, object]]:
    if isinstance(spec, str):
        out = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            name, eq, size = part.partition("=")
            if not eq:
                raise ValueError(f"mesh spec entry {part!r} in {spec!r} is not 'axis=size'")
            name, size = name.strip(), size.strip()
            try:
                value: object = int(size)
            except ValueError:
                value = size
            out.append((name, value))
        return out
    if isinstance(spec, Mapping):
        return [(str(k), v) for k, v in spec.items()]
    try:
        return [(str(k), v) for k, v in spec]
    except (TypeError, ValueError):
        raise ValueError(f"mesh spec {spec!r} is not a string, dict or list of (axis, size) pairs") from None


def make_mesh(spec: MeshSpec, *, dcn: MeshSpec | None = None,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds a mesh with Auto (compiler-propagated) axis types.

    Args:
        spec: the fast (ICI / NVLink) axes, e.g. ``"data=2,fsdp=2,tensor=2"``; one size may
            be ``-1``.
        dcn: outer axes over the slow network between slices or hosts, e.g. ``"data=2"``.
            A DCN axis whose name also appears in ``spec`` is merged into it (DCN part
            outermost, so its neighbours stay within a slice); other DCN axes come first.
            Devices are grouped by slice, else by process, else (one process, simulated
            devices) into equal contiguous blocks.
        devices: the devices to use (default: all of ``jax.devices()``).

    Returns:
        A ``jax.sharding.Mesh`` whose axes are all ``AxisType.Auto``.

    Raises:
        ValueError: the sizes do not match the devices, or a spec is malformed.
    """
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ValueError("make_mesh got an empty device list")
    if dcn is None:
        axes = parse_mesh_spec(spec, len(devs))
        names = tuple(n for n, _ in axes)
        shape = tuple(s for _, s in axes)
        grid = _device_grid(shape, devs)
        return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
    dcn_axes = parse_mesh_spec(dcn)
    n_groups = math.prod(s for _, s in dcn_axes)
    if len(devs) % n_groups:
        raise ValueError(f"dcn={dcn!r} splits devices into {n_groups} groups but {len(devs)} devices are not divisible by {n_groups}")
    ici_axes = parse_mesh_spec(spec, len(devs) // n_groups)
    groups = _granules(devs, n_groups)
    ici_shape = tuple(s for _, s in ici_axes)
    blocks = np.stack([_device_grid(ici_shape, g) for g in groups])  # (groups, *ici)
    blocks = blocks.reshape(tuple(s for _, s in dcn_axes) + ici_shape)
    # Merge a DCN axis into the same-named ICI axis: move it next to its twin, then fuse.
    names = [n for n, _ in dcn_axes] + [n for n, _ in ici_axes]
    ici_names = [n for n, _ in ici_axes]
    order, out_names, out_shape = [], [], []
    n_dcn = len(dcn_axes)
    merged = {n for n, _ in dcn_axes if n in ici_names}
    for i, (n, s) in enumerate(dcn_axes):
        if n not in merged:
            order.append(i); out_names.append(n); out_shape.append(s)
    for j, (n, s) in enumerate(ici_axes):
        if n in merged:
            i = names.index(n)
            order.extend([i, n_dcn + j]); out_names.append(n); out_shape.append(s * dcn_axes[i][1])
        else:
            order.append(n_dcn + j); out_names.append(n); out_shape.append(s)
    grid = blocks.transpose(order).reshape(out_shape)
    return Mesh(grid, tuple(out_names), axis_types=(AxisType.Auto,) * len(out_names))


def _device_grid(shape: tuple[int, ...], devs: Sequence[jax.Device]) -> np.ndarray:
    if devs[0].platform in ("gpu", "tpu", "cuda", "rocm"):
        try:  # physical-topology-aware order (rings along the fast links)
            from jax.experimental import mesh_utils

            return mesh_utils.create_device_mesh(shape, devices=list(devs), allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            pass
    return np.asarray(devs, dtype=object).reshape(shape)


def _granules(devs: list[jax.Device], n: int) -> list[list[jax.Device]]:
    for attr in ("slice_index", "process_index"):
        keys = sorted({getattr(d, attr, 0) for d in devs})
        if len(keys) == n:
            return [[d for d in devs if getattr(d, attr, 0) == k] for k in keys]
    size = len(devs) // n
    return [devs[i * size:(i + 1) * size] for i in range(n)]


def describe_mesh(mesh: Mesh) -> str:
    """A readable description: axis sizes, then the device ids laid out on the grid."""
    axes = " x ".join(f"{n}={s}" for n, s in mesh.shape.items())
    kind = mesh.devices.flat[0].platform
    lines = [f"Mesh({axes}) on {mesh.devices.size} {kind} device(s)"]
    ids = np.vectorize(lambda d: d.id)(mesh.devices) if mesh.devices.size else mesh.devices
    if ids.ndim <= 1:
        lines.append(f"  {mesh.axis_names[0] if mesh.axis_names else ''}: {ids.tolist()}")
    else:
        rows = ids.reshape(-1, ids.shape[-1])
        lead = mesh.axis_names[:-1]
        for idx, row in zip(np.ndindex(*ids.shape[:-1]), rows):
            where = ",".join(f"{a}={i}" for a, i in zip(lead, idx))
            lines.append(f"  {where} -> {mesh.axis_names[-1]}: {row.tolist()}")  # no [..]: rich would read it as markup
    return "\n".join(lines)
