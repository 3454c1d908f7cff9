"""Overlapped Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512 §2.3) against the
non-overlapped streaming it replaces: step time at the fragments' sync boundaries and final
validation loss, same model, tokens and fragments.

Every run is the transformer recipe on 8 simulated CPU devices (``replica=R,data=8/R``,
``--diloco-fragments F --diloco-every H``). Non-overlapped, a sync is its own program after the
boundary step (the replicas wait for it); overlapped (``--diloco-overlap τ --diloco-mix α``) the
fragment's all-reduce is part of the next step's program and its result merged τ steps later.
Per-step wall times come from the recipe's metrics (each step waits for its loss); "boundary"
steps are those in which a sync runs (non-overlapped: the step that ends an interval and the
next, since the sync program is dispatched after the first and waited for by the second),
compared with the median of the other steps of the same run. The step count is a multiple of
H plus one, so every run's last outer step is in its final θ_outer.

A second table times the compiled programs themselves, in one process (median of ``--reps``
interleaved repetitions, each blocked on its result): the inner step alone, the
non-overlapped boundary (inner step, then the sync program) and the overlapped boundary (one
program: inner step + the fragment's all-reduce and outer step), on a stacked MLP whose
parameters (``--width``, 8 layers) dwarf its compute, so the sync is visible.

    python bench/diloco_overlap.py [--steps 301 --every 50 --fragments 2 --runs 1/0.5,5/0.5,1/0]
    python bench/diloco_overlap.py --programs-only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--size", "tiny", "--seq", "64", "--batch", "16", "--eval-batches", "16"]


def run(a, overlap: int, mix: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "m.jsonl")
        cmd = [sys.executable, "-m", "models.transformer", "--quiet", "--metrics-out", out, *MODEL,
               "--mesh", a.mesh, "--steps", str(a.steps), "--eval-every", str(a.steps),
               "--diloco-every", str(a.every), "--diloco-fragments", str(a.fragments)]
        if overlap:
            cmd += ["--diloco-overlap", str(overlap), "--diloco-mix", str(mix)]
        t = time.perf_counter()
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(out)]
    tokens = 16 * 64
    dt = {r["step"]: tokens / r["tokens_per_s"] for r in rows if "tokens_per_s" in r}
    H, F = a.every, a.fragments
    ends = {s for s in dt if (s + 1) % (H // F) == 0}  # step index s completes step s+1
    # Non-overlapped: the sync runs after an interval's last step (its time lands there or in
    # the next step, which waits for it); overlapped: inside the next step's program.
    boundary = {s for e in ends for s in (e, e + 1) if s in dt and s > 1}
    other = [dt[s] for s in dt if s not in boundary and s > 1]
    return {"overlap": overlap, "mix": mix, "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
            "replica_bytes_per_step": rows[0]["replica_bytes_per_step"],
            "median_ms": 1e3 * statistics.median(other),
            "boundary_ms": 1e3 * statistics.mean(dt[s] for s in boundary),
            "boundary_max_ms": 1e3 * max(dt[s] for s in boundary),
            "step_ms": [round(1e3 * dt[s], 2) for s in sorted(dt)], "seconds": time.perf_counter() - t}


def program_times(a) -> list[dict]:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardkit as sk

    def loss(p, batch):
        h = batch["x"]
        for i in range(p["layers"].shape[0]):
            h = jnp.tanh(h @ p["layers"][i])
        return jnp.mean((h - batch["y"]) ** 2)

    d = a.width
    init = {"layers": jax.random.normal(jax.random.key(0), (8, d, d)) / np.sqrt(d)}
    rng = np.random.default_rng(0)
    raw = {"x": rng.normal(size=(16, d)).astype(np.float32), "y": rng.normal(size=(16, d)).astype(np.float32)}
    plan = sk.Plan(sk.make_mesh(a.mesh), rules=[(r".*", ())])
    rows = []
    for overlap in (0, 1):
        outer = sk.DiLoCo(every=8, fragments=2, layers=r"^layers$", overlap=overlap, mix=0.5 if overlap else 0.0)
        step = sk.train_step(plan, optax.adamw(1e-3), outer=outer)(loss)
        state = step.init(init)
        batch, shardings = step.place_batch(raw)
        progs = step.diloco.programs(state, batch, shardings)
        send = next((k for k in progs if k.startswith("inner+send/0")), None)  # τ=1: the merge is in it too
        boundary = ["inner", "sync/0"] if not overlap else [send]
        times = {"inner": [], "boundary": []}
        for _ in range(a.reps):
            for key, names in (("inner", ["inner"]), ("boundary", boundary)):
                t = time.perf_counter()
                for name in names:
                    out = progs[name](state, batch) if name.startswith("inner") else progs[name](state)
                    state = out[0] if name.startswith("inner") else out
                jax.block_until_ready(state)
                times[key].append(time.perf_counter() - t)
        sent = step.diloco.traffic(state, raw)
        rows.append({"overlap": overlap, "inner_ms": 1e3 * statistics.median(times["inner"]),
                     "boundary_ms": 1e3 * statistics.median(times["boundary"]),
                     "sync_bytes": sent["sync/0"] if not overlap else sent[send], "boundary": "+".join(boundary),
                     "params": int(np.prod(init["layers"].shape))})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="replica=4,data=2")
    ap.add_argument("--steps", type=int, default=301)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--runs", default="1/0.5,5/0.5,1/0", help="overlapped runs, τ/α pairs")
    ap.add_argument("--width", type=int, default=512, help="the program-time model's width (8 layers)")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--programs-only", action="store_true", help="only the program-time table")
    ap.add_argument("--out", default="bench/results/diloco_overlap.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    progs = program_times(a)
    table = Table(title=f"Compiled programs, {a.mesh}, 8x{a.width}x{a.width} stacked MLP, 2 fragments, "
                        f"median of {a.reps}")
    for c in ("run", "inner step ms", "boundary step ms", "boundary / inner", "sync B/device"):
        table.add_column(c, justify="left" if c == "run" else "right")
    for r in progs:
        table.add_row(f"overlap τ=1: {r['boundary']}" if r["overlap"] else "no overlap: inner, then sync/0",
                      f"{r['inner_ms']:.2f}", f"{r['boundary_ms']:.2f}", f"{r['boundary_ms'] / r['inner_ms']:.2f}x",
                      f"{r['sync_bytes']:,}")
    Console(width=160).print(table)
    if a.programs_only:
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(os.path.splitext(a.out)[0] + "_programs.json", "w") as f:
            json.dump({"args": vars(a), "programs": progs}, f, indent=1)
        return

    results = [run(a, 0, 0.0)]
    for pair in a.runs.split(","):
        tau, mix = pair.split("/")
        results.append(run(a, int(tau), float(mix)))
    base = results[0]
    table = Table(title=f"Streaming DiLoCo, {a.mesh}, H={a.every}, {a.fragments} fragments, {a.steps} steps")
    cols = ("run", "val loss", "vs streaming", "median step ms", "boundary step ms (mean / max)", "boundary / median",
            "replica B/step")
    for c in cols:
        table.add_column(c, justify="left" if c == "run" else "right")
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in results:
        name = "streaming (no overlap)" if not r["overlap"] else f"overlap τ={r['overlap']}, α={r['mix']}"
        cells = [name, f"{r['val_loss']:.4f}", f"{100 * (r['val_loss'] / base['val_loss'] - 1):+.2f}%",
                 f"{r['median_ms']:.1f}", f"{r['boundary_ms']:.1f} / {r['boundary_max_ms']:.1f}",
                 f"{r['boundary_ms'] / r['median_ms']:.2f}x", f"{r['replica_bytes_per_step']:,.0f}"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=160).print(table)
    print("\n".join(lines))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "model_flags": MODEL, "programs": progs, "results": results}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
