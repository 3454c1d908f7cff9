"""What checksums cost: save and restore of a ~100 MB TrainState with and without them.

A run of ``python tests/scripts/ckpt_overhead.py [--mb 100] [--repeats 3] [--json out.json]``
prints, per layout, the median wall time (the two variants run alternately) of a synchronous save (``checksums=True`` vs
``False``), of a restore (verified vs a step saved without checksums, restored unverified) and
of the checksum pass alone, and the ratios. Times include Orbax's own work (device-to-host copy,
compression, file writes) on this machine's CPU devices (8 simulated).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import shardkit as sk

sk.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from shardkit.checkpoint import Checkpointer, array_checksums  # noqa: E402
from shardkit.checkpoint.damage import scan_files  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--mb", type=float, default=100, help="total state size (params + 2 Adam moments)")
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--json", default=None)
a = p.parse_args()

n_arrays = 8
rows = max(8, int(a.mb * 2**20 / 3 / n_arrays / 4 / 1024) // 8 * 8)  # float32 (rows, 1024) each


def init(key):
    keys = jax.random.split(key, n_arrays)
    return {f"w{i}": jax.random.normal(k, (rows, 1024)) for i, k in enumerate(keys)}


def timed(*fns) -> list[float]:
    """Median wall time of each of ``fns``, run alternately so that load from other processes
    on the machine falls on all of them alike."""
    times = [[] for _ in fns]
    for _ in range(a.repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


results = []
for layout, zero, rules in (("data=8", 0, [(r".*", ())]), ("fsdp=8", 3, [(r".*", ("fsdp", None))])):
    plan = sk.Plan(sk.make_mesh(layout), rules=rules, zero=zero)
    step = sk.train_step(plan, optax.adam(1e-3))(lambda prm, b: sum(jnp.mean(w) for w in prm.values()) * b["x"].mean())
    state = step.init(init)
    mb = sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20
    root = tempfile.mkdtemp(prefix="ckpt_overhead_")
    counter = iter(range(10**6))

    def save(checksums: bool):
        directory = os.path.join(root, f"{checksums}-{next(counter)}")
        with Checkpointer(directory, keep=None, async_save=False, checksums=checksums) as ckpt:
            ckpt.save(state, step=1)
        return directory

    t = time.perf_counter()
    array_checksums(state)  # compiles once per state structure: the first save of a run pays it
    first_pass = time.perf_counter() - t
    save(True)
    save(False)
    row = {"layout": f"{layout} zero={zero}", "state_mb": round(mb, 1)}
    row["save_s"], row["save_checksums_s"] = timed(lambda: save(False), lambda: save(True))
    verified, unverified = save(True), save(False)
    like = step.abstract_state(init)
    Checkpointer(verified).restore(plan, like=like)  # compile the verification once
    row["restore_s"], row["restore_verified_s"] = timed(
        lambda: jax.block_until_ready(Checkpointer(unverified).restore(plan, like=like)),
        lambda: jax.block_until_ready(Checkpointer(verified).restore(plan, like=like)))
    row["checksum_pass_s"], = timed(lambda: array_checksums(state))
    row["first_pass_s"] = first_pass
    row["index_scan_s"], = timed(lambda: scan_files(os.path.join(verified, "1", "state")))
    row["save_ratio"] = row["save_checksums_s"] / row["save_s"]
    row["restore_ratio"] = row["restore_verified_s"] / row["restore_s"]
    results.append(row)
    shutil.rmtree(root)

cols = ["layout", "state_mb", "save_s", "save_checksums_s", "save_ratio", "restore_s", "restore_verified_s",
        "restore_ratio", "checksum_pass_s", "first_pass_s", "index_scan_s"]
print(" | ".join(cols))
for row in results:
    print(" | ".join(f"{row[c]:.3f}" if isinstance(row[c], float) else str(row[c]) for c in cols))
if a.json:
    with open(a.json, "w") as f:
        json.dump(results, f, indent=1)
sys.exit(0)
