"""The tiny MLP on layouts whose model axes cross the process boundary: tensor parallelism and
ZeRO-3 spanning two processes. Imported by the test (its 1-process x 8-device reference) and run
as a 2-process job (``shardkit launch --processes 2 --devices-per-process 4``).

As a job, every process trains each layout of ``LAYOUTS`` (or those named by ``--layout``) for
``--steps`` steps in turn, loading only the rows ``distributed.local_rows`` gives it, and prints
one line per layout:
``RESULT {json}`` with its process index, the processes of every group along the layout's
cross-process axis, the share of each parameter this process holds, the largest difference
between the global batch it built and the full batch, the losses (``float.hex``) and (process 0
only) the final state gathered from both processes. It exits non-zero if an axis that must span
both processes does not.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tiny  # beside this file: on sys.path when run as a script, and put there by the tests
from jax.experimental import multihost_utils

import shardkit as sk
from shardkit import distributed
from shardkit.mesh import parse_mesh_spec

# (name, mesh, zero, rules, cross-process axis, whether to reorder devices so that the axis's
# groups mix processes). Rules name the tiny MLP's weights; "tensor"/"fsdp" absent from a mesh
# are dropped per layout.
_TP = [(r"w1", (None, "tensor")), (r"w2", ("tensor", None)), (r".*", ())]
_FSDP_RULES = [(r"w1", (None, "fsdp")), (r"w2", ("fsdp", None)), (r".*", ())]
_REPLICATE = [(r".*", ())]
LAYOUTS = {
    # Tensor groups of 4 hold 2 devices of each process (a plain reshape would keep each group
    # inside one process); each process then sits in both data rows and loads the whole batch.
    "data=2,tensor=4 (tensor across processes)": ("data=2,tensor=4", 0, _TP, "tensor", True),
    "tensor=8": ("tensor=8", 0, _TP, "tensor", False),
    # ZeRO-3 alone shards every leaf (the rules replicate) over all 8 devices.
    "fsdp=8 zero3": ("fsdp=8", 3, _REPLICATE, "fsdp", False),
    # fsdp outermost: process 0 holds fsdp 0,1 and process 1 fsdp 2,3, each data pair inside one
    # process; the rules shard the weights over fsdp and ZeRO-3 adds data.
    "fsdp=4,data=2 zero3 (fsdp across processes)": ("fsdp=4,data=2", 3, _FSDP_RULES, "fsdp", False),
}


def host_groups(devices, n: int) -> list[list]:
    """The devices split into ``n`` hosts: by process index on a real job, else in contiguous
    halves (a 1-process reference gets the very same device positions)."""
    procs = sorted({d.process_index for d in devices})
    if len(procs) == n:
        return [sorted((d for d in devices if d.process_index == p), key=lambda d: d.id) for p in procs]
    k = len(devices) // n
    return [list(devices[i * k:(i + 1) * k]) for i in range(n)]


def crossed(devices, rows: int) -> list:
    """Device order for a ``(rows, cols)`` mesh whose every row takes ``cols / 2`` devices from
    each of two hosts."""
    a, b = host_groups(devices, 2)
    half = len(a) // rows
    return [d for r in range(rows) for d in a[r * half:(r + 1) * half] + b[r * half:(r + 1) * half]]


def build(name: str, devices=None):
    """``(plan, step)`` of layout ``name`` on ``devices`` (default: all)."""
    mesh_spec, zero, rules, _axis, cross = LAYOUTS[name]
    devs = list(jax.devices() if devices is None else devices)
    if cross:
        devs = crossed(devs, rows=parse_mesh_spec(mesh_spec)[0][1])
    mesh = sk.make_mesh(mesh_spec, devices=devs)
    rules = [(r, tuple(a if a in mesh.shape else None for a in spec)) for r, spec in rules]
    plan = sk.Plan(mesh, rules=sk.PathRules(rules), zero=zero)

    @sk.train_step(plan, optax.adam(1e-2))
    def step(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None, :])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    return plan, step


def axis_groups(mesh, axis: str) -> list[list[int]]:
    """The process index of every device, one list per group along ``axis``."""
    grid = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
    return [[d.process_index for d in row] for row in grid.reshape(-1, grid.shape[-1])]


def held_share(x) -> float:
    """The share of a global array's elements whose shards live on this process's devices."""
    mask = np.zeros(x.shape, bool)
    for s in x.addressable_shards:
        mask[s.index] = True
    return float(mask.mean()) if x.ndim else 1.0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layout", action="append", help="a name from LAYOUTS (repeat it; default: all)")
    a = p.parse_args()
    names = a.layout or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"--layout: unknown {unknown}; choose from {list(LAYOUTS)}")

    if distributed.initialize(timeout_s=60, heartbeat_timeout_s=20) is None:
        raise SystemExit("run under `shardkit launch --processes 2 --devices-per-process 4`")
    me, bad = jax.process_index(), []
    for name in names:
        axis = LAYOUTS[name][3]
        plan, step = build(name)
        groups = axis_groups(plan.mesh, axis)
        if any(set(g) != set(range(jax.process_count())) for g in groups):
            bad.append(f"{name}: a group along {axis!r} stays inside one process: {groups}")
        rows = distributed.local_rows(plan, tiny.BATCH)
        state = step.init(tiny.init_params, seed=0)
        share = {k: held_share(v) for k, v in state.params.items()}
        losses, batch_diff = [], 0.0
        for i in range(a.steps):
            local, full = tiny.batch(i, rows), tiny.batch(i)
            placed, shardings = step.place_batch(local)  # the path the step takes
            for g in (placed, distributed.to_global(local, shardings)):
                got = multihost_utils.process_allgather(g, tiled=True)
                batch_diff = max(batch_diff, *(float(np.abs(got[k] - full[k]).max()) if got[k].shape == full[k].shape
                                               else float("inf") for k in full))
            state, metrics = step(state, local)
            losses.append(float(metrics["loss"]).hex())
        final = [np.asarray(x).tolist() for x in jax.tree.leaves(multihost_utils.process_allgather(state, tiled=True))]
        out = {"layout": name, "process": me, "rows": [rows.start, rows.stop], "groups": groups,
               "held": share, "batch_diff": batch_diff, "loss": losses}
        if me == 0:
            out["state"] = final
        print("RESULT " + json.dumps(out), flush=True)
    for line in bad:
        print(line, file=sys.stderr, flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
