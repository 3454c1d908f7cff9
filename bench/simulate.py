"""Compiled per-device memory of the transformer recipe on meshes that are not here, by the
compiler of the accelerator named (``--target h100``: XLA:GPU, ``tpu-v5p``: XLA:TPU, both
deviceless; ``cpu``: N simulated XLA:CPU devices).

The recipe's step (``models/transformer/plan.py``: its model, loss, AdamW and clip) is planned
on the target mesh, its state built abstractly (nothing allocated), and compiled for that mesh
by ``sk.cost.simulate_many`` in one subprocess. Columns: the compiler's per-device peak
(arguments + outputs − aliased + temporaries) against the device's memory, its parts, the
analytic estimate of the same peak (modelled) and their ratio, the executed collective bytes
per role, the modelled step time on the compiled flops and collectives, and the wall time
(export in this process, compile in the child).

    python bench/simulate.py [--target h100] [--size 1b] [--batch 256] [--seq 2048]
                             [--layouts fsdp=32,tensor=8:3 data=32,tensor=8:1 data=8,pipe=4,tensor=8:1:1f1b]

A layout is ``MESH:ZERO[:SCHEDULE[:MICROBATCHES]]``; with a ``pipe`` axis the recipe runs
``sk.pipeline`` with that schedule (default gpipe) and microbatches (default 2 × stages),
without one MICROBATCHES is gradient accumulation (SCHEDULE is then ignored: write ``-``).
``--sp`` turns on sequence parallelism for every layout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", help="transformer size (models/transformer/config.py SIZES)")
    ap.add_argument("--layouts", nargs="+",
                    default=["fsdp=32,tensor=8:3", "data=32,tensor=8:1", "data=8,pipe=4,tensor=8:1:1f1b"],
                    help="MESH:ZERO[:SCHEDULE], e.g. fsdp=32,tensor=8:3")
    ap.add_argument("--batch", type=int, default=256, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the size's)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--remat", default=None, help="the model's remat policy (default: the size's)")
    ap.add_argument("--attention", default=None, help="Config.attention (default auto: the target's flash kernel; "
                    "reference: the (T, T) program before issue 35)")
    ap.add_argument("--loss-chunk", type=int, default=None, help="Config.loss_chunk (default -1: auto; 0: plain loss)")
    ap.add_argument("--sp", action="store_true", help="sequence parallelism over tensor")
    ap.add_argument("--target", default="cpu", help="h100, h200, a100, b200, tpu-v5e, tpu-v5p, tpu-v6e, cpu")
    ap.add_argument("--out", default=None, help="JSON rows (default bench/results/simulate_<target>.json)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402


def main(argv=None) -> None:
    a = parse_args(argv)
    a.out = a.out or f"bench/results/simulate_{a.target}.json"
    sk.use_cpu_devices(1)  # this process only traces; the compile runs in the child
    from rich.console import Console
    from rich.table import Table

    from models.transformer.config import SIZES
    from models.transformer.model import flops_per_token
    from models.transformer.plan import abstract_step

    cfg = SIZES[a.size] if a.seq is None else SIZES[a.size].replace(seq=a.seq)
    if a.remat:
        cfg = cfg.replace(remat=a.remat)
    if a.attention is not None:
        cfg = cfg.replace(attention=a.attention)
    if a.loss_chunk is not None:
        cfg = cfg.replace(loss_chunk=a.loss_chunk)
    gib = 2 ** 30
    t = Table(title=f"transformer {a.size} ({cfg.d_model}x{cfg.layers}, seq {cfg.seq}, remat {cfg.remat}), "
                    f"global batch {a.batch}, {a.precision}: compiled for {a.target}")
    for c in ("mesh", "zero", "devices", "peak GiB", "of device", "args", "temps", "est. peak",
              "est/compiled", "grad-reduce", "param-gather", "tensor-reduce", "pipe-permute",
              "step ms", "export s", "compile s"):
        t.add_column(c, justify="left" if c == "mesh" else "right")
    jobs, names = [], []
    for spec in a.layouts:
        parts = spec.split(":")
        mesh_spec, zero = parts[0], int((parts[1:2] or ["0"])[0])
        schedule, mb = (parts[2:3] or ["gpipe"])[0], (parts[3:4] or [None])[0]
        piped = "pipe=" in mesh_spec
        step, state, batch = abstract_step(
            cfg, mesh_spec, global_batch=a.batch, zero=zero, precision=a.precision, schedule=schedule,
            repeats=2 if schedule in ("circular", "interleaved-1f1b") else 1,
            pipeline_microbatches=int(mb) if mb and piped else None,
            microbatches=int(mb) if mb and not piped else 1, sequence_parallel=a.sp, target=a.target)
        jobs.append({"step": step, "state": state, "batch": batch, "mesh": mesh_spec})
        names.append((spec, mesh_spec, zero, schedule if piped else (f"m={mb}" if mb else "")))
    t0 = time.perf_counter()
    reports = sk.cost.simulate_many(jobs, target=a.target, estimate=True, flops_per_token=flops_per_token(cfg))
    wall = time.perf_counter() - t0
    rows = []
    for (spec, mesh_spec, zero, schedule), r in zip(names, reports):
        if isinstance(r, Exception):
            need = getattr(r, "required", None)  # sk.cost.DoesNotFit: the compiler said how much
            t.add_row(spec, str(zero), "", f"{need / gib:.2f}" if need else f"[red]{type(r).__name__}[/red]",
                      "[red]over[/red]" if need else "", *[""] * 11)
            rows.append({"mesh": mesh_spec, "zero": zero, "schedule": schedule, "error": str(r)[:2000],
                         "required": getattr(r, "required", None), "available": getattr(r, "available", None)})
            continue
        m, est, roles = r.memory, r.estimate or {}, r.roles()
        step_s = (r.step_time or {}).get("step")
        rows.append({"mesh": mesh_spec, "zero": zero, "schedule": schedule, "devices": int(sk.cost.abstract_mesh(mesh_spec).size),
                     "memory": m, "device_memory": r.device_memory, "fits": r.fits,
                     "estimate_peak": est.get("memory/peak"), "roles": roles, "step_s": step_s,
                     "export_s": r.seconds["export"], "compile_s": r.seconds["compile"]})
        t.add_row(mesh_spec + (f" {schedule}" if schedule else ""), str(zero), str(rows[-1]["devices"]),
                  f"{m['peak'] / gib:.2f}", "fits" if r.fits else ("-" if r.fits is None else "[red]over[/red]"),
                  f"{m['arguments'] / gib:.2f}", f"{m['temporaries'] / gib:.2f}",
                  f"{est['memory/peak'] / gib:.2f}" if est else "-",
                  f"{est['memory/peak'] / m['peak']:.2f}" if est else "-",
                  *(f"{roles[k] / gib:.2f}" for k in ("grad-reduce", "param-gather", "tensor-reduce", "pipe-permute")),
                  f"{step_s * 1e3:.0f}" if step_s else "-",
                  f"{r.seconds['export']:.1f}", f"{r.seconds['compile']:.1f}")
    Console(width=200).print(t)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"size": a.size, "batch": a.batch, "seq": cfg.seq, "precision": a.precision, "target": a.target,
                   "attention": cfg.attention, "loss_chunk": cfg.loss_chunk,
                   "remat": cfg.remat, "wall_s": wall, "rows": rows}, f, indent=1)
    print(f"{len(jobs)} layouts compiled for {a.target} in {wall:.0f} s (one subprocess)")


if __name__ == "__main__":
    main()
