"""DiLoCo vs data parallelism at equal tokens: final validation loss against the bytes each
device sends over the replica axis (the slow link), on the transformer recipe's byte corpus.

Every run is the recipe (``python -m models.transformer``) on 8 simulated CPU devices with the
same model, batch, steps, inner AdamW and learning-rate schedule, so each sees the same tokens:
DP on ``replica=R,data=8/R`` (one gradient all-reduce over all 8 devices per step) and DiLoCo
(``--diloco-every H``: inner AdamW alone per replica, outer Nesterov SGD 0.7/0.9 every H
steps) for R = 2, 4 and H = 10, 50, 100. The bytes are read off the compiled programs
(collectives whose groups span ``replica``, ring formulas; DiLoCo's syncs amortised over H).
The ratio column is DP's bytes over the run's, on the same mesh.

    python bench/diloco.py [--steps 400] [--out bench/results/diloco.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--d-model", "64", "--layers", "2", "--heads", "2", "--seq", "64", "--batch", "16"]


def run(mesh: str, every: int | None, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "metrics.jsonl")
        cmd = [sys.executable, "-m", "models.transformer", "--mesh", mesh, "--steps", str(steps),
               "--eval-every", str(steps), "--eval-batches", "8", "--metrics-out", out, "--quiet", *MODEL, *extra]
        if every:
            cmd += ["--diloco-every", str(every)]
        t = time.perf_counter()
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(out)]
    return {"mesh": mesh, "every": every, "steps": steps,
            "replica_bytes_per_step": next(r["replica_bytes_per_step"] for r in rows if "replica_bytes_per_step" in r),
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
            "train_loss": [r["loss"] for r in rows if "loss" in r][-1], "seconds": time.perf_counter() - t}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", default="10,50,100")
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--extra", default="", help="more recipe flags for every run, e.g. '--diloco-compress int8'")
    ap.add_argument("--out", default="bench/results/diloco.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    extra = a.extra.split()
    results = []
    for r in (int(x) for x in a.replicas.split(",")):
        mesh = f"replica={r},data={8 // r}"
        for every in [None] + [int(x) for x in a.every.split(",")]:
            row = run(mesh, every, a.steps, extra)
            results.append(row)
            print(f"{mesh:18s} {'DP' if every is None else f'DiLoCo H={every}':14s} val {row['val_loss']:.4f}  "
                  f"{row['replica_bytes_per_step']:>12,.0f} B/step  ({row['seconds']:.0f} s)", flush=True)

    dp = {row["mesh"]: row for row in results if row["every"] is None}
    lines = ["| mesh | run | final val loss | Δ vs DP | replica-axis bytes/device/step | DP / run |",
             "|---|---|---:|---:|---:|---:|"]
    for row in results:
        base = dp[row["mesh"]]
        name = "DP" if row["every"] is None else f"DiLoCo H={row['every']}"
        lines.append(f"| {row['mesh']} | {name} | {row['val_loss']:.4f} | {row['val_loss'] - base['val_loss']:+.4f} | "
                     f"{row['replica_bytes_per_step']:,.0f} | {base['replica_bytes_per_step'] / row['replica_bytes_per_step']:.1f}x |")
    print("\n".join(lines))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model_flags": MODEL, "extra": extra, "results": results}, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r, marker in zip(sorted({row["mesh"] for row in results}), "os^"):
        rows = [row for row in results if row["mesh"] == r]
        ax.plot([row["replica_bytes_per_step"] for row in rows], [row["val_loss"] for row in rows], marker,
                label=r, linestyle="none")
        for row in rows:
            ax.annotate("DP" if row["every"] is None else f"H={row['every']}",
                        (row["replica_bytes_per_step"], row["val_loss"]), textcoords="offset points", xytext=(4, 4),
                        fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent over the replica axis per device per step")
    ax.set_ylabel(f"validation loss after {a.steps} steps")
    ax.set_title("DiLoCo vs data parallel at equal tokens")
    ax.legend()
    fig.tight_layout()
    png = os.path.splitext(a.out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {a.out} and {png}")


if __name__ == "__main__":
    main()
