"""DiLoCo where the paper measured it (Douillard et al. 2023, arXiv:2311.08105 §3): a data-parallel
warm start, then M replicas syncing every H inner steps, against DP continued for the same
tokens; final validation loss against the bytes each device sends over the replica axis.

Every run is the transformer recipe (``python -m models.transformer``) on 8 simulated CPU
devices, on its byte corpus (the Python standard library), with one learning-rate schedule
(warmup + cosine over warm-start + continuation steps, inner AdamW):

1. warm start: DP on ``replica=8`` for ``--warm`` steps (``--stop-after``), checkpointed;
2. DP continued from that checkpoint for ``--steps`` more (``--init-from``);
3. DiLoCo from the same checkpoint (``--init-from``: every replica and θ_outer start from it,
   the outer Nesterov state fresh) on ``replica=M,data=8/M`` for M in ``--replicas`` and H in
   ``--every``, the same continuation steps and batch, so each sees the same tokens (each
   replica 1/M of every batch);
4. DP for one step on each ``replica=M,data=8/M`` mesh, for its bytes per step over ``replica``.

Bytes are read off the compiled programs (collectives whose groups span ``replica``, ring
formulas; DiLoCo's syncs amortised over H). Each finished run is appended to
``<out>.jsonl`` at once (a cut-off grid keeps its rows; ``--report`` redraws the table and
plot from them).

    python bench/diloco_protocol.py [--warm 1000 --steps 1000 --replicas 8,4,2 --every 50,100,250,500]
    python bench/diloco_protocol.py --report
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--size", "tiny", "--seq", "64", "--batch", "16", "--eval-batches", "16"]


def recipe(args: list[str], out: str) -> list[dict]:
    cmd = [sys.executable, "-m", "models.transformer", "--quiet", "--metrics-out", out, *MODEL, *args]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in open(out)]


def mesh_of(replicas: int) -> str:
    return "replica=8" if replicas == 8 else f"replica={replicas},data={8 // replicas}"


def record(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    name = row["run"]
    val = f"val {row['val_loss']:.4f}" if "val_loss" in row else ""
    print(f"{row['mesh']:18s} {name:28s} {val:11s} {row['replica_bytes_per_step']:>12,.0f} B/step  "
          f"({row['seconds']:.0f} s)", flush=True)


def run_grid(a) -> None:
    work = os.path.join(a.work, "warm")
    total = str(a.warm + a.steps)
    sched = ["--steps", total, "--eval-every", str(a.eval_every)]
    jsonl = a.out + "l"
    done = set()
    if os.path.exists(jsonl):
        done = {(r["mesh"], r["run"]) for r in map(json.loads, open(jsonl))}
    if not (os.path.isdir(work) and any(n.isdigit() for n in os.listdir(work))):
        t = time.perf_counter()
        rows = recipe([*sched, "--mesh", "replica=8", "--stop-after", str(a.warm), "--checkpoint-dir", work,
                       "--checkpoint-every", str(a.warm)], os.path.join(a.work, "warm.jsonl"))
        record(jsonl, {"mesh": "replica=8", "run": f"DP warm start ({a.warm} steps)", "steps": a.warm,
                       "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
                       "curve": [(r["step"] + 1, r["val_loss"]) for r in rows if "val_loss" in r],
                       "replica_bytes_per_step": rows[0]["replica_bytes_per_step"],
                       "seconds": time.perf_counter() - t})
    grid = [("replica=8", "DP", [])]
    outers = [o.split("/") for o in a.outer.split(",")]
    for m in (int(x) for x in a.replicas.split(",")):
        for h in (int(x) for x in a.every.split(",")):
            for lr, mom in outers:
                name = f"DiLoCo H={h}" + ("" if (lr, mom) == ("0.7", "0.9") else f" outer {lr}/{mom}")
                grid.append((mesh_of(m), name,
                             ["--diloco-every", str(h), "--diloco-outer-lr", lr, "--diloco-outer-momentum", mom,
                              *a.extra.split()]))
    for mesh, name, flags in grid:
        if (mesh, name) in done:
            continue
        t = time.perf_counter()
        rows = recipe([*sched, "--mesh", mesh, "--init-from", work, *flags], os.path.join(a.work, "run.jsonl"))
        record(jsonl, {"mesh": mesh, "run": name, "steps": a.steps,
                       "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
                       "curve": [(r["step"] + 1, r["val_loss"]) for r in rows if "val_loss" in r],
                       "replica_bytes_per_step": rows[0]["replica_bytes_per_step"],
                       "seconds": time.perf_counter() - t})
    for m in sorted({int(x) for x in a.replicas.split(",")} - {8}):
        mesh = mesh_of(m)
        if (mesh, "DP bytes") in done:
            continue
        t = time.perf_counter()
        rows = recipe(["--steps", "1", "--eval-every", "1", "--eval-batches", "1", "--mesh", mesh],
                      os.path.join(a.work, "probe.jsonl"))
        record(jsonl, {"mesh": mesh, "run": "DP bytes", "replica_bytes_per_step": rows[0]["replica_bytes_per_step"],
                       "seconds": time.perf_counter() - t})


def report(a) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = [json.loads(line) for line in open(a.out + "l")]
    dp = next((r for r in rows if r["run"] == "DP"), None)
    dp_bytes = {r["mesh"]: r["replica_bytes_per_step"] for r in rows if r["run"] in ("DP", "DP bytes")}
    dp_bytes.setdefault("replica=8", next((r["replica_bytes_per_step"] for r in rows if r["run"].startswith("DP warm")),
                                          None))
    table = Table(title="DiLoCo after a DP warm start vs DP continued, equal tokens")
    for c in ("mesh", "run", "final val loss", "vs DP", "replica-axis B/device/step", "DP / run", "s"):
        table.add_column(c, justify="left" if c in ("mesh", "run") else "right")
    lines = ["| mesh | run | final val loss | vs DP | replica-axis bytes/device/step | DP / run |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "val_loss" not in r:
            continue
        rel = f"{100 * (r['val_loss'] / dp['val_loss'] - 1):+.2f}%" if dp and "warm" not in r["run"] else ""
        base = dp_bytes.get(r["mesh"])
        ratio = f"{base / r['replica_bytes_per_step']:,.0f}x" if base and r["replica_bytes_per_step"] else ""
        cells = [r["mesh"], r["run"], f"{r['val_loss']:.4f}", rel, f"{r['replica_bytes_per_step']:,.0f}", ratio]
        table.add_row(*cells, f"{r['seconds']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    Console(width=150).print(table)
    print("\n".join(lines))
    with open(a.out, "w") as f:
        json.dump({"model_flags": MODEL, "results": rows}, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cx) = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"replica=8": "o", "replica=4,data=2": "s", "replica=2,data=4": "^"}
    for mesh, marker in markers.items():
        pts = [r for r in rows if r["mesh"] == mesh and r["run"].startswith("DiLoCo")]
        if pts:
            ax.plot([r["replica_bytes_per_step"] for r in pts], [r["val_loss"] for r in pts], marker,
                    linestyle="none", label=f"DiLoCo, {mesh.split(',')[0].split('=')[1]} replicas")
            for r in pts:
                ax.annotate(r["run"].replace("DiLoCo ", ""), (r["replica_bytes_per_step"], r["val_loss"]),
                            textcoords="offset points", xytext=(4, 3), fontsize=7)
    if dp:
        ax.plot([dp["replica_bytes_per_step"]], [dp["val_loss"]], "k*", markersize=10, label="DP continued")
        ax.axhline(dp["val_loss"] * 1.02, color="gray", linestyle=":", label="DP + 2%")
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent over the replica axis per device per step")
    ax.set_ylabel("final validation loss (nats/byte)")
    ax.set_title("Warm-started DiLoCo vs DP, equal tokens", fontsize=10)
    ax.legend(fontsize=7)
    for r in rows:
        if r.get("curve"):
            steps, vals = zip(*r["curve"])
            style = "k-" if r["run"] == "DP" else ("k:" if "warm" in r["run"] else "-")
            cx.plot(steps, vals, style, label=f"{r['run']}, {r['mesh'].split(',')[0]}", linewidth=1)
    cx.set_xlabel("step")
    cx.set_ylabel("validation loss")
    cx.set_title("Validation loss during the continuation", fontsize=10)
    cx.legend(fontsize=6)
    fig.tight_layout()
    png = os.path.splitext(a.out)[0] + ".png"
    fig.savefig(png, dpi=120)
    print(f"wrote {a.out} and {png}")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=1000, help="DP warm-start steps")
    ap.add_argument("--steps", type=int, default=1000, help="continuation steps (DP and every DiLoCo run)")
    ap.add_argument("--replicas", default="8,4,2")
    ap.add_argument("--every", default="50,100,250,500")
    ap.add_argument("--outer", default="0.7/0.9", help="outer lr/momentum pairs, e.g. 0.7/0.9,1.0/0")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--extra", default="", help="more recipe flags for every DiLoCo run")
    ap.add_argument("--work", default="/tmp/diloco_protocol", help="warm-start checkpoint and scratch files")
    ap.add_argument("--out", default="bench/results/diloco_protocol.json")
    ap.add_argument("--report", action="store_true", help="only redraw the table and plot from <out>l")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    if not a.report:
        run_grid(a)
    report(a)


if __name__ == "__main__":
    main()
