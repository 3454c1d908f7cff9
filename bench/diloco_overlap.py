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

    python bench/diloco_overlap.py [--steps 301 --every 50 --fragments 2 --runs 1/0.5,5/0.5,1/0]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", default="replica=4,data=2")
    ap.add_argument("--steps", type=int, default=301)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--fragments", type=int, default=2)
    ap.add_argument("--runs", default="1/0.5,5/0.5,1/0", help="overlapped runs, τ/α pairs")
    ap.add_argument("--out", default="bench/results/diloco_overlap.json")
    a = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

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
        json.dump({"args": vars(a), "model_flags": MODEL, "results": results}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
