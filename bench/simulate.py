"""Compiled per-device memory of the transformer recipe on meshes that are not here.

The recipe's step (``models/transformer``: its model, loss, AdamW and clip) is planned on the
target mesh, its state built abstractly (``step.abstract_state``: nothing allocated), and
compiled for that mesh by ``sk.cost.simulate``: a subprocess with N simulated XLA:CPU devices.
Columns: XLA's per-device peak (arguments + outputs − aliased + temporaries), its parts, the
analytic estimate of the same peak (modelled) and their ratio, the executed collective bytes
per role, and the wall time (export in this process, compile in the child, total).

    python bench/simulate.py [--size 1b] [--batch 256] [--seq 2048]
                             [--layouts fsdp=32,tensor=8:3 data=32,tensor=8:1 data=8,pipe=4,tensor=8:1:1f1b]

A layout is ``MESH:ZERO[:SCHEDULE]``; with a ``pipe`` axis the recipe runs ``sk.pipeline``
with 2 × stages microbatches and that schedule (default gpipe).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardkit as sk  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", help="transformer size (models/transformer/config.py SIZES)")
    ap.add_argument("--layouts", nargs="+",
                    default=["fsdp=32,tensor=8:3", "data=32,tensor=8:1", "data=8,pipe=4,tensor=8:1:1f1b"],
                    help="MESH:ZERO[:SCHEDULE], e.g. fsdp=32,tensor=8:3")
    ap.add_argument("--batch", type=int, default=256, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the size's)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--out", default="bench/results/simulate.json")
    a = ap.parse_args()
    sk.use_cpu_devices(1)  # this process only traces; the compile runs in the child
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from rich.console import Console
    from rich.table import Table

    from models.transformer.config import SIZES
    from models.transformer.layouts import make_plan
    from models.transformer.model import PipelineSpec, Transformer, flops_per_token, loss_fn

    cfg = SIZES[a.size] if a.seq is None else SIZES[a.size].replace(seq=a.seq)
    batch = {k: jax.ShapeDtypeStruct((a.batch, cfg.seq), np.int32) for k in ("inputs", "targets")}
    gib = 2 ** 30
    t = Table(title=f"transformer {a.size} ({cfg.d_model}x{cfg.layers}, seq {cfg.seq}), global batch "
                    f"{a.batch}, {a.precision}: compiled on simulated XLA:CPU devices")
    for c in ("mesh", "zero", "devices", "peak GiB", "args", "temps", "est. peak", "est/compiled",
              "grad-reduce", "param-gather", "tensor-reduce", "export s", "compile s", "total s"):
        t.add_column(c, justify="left" if c == "mesh" else "right")
    rows = []
    for spec in a.layouts:
        parts = spec.split(":")
        mesh_spec, zero, schedule = parts[0], (parts[1:2] or ["0"])[0], (parts[2:3] or ["gpipe"])[0]
        mesh = sk.cost.abstract_mesh(mesh_spec)
        stages = mesh.shape.get("pipe", 1)
        pipe = PipelineSpec(2 * stages, schedule, 2 if schedule == "circular" else 1) if stages > 1 else None
        # As the recipe's train.py: 1F1B keeps the vocabulary whole beside data and tensor axes.
        vocab_parallel = not (pipe and schedule == "1f1b" and mesh.shape.get("tensor", 1) > 1)
        plan = make_plan(mesh, cfg, zero=int(zero), precision=a.precision, vocab_parallel=vocab_parallel)
        step = sk.train_step(plan, optax.adamw(3e-4), clip_norm=1.0)(lambda m, b, pipe=pipe: loss_fn(m, b, pipe))
        state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        t0 = time.perf_counter()
        r = sk.cost.simulate(step, state, batch, mesh, flops_per_token=flops_per_token(cfg))
        wall = time.perf_counter() - t0
        export_s, compile_s = r.seconds["export"], r.seconds["compile"]
        m, est, roles = r.memory, r.estimate or {}, r.roles()
        row = {"mesh": mesh_spec, "zero": plan.zero, "schedule": schedule if pipe else "", "devices": mesh.size, "memory": m,
               "estimate_peak": est.get("memory/peak"), "roles": roles, "export_s": export_s,
               "compile_s": compile_s, "total_s": wall}
        rows.append(row)
        t.add_row(mesh_spec + (f" {schedule}" if pipe else ""), str(plan.zero), str(mesh.size), f"{m['peak'] / gib:.2f}",
                  f"{m['arguments'] / gib:.2f}", f"{m['temporaries'] / gib:.2f}",
                  f"{est['memory/peak'] / gib:.2f}" if est else "-",
                  f"{est['memory/peak'] / m['peak']:.2f}" if est else "-",
                  *(f"{roles[k] / gib:.2f}" for k in ("grad-reduce", "param-gather", "tensor-reduce")),
                  f"{export_s:.1f}", f"{compile_s:.1f}", f"{wall:.1f}")
    Console(width=200).print(t)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"size": a.size, "batch": a.batch, "seq": cfg.seq, "precision": a.precision, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
