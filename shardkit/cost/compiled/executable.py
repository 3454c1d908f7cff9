"""A compiled program read into a ``Report``: XLA's ``memory_analysis()`` (device and host
memory), and the post-partitioning HLO's collectives and matmul flops (``hlo``), counted as
executed — an op inside a ``while`` body (a ``lax.scan`` over layers or microbatches) counts
``known_trip_count`` times.
"""

from __future__ import annotations

import re

from .branches import branch_collectives
from .hlo.collectives import collectives_from_hlo, traffic_from_hlo
from .hlo.matmuls import matmul_flops_from_hlo, rewritten_matmuls
from .hlo.text import shape_bytes
from .kernels import kernels_from_hlo
from .report import Report
from ..pipeline_note import pipeline_branch_weights


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device bytes of a compiled program from XLA's ``memory_analysis()``: ``arguments``,
    ``outputs``, ``aliased`` (donated), ``temporaries`` and ``peak`` = arguments + outputs −
    aliased + temporaries (XLA's buffer assignment, not a measured high-water mark); ``{}``
    where the backend reports nothing. A program that holds anything in host memory (offloaded
    state or activations: ``sk.offload``) adds the same figures for host memory, ``host_*``;
    the device figures exclude them."""
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    args, outs = ma.argument_size_in_bytes, ma.output_size_in_bytes
    alias, temp = ma.alias_size_in_bytes, ma.temp_size_in_bytes
    out = {"arguments": args, "outputs": outs, "aliased": alias, "temporaries": temp,
           "peak": args + outs - alias + temp}
    host = [getattr(ma, f"host_{k}_size_in_bytes", 0) for k in ("argument", "output", "alias", "temp")]
    if not any(host):
        # XLA:CPU counts host-memory parameters among its arguments and reports no host
        # bytes: read them off the entry layout (memory space 5) and move them across.
        h_args, h_outs = host_bytes_from_layout(compiled.as_text())
        if h_args or h_outs:
            h_alias = min(h_args, h_outs, alias)
            out.update({"arguments": args - h_args, "outputs": outs - h_outs, "aliased": alias - h_alias,
                        "peak": (args - h_args) + (outs - h_outs) - (alias - h_alias) + temp})
            host = [h_args, h_outs, h_alias, 0]
    if any(host):
        h_args, h_outs, h_alias, h_temp = host
        out.update({"host_arguments": h_args, "host_outputs": h_outs, "host_aliased": h_alias,
                    "host_temporaries": h_temp, "host_peak": h_args + h_outs - h_alias + h_temp})
    return out


_HOST_SHAPE = re.compile(r"\b[a-z]+[0-9]*[a-z0-9]*\[[0-9,]*\]\{[^}]*S\(5\)[^}]*\}")  # a shape in memory space 5


def host_bytes_from_layout(hlo: str) -> tuple[int, int]:
    """``(argument bytes, output bytes)`` per device that a compiled program's entry layout
    puts in host memory (memory space 5: ``S(5)`` in a layout, e.g. ``f32[8,16]{1,0:S(5)}``)."""
    head = hlo[:hlo.find("\n")] if "\n" in hlo else hlo
    start = head.find("entry_computation_layout={")
    if start < 0:
        return 0, 0
    i, depth = start + len("entry_computation_layout={"), 1
    for j in range(i, len(head)):
        depth += {"{": 1, "}": -1}.get(head[j], 0)
        if depth == 0:
            break
    args, _, outs = head[i:j].partition(")->")

    def host(text: str) -> int:
        return sum(shape_bytes(shape) for shape in _HOST_SHAPE.findall(text))
    return host(args), host(outs)


def report_from_compiled(compiled, title: str, memory: dict[str, int] | None = None,
                         mesh=None, data_axes: tuple[str, ...] = (), pipeline: dict | None = None) -> Report:
    """A ``Report`` for any compiled JAX program (``jax.jit(f).lower(...).compile()``).

    With ``mesh`` the collectives are also attributed to mesh axes (``Report.traffic``).
    ``pipeline`` (``sk.pipeline``'s trace note) names the pipe axis, and for 1F1B weights the
    branches of its per-tick ``lax.switch`` by how often the schedule table takes each
    (averaged over stages), so collectives and matmuls inside a backward branch count m times,
    not once per tick.
    """
    weights = pipeline_branch_weights(pipeline) if pipeline else None
    mem = {**(memory or {}), **compiled_memory(compiled)}
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    hlo = compiled.as_text()
    traffic = traffic_from_hlo(hlo, dict(mesh.shape), weights) if mesh is not None else []
    return Report(title, mem, collectives_from_hlo(hlo), flops, traffic=traffic,
                  matmul_flops=matmul_flops_from_hlo(hlo, weights), data_axes=tuple(data_axes),
                  pipe_axis=(pipeline or {}).get("axis"),
                  fp8_matmul_flops=matmul_flops_from_hlo(hlo, weights, fp8_only=True),
                  unread_matmuls=rewritten_matmuls(hlo),
                  kernels=[(k.flops, k.bytes, k.count) for k in kernels_from_hlo(hlo, weights)],
                  branch_collectives=branch_collectives(hlo, dict(mesh.shape)) if mesh is not None else [])
