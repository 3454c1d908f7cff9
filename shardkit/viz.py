"""Pictures for notebooks and the CLI (matplotlib): how an array is laid out on the mesh, the
per-device memory of layouts, and a comparison chart of ``sk.search`` results.

Every function returns a ``matplotlib.figure.Figure``; ``save(fig, path)`` writes a PNG.
Nothing here needs a display (the figures use the Agg canvas when no backend is set).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from .rules import entry_axes, to_spec

_MEMORY_KINDS = ("params", "opt_state", "grads", "activations", "batch")
_COLORS = {"params": "#4c72b0", "opt_state": "#dd8452", "grads": "#55a868", "activations": "#c44e52",
           "batch": "#8172b3", "temporaries": "#937860", "other": "#999999"}


def _figure(w: float, h: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained")


def save(fig, path: str, dpi: int = 120) -> str:
    """Writes ``fig`` to ``path`` (PNG by extension) and returns the path."""
    fig.savefig(path, dpi=dpi)
    return path


def device_blocks(shape: Sequence[int], spec, mesh: Mesh) -> dict[int, tuple[slice, ...]]:
    """Which block of an array of ``shape`` each device holds under ``spec``: device id →
    index (one slice per dimension). Replicated dimensions give every device the whole range.

    Raises:
        ValueError: a spec axis is not in the mesh or does not divide its dimension.
    """
    spec = to_spec(spec)
    sizes = dict(mesh.shape)
    names = list(mesh.axis_names)
    out = {}
    for pos in np.ndindex(*mesh.devices.shape):
        coord = dict(zip(names, pos))
        idx = []
        for d, n in enumerate(shape):
            axes = entry_axes(spec[d]) if d < len(spec) else ()
            for a in axes:
                if a not in sizes:
                    raise ValueError(f"spec {spec} names mesh axis {a!r}, not in the mesh {sizes}")
            parts = math.prod(sizes[a] for a in axes)
            if n % parts:
                raise ValueError(f"dim {d} of size {n} does not split over {axes} (= {parts}); pick a spec that divides it")
            k = 0
            for a in axes:  # row-major over the spec's axes: the first is the outermost
                k = k * sizes[a] + coord[a]
            step = n // parts
            idx.append(slice(k * step, (k + 1) * step))
        out[int(mesh.devices[pos].id)] = tuple(idx)
    return out


def array_layout(shape: Sequence[int], spec, mesh: Mesh, *, title: str | None = None):
    """Draws a 1-D or 2-D array (higher ranks: the last two dims) as its grid of blocks,
    each labelled with the devices that hold it — which device holds which block."""
    shape = tuple(shape)
    spec = to_spec(spec)
    blocks = device_blocks(shape, spec, mesh)
    shape2 = (1,) + shape if len(shape) == 1 else shape[-2:]
    offset = len(shape) - len(shape2) + (1 if len(shape) == 1 else 0)
    holders: dict[tuple, list[int]] = {}
    for dev, idx in blocks.items():
        idx2 = ((slice(0, 1),) + idx) if len(shape) == 1 else idx[-2:]
        if len(shape) > 2 and any(s.start != 0 for s in idx[:offset]):
            continue  # show the leading block of the extra dims
        key = tuple((s.start, s.stop) for s in idx2)
        holders.setdefault(key, []).append(dev)
    fig = _figure(6.5, 4.2 if shape2[0] > 1 else 2.0)
    ax = fig.add_subplot()
    cmap = _cmap(len(holders))
    for i, (key, devs) in enumerate(sorted(holders.items())):
        (r0, r1), (c0, c1) = key
        ax.add_patch(_rect(c0, r0, c1 - c0, r1 - r0, cmap(i)))
        label = "dev " + ",".join(map(str, sorted(devs))) if len(devs) <= 4 else f"{len(devs)} devs: {min(devs)}…{max(devs)}"
        ax.text((c0 + c1) / 2, (r0 + r1) / 2, label, ha="center", va="center", fontsize=8)
    ax.set_xlim(0, shape2[1]); ax.set_ylim(shape2[0], 0)
    ax.set_xlabel(f"dim {len(shape) - 1} ({shape[-1]}) — {spec[len(shape) - 1] if len(spec) >= len(shape) else None}")
    if len(shape) > 1:
        ax.set_ylabel(f"dim {len(shape) - 2} ({shape[-2]}) — {spec[len(shape) - 2] if len(spec) >= len(shape) - 1 else None}")
    mesh_txt = ", ".join(f"{n}={s}" for n, s in mesh.shape.items())
    ax.set_title(title or f"array {shape}, spec {spec}\non mesh ({mesh_txt})", fontsize=10)
    return fig


def _rect(x, y, w, h, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=1.0)


def _cmap(n: int):
    import matplotlib

    base = matplotlib.colormaps["tab20"]
    return lambda i: base(i % 20)


def memory_bars(layouts: Mapping[str, Any], *, limit: float | None = None, title: str = "per-device memory"):
    """Stacked bars of per-device memory per layout.

    Args:
        layouts: name → an ``Estimate``, an ``sk.Report`` or a dict of bytes by kind
            (``params``, ``opt_state``, ``grads``, ``activations``, ``batch``; a ``peak`` or
            ``temporaries`` beyond those shows as "other").
        limit: draw the device's memory as a line (bytes).
    """
    names = list(layouts)
    fig = _figure(max(5.0, 1.1 * len(names) + 2), 4.0)
    ax = fig.add_subplot()
    bottoms = np.zeros(len(names))
    mems = [_memory_of(v) for v in layouts.values()]
    scale, unit = _unit(max((m.get("peak", sum(m.get(k, 0) for k in _MEMORY_KINDS)) for m in mems), default=1))
    for kind in _MEMORY_KINDS + ("other",):
        vals = []
        for m in mems:
            if kind == "other":
                known = sum(m.get(k, 0) for k in _MEMORY_KINDS)
                vals.append(max(m.get("peak", known) - known, 0))
            else:
                vals.append(m.get(kind, 0))
        vals = np.asarray(vals, float) / scale
        if vals.any():
            ax.bar(names, vals, bottom=bottoms, label=kind, color=_COLORS[kind])
            bottoms += vals
    if limit:
        ax.axhline(limit / scale, color="red", linestyle="--", label="device memory")
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    return fig


def _memory_of(v) -> dict:
    if isinstance(v, Mapping):
        return dict(v)
    mem = dict(getattr(v, "memory", {}))
    if "activations" not in mem and "temporaries" in mem:  # a compiled Report
        mem = {"params": mem.get("params", 0), "opt_state": mem.get("opt_state", 0),
               "batch": mem.get("batch", 0), "peak": mem.get("peak", 0)}
    return mem


def _unit(x: float) -> tuple[float, str]:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if x >= scale:
            return scale, unit
    return 1.0, "bytes"


def compare_layouts(result, *, top: int = 10, title: str | None = None):
    """Two panels for an ``sk.search`` result: step time split into compute / pipeline bubble /
    exposed communication per layout, and peak memory per device against the limit."""
    ests = result.estimates[:top]
    labels = [f"#{i + 1} {e.layout.mesh}\nz{e.layout.zero} m{e.layout.microbatches} {e.layout.remat}"
              for i, e in enumerate(ests)]
    fig = _figure(max(7.0, 0.9 * len(ests) + 3), 6.0)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    x = np.arange(len(ests))
    # step = compute (at the achievable matmul efficiency) + bubble + exposed communication
    parts = (("compute", "compute"), ("bubble", "pipeline bubble"), ("exposed", "exposed communication"))
    bottom = np.zeros(len(ests))
    for part, label in parts:
        vals = np.asarray([e.time.get(part, 0.0) for e in ests])
        if vals.any():
            ax1.bar(x, vals, bottom=bottom, label=label)
            bottom += vals
    ax1.set_ylabel("step time (s)")
    ax1.legend(fontsize=7)
    ax1.set_title(title or f"{result.model} on {result.devices} x {result.hardware}: top {len(ests)} layouts", fontsize=10)
    mem = np.asarray([e.memory["peak"] for e in ests]) / 1e9
    ax2.bar(x, mem, color=["#55a868" if e.fits else "#c44e52" for e in ests])
    if ests and math.isfinite(ests[0].memory_limit):
        ax2.axhline(ests[0].memory_limit / 1e9, color="red", linestyle="--", label="memory limit")
        ax2.legend(fontsize=7)
    ax2.set_ylabel("peak GB / device")
    ax2.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    return fig


def estimate_vs_compiled(rows: Sequence[Mapping], *, title: str = "estimate / compiled"):
    """Horizontal bars of estimate/compiled ratios from ``Report.comparison()`` rows."""
    rows = [r for r in rows if r["compiled"]]
    fig = _figure(6.5, 0.3 * len(rows) + 1.2)
    ax = fig.add_subplot()
    ratios = [r["estimate"] / r["compiled"] for r in rows]
    ax.barh([r["quantity"] for r in rows], ratios,
            color=["#55a868" if abs(q - 1) <= 0.1 else "#c44e52" for q in ratios])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvspan(0.9, 1.1, color="#55a868", alpha=0.15)
    ax.set_title(title, fontsize=10)
    ax.tick_params(axis="y", labelsize=7)
    return fig


__all__ = ["array_layout", "device_blocks", "memory_bars", "compare_layouts", "estimate_vs_compiled", "save"]
del P


def pipeline_schedule(tab, *, title: str | None = None, ax=None):
    """A pipeline schedule drawn as the papers do (Qi et al. 2024; Narayanan et al. 2021): one
    row per device, one cell per tick, F / B / W (or fused BW) cells coloured per microbatch —
    F light, B mid, W and BW dark —, ``/c`` naming the chunk when a device holds several;
    idle cells left white (the bubble).

    Args:
        tab: an ``sk.pipeline_schedule(...)`` table.
        title: the figure title (default: the schedule, sizes and bubble).
        ax: draw into this matplotlib axes instead of a new figure.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    import matplotlib
    from matplotlib.colors import to_rgb

    from .pipeline.schedules import IDLE, OP_LETTERS, B, F, W

    ticks, p = tab.op.shape
    fig = ax.figure if ax is not None else _figure(max(4.0, 0.32 * ticks + 1.0), 0.45 * p + 0.9)
    ax = ax if ax is not None else fig.add_subplot(1, 1, 1)
    color = lambda i: matplotlib.colormaps["tab10"](i % 10)  # noqa: E731 - one hue per microbatch
    shade = {F: 0.55, B: 0.2, W: 0.0}  # blend towards white: F lightest, W / BW full colour
    for t in range(ticks):
        for s in range(p):
            op = int(tab.op[t, s])
            if op == IDLE:
                ax.add_patch(_rect(t, s, 1, 1, "white"))
                continue
            base = np.array(to_rgb(color(int(tab.mb[t, s]))))
            ax.add_patch(_rect(t, s, 1, 1, tuple(base + (1 - base) * shade.get(op, 0.0))))
            label = f"{OP_LETTERS[op]}{tab.mb[t, s]}" + (f"/{tab.chunk[t, s]}" if tab.repeats > 1 else "")
            ax.text(t + 0.5, s + 0.5, label, ha="center", va="center", fontsize=6)
    ax.set_xlim(0, ticks)
    ax.set_ylim(p, 0)
    ax.set_yticks(np.arange(p) + 0.5, [f"device {s}" for s in range(p)], fontsize=8)
    ax.set_xticks([])
    ax.set_xlabel("tick (one F, B or W slot; BW is a fused backward)", fontsize=8)
    ax.set_title(title or f"{tab.name}: p={tab.stages} m={tab.microbatches}"
                 + (f" v={tab.repeats}" if tab.repeats > 1 else "")
                 + f", bubble {tab.bubble_fraction:.3f}", fontsize=10)
    return fig
