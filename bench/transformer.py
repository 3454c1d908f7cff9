"""Transformer recipe benchmark: tokens/s and MFU per layout, and compile time vs depth.

    python bench/transformer.py [--steps 8] [--layouts dp,fsdp_tp,...]

On 8 simulated CPU devices (they share the host's cores, so the 8-device figures are a
sanity check of overheads, not of scaling). Every layout is compared with the 1-device run
of the same model in the same process (a ratio), and the compile time of the step at 32
layers with that at 4 (the layer scan should keep the ratio near 1; target ≤ 1.3).
Prints a rich table and writes bench/results/transformer.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="timed steps per layout (median)")
    p.add_argument("--layouts", default=None, help="comma-separated names of models/transformer/layouts.py "
                   "(default: all)")
    p.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "transformer.json"))
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402

sk.use_cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from models.transformer import data as data_lib  # noqa: E402
from models.transformer.config import SIZES  # noqa: E402
from models.transformer.layouts import LAYOUTS, Layout, make_plan  # noqa: E402
from models.transformer.model import PipelineSpec, Transformer, flops_per_token, loss_fn  # noqa: E402
from shardkit.cost import hardware  # noqa: E402

CFG = SIZES["tiny"].replace(seq=128)
BATCH = 16


def build_step(layout: Layout, cfg, devices=None, precision="fp32"):
    mesh = sk.make_mesh(layout.mesh, devices=devices)
    plan = make_plan(mesh, cfg, zero=layout.zero, precision=precision,
                     sequence_parallel=layout.sequence_parallel, vocab_parallel=layout.vocab_parallel)
    pipe = PipelineSpec(4, layout.schedule, layout.repeats) if "pipe" in mesh.shape else None

    @sk.train_step(plan, optax.adamw(1e-3))
    def step(model, batch):
        return loss_fn(model, batch, pipe)

    return mesh, step


def measure(name: str, layout: Layout, batches, steps: int, devices=None) -> dict:
    mesh, step = build_step(layout, CFG, devices)
    state = step.init(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))
    t0 = time.perf_counter()
    step.lower(state, batches[0]).compile()
    compile_s = time.perf_counter() - t0
    state, m = step(state, batches[0])
    float(m["loss"])
    times = []
    for b in batches[1:steps + 1]:
        t = time.perf_counter()
        state, m = step(state, b)
        float(m["loss"])
        times.append(time.perf_counter() - t)
    dt = float(np.median(times))
    tps = BATCH * CFG.seq / dt
    peak = hardware.total_peak_flops(mesh.devices.flat)
    return {"layout": name, "mesh": layout.mesh, "zero": layout.zero,
            "sequence_parallel": layout.sequence_parallel,
            "schedule": layout.schedule if "pipe" in mesh.shape else None,
            "devices": int(mesh.devices.size), "step_ms": dt * 1e3, "tokens_per_s": tps,
            "mfu": flops_per_token(CFG) * tps / peak, "compile_s": compile_s,
            "final_loss": float(m["loss"])}


def compile_time(layers: int, repeats: int = 2) -> float:
    """Best-of-``repeats`` compile time of the data=8 train step at ``layers`` depth."""
    cfg = CFG.replace(layers=layers)
    _, step = build_step(Layout("data=8"), cfg)
    state = step.init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = {"inputs": np.zeros((BATCH, cfg.seq), np.int32),
             "targets": np.zeros((BATCH, cfg.seq), np.int32)}
    best = float("inf")
    for _ in range(repeats):
        step._jitted.clear()  # a fresh jit object each time: no cache hit
        lowered = step.lower(state, batch)
        t = time.perf_counter()
        lowered.compile()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    args = parse_args(argv)
    names = [n for n in args.layouts.split(",") if n] if args.layouts else list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"error: --layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    console = Console(width=140)
    train, _ = data_lib.stdlib_corpus(max_bytes=4 << 20)
    it = data_lib.Batches(train, BATCH, CFG.seq, seed=0)
    batches = [it.batch_at(i) for i in range(args.steps + 1)]
    host_peak = hardware.measure_cpu_peak()
    console.print(f"model {CFG}\nbatch {BATCH} x {CFG.seq} tokens, {flops_per_token(CFG) / 1e6:.2f} "
                  f"MFLOP/token; measured host f32 matmul peak {host_peak / 1e9:.0f} GFLOP/s")

    rows = [measure("1 device", Layout("data=1"), batches, args.steps, devices=jax.devices()[:1])]
    for name in names:
        console.print(f"  {name} ...")
        rows.append(measure(name, LAYOUTS[name], batches, args.steps))
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["vs_1_device"] = r["tokens_per_s"] / base

    c4, c32 = compile_time(4), compile_time(32)
    depth = {"layers_4_s": c4, "layers_32_s": c32, "ratio": c32 / c4, "target": 1.3}

    t = Table(title=f"transformer on {jax.device_count()} simulated CPU devices")
    for col in ("layout", "mesh", "zero", "step ms", "tokens/s", "vs 1 dev", "MFU", "compile s"):
        t.add_column(col, justify="right" if col not in ("layout", "mesh") else "left")
    for r in rows:
        mesh = r["mesh"] + (" +SP" if r["sequence_parallel"] else "") + (
            f" {r['schedule']}" if r["schedule"] else "")
        t.add_row(r["layout"], mesh, str(r["zero"]), f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['vs_1_device']:.2f}", f"{r['mfu']:.1%}", f"{r['compile_s']:.1f}")
    console.print(t)
    verdict = "ok" if depth["ratio"] <= depth["target"] else "ABOVE TARGET"
    console.print(f"compile time, data=8 step: 4 layers {c4:.2f} s, 32 layers {c32:.2f} s, "
                  f"ratio {depth['ratio']:.2f} (target <= {depth['target']}: {verdict})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": str(CFG), "batch": BATCH, "host_peak_flops": host_peak,
                               "layouts": rows, "compile_vs_depth": depth}, indent=1) + "\n")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
