"""fp8 against bf16: the recipe's loss curves over 200 steps on CPU (XLA emulates the fp8
matmuls), and what XLA:GPU compiles for H100s (deviceless): the share of matmul flops in fp8
GEMMs and the modelled step time with those flops at the fp8 peak.

The bound (derived in BENCHMARKS.md, "fp8"): E4M3 rounds x / scale to 4 significant bits, a
relative error uniform in ±2^-4, so each operand is off by 2^-4/sqrt(3) RMS and a product of two
by rho = sqrt(2/3)·2^-4 ≈ 0.051; a matmul's output, a sum of such products with independent
errors, is off by rho of its RMS. Every matmul of the step carries at most that relative noise,
so the fp8 run's loss, smoothed over 20 steps (the step-to-step noise of the batches averages
out), stays within rho of the bf16 run's: |mean20(fp8) − mean20(bf16)| ≤ rho · mean20(bf16).

    python bench/fp8.py [--steps 200] [--size tiny] [--mesh data=4,fsdp=2]
                        [--target-size 7b --gpus 8 64]   # the H100 part (deviceless)
                        [--skip-cpu] [--skip-target]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RHO = math.sqrt(2 / 3) * 2.0 ** -4


def run_recipe(precision: str, a, directory: str) -> list[float]:
    """The recipe's per-step training loss for ``precision`` (its command line, a subprocess)."""
    out = os.path.join(directory, f"{precision}.jsonl")
    cmd = [sys.executable, "-m", "models.transformer", "--size", a.size, "--mesh", a.mesh, "--zero", "1",
           "--precision", precision, "--steps", str(a.steps), "--batch", str(a.batch), "--eval-every", "0",
           "--metrics-out", out, "--quiet", "--seed", "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    with open(out) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "loss" in r]


def running_mean(xs: list[float], n: int) -> list[float]:
    return [sum(xs[max(0, i - n + 1):i + 1]) / len(xs[max(0, i - n + 1):i + 1]) for i in range(len(xs))]


def cpu_curves(a, console) -> dict:
    from rich.table import Table

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        bf16 = run_recipe("bf16", a, d)
        fp8 = run_recipe("fp8", a, d)
        seconds = time.perf_counter() - t0
    mb, mf = running_mean(bf16, 20), running_mean(fp8, 20)
    gaps = [(f - b) / b for f, b in zip(mf, mb)]
    worst = max(range(19, len(gaps)), key=lambda i: abs(gaps[i]))
    t = Table(title=f"recipe {a.size} on {a.mesh} (CPU, fp8 emulated by XLA): training loss, 20-step running mean")
    for c in ("step", "bf16", "fp8", "fp8 − bf16", "relative", "bound ρ"):
        t.add_column(c, justify="right")
    for i in list(range(19, len(bf16), 20)) + ([len(bf16) - 1] if (len(bf16) - 20) % 20 else []):
        t.add_row(str(i + 1), f"{mb[i]:.4f}", f"{mf[i]:.4f}", f"{mf[i] - mb[i]:+.4f}", f"{gaps[i]:+.2%}", f"{RHO:.2%}")
    console.print(t)
    console.print(f"largest |relative gap| of the running means (steps 20-{len(bf16)}): {abs(gaps[worst]):.2%} at step "
                  f"{worst + 1}; bound {RHO:.2%}: {'within' if abs(gaps[worst]) <= RHO else 'OUTSIDE'}. "
                  f"final loss bf16 {bf16[-1]:.4f}, fp8 {fp8[-1]:.4f}; {seconds:.0f} s for both runs")
    return {"bf16": bf16, "fp8": fp8, "max_gap": gaps[worst], "max_gap_step": worst + 1, "bound": RHO,
            "seconds": seconds}


def target_rows(a, console) -> list[dict]:
    from rich.table import Table

    import shardkit as sk
    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    cfg = SIZES[a.target_size].replace(remat="full")
    layouts = {8: [("data=8", 1)], 64: [("fsdp=64", 3)]}
    jobs, names = [], []
    for n in a.gpus:
        for mesh, zero in layouts[n]:
            for precision in ("bf16", "fp8"):
                step, state, batch = abstract_step(cfg, mesh, global_batch=n, zero=zero, precision=precision,
                                                   target="h100")
                jobs.append((step, state, batch, mesh))
                names.append((n, mesh, zero, precision))
    reports = sk.cost.simulate_many(jobs, target="h100", estimate=True, timeout=3600)
    t = Table(title=f"recipe {a.target_size} (remat full, 1 sequence of {cfg.seq} per GPU) compiled by XLA:GPU for H100s")
    for c in ("GPUs", "mesh", "ZeRO", "precision", "matmul TFLOP", "in fp8", "peak GiB", "step ms (modelled)", "vs bf16"):
        t.add_column(c, justify="left" if c in ("mesh", "precision") else "right")
    rows, base = [], {}
    for (n, mesh, zero, precision), r in zip(names, reports):
        if isinstance(r, Exception):
            t.add_row(str(n), mesh, str(zero), precision, "error", str(r)[:60], "", "", "")
            continue
        ms = r.step_time["step"] * 1e3
        base.setdefault((n, mesh), ms)
        rows.append({"gpus": n, "mesh": mesh, "zero": zero, "precision": precision, "matmul_flops": r.matmul_flops,
                     "fp8_matmul_flops": r.fp8_matmul_flops, "peak": r.memory["peak"], "step_ms": ms,
                     "step_time": r.step_time, "roles": r.roles(), "role_counts": r.role_counts()})
        t.add_row(str(n), mesh, str(zero), precision, f"{r.matmul_flops / 1e12:.1f}",
                  f"{r.fp8_matmul_flops / r.matmul_flops:.0%}", f"{r.memory['peak'] / 2**30:.2f}", f"{ms:,.0f}",
                  f"{ms / base[(n, mesh)]:.2f}")
    console.print(t)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--mesh", default="data=4,fsdp=2")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--target-size", default="7b")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--skip-cpu", action="store_true")
    ap.add_argument("--skip-target", action="store_true")
    ap.add_argument("--out", default="bench/results/fp8.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    import shardkit as sk

    sk.use_cpu_devices(1)  # this process only traces; runs and compiles are subprocesses
    from rich.console import Console

    console = Console(width=150)
    result = {}
    if not a.skip_cpu:
        result["cpu"] = cpu_curves(a, console)
    if not a.skip_target:
        result["h100"] = target_rows(a, console)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
