"""ResNet-50 at 224x224: images/s and per-device memory under DP vs ZeRO-3 (8 simulated devices).

Synthetic ImageNet-shaped batches (224x224x3, 1000 classes), AdamW, one ``data=N`` mesh, the
same model and batch for every ZeRO stage. Memory columns, per device:
- ``state``: persistent bytes (parameters + optimizer state + BatchNorm statistics), read from
  each array's sharding; ``formula``: shardkit's f32 form of the ZeRO paper's (Rajbhandari et
  al., SC'20, arXiv:1910.02054) for Adam: 12Ψ (DP), 4Ψ + 8Ψ/N (ZeRO-1/2), 12Ψ/N (ZeRO-3);
- ``peak``: XLA's compiled estimate (arguments + outputs − donated + temporaries), which adds
  activations and transient gradients.
Images/s are CPU figures from simulated devices sharing this machine's cores: compare the
stages with each other (the ratio), not with hardware. GPU figures need a GPU.

    python bench/resnet.py [--devices 8] [--batch 8] [--zero 0,3] [--steps 3] [--size 224]
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
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--depth", type=int, default=50)
    ap.add_argument("--batch", type=int, default=8, help="global batch (default 8: one image per device)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--zero", default="0,3", help="comma-separated ZeRO stages (default 0,3)")
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per stage, after one warm-up step")
    ap.add_argument("--out", default="bench/results/resnet.json")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402


def main(argv=None) -> None:
    a = parse_args(argv)
    sk.use_cpu_devices(a.devices)
    import jax
    from rich.console import Console
    from rich.table import Table

    from models.resnet import data
    from models.resnet.config import Config
    from models.resnet.train import compiled_memory, init_state, make_optimizer, make_plan, make_step, state_bytes_per_device

    n = a.devices
    cfg = Config(depth=a.depth, num_classes=1000, in_channels=3, stem="imagenet")
    mesh = sk.make_mesh(f"data={n}")
    stream = data.synthetic_imagenet(a.size).batches(a.batch, seed=0)
    batches = [next(stream) for _ in range(a.steps + 1)]
    console = Console(width=max(120, Console().width))
    console.print(sk.describe_mesh(mesh))
    rows = []
    for zero in (int(z) for z in a.zero.split(",")):
        plan = make_plan(mesh, zero=zero, precision=a.precision)
        step = make_step(plan, make_optimizer("adamw", 1e-3, steps=100))
        t0 = time.perf_counter()
        state = init_state(step, cfg)
        jax.block_until_ready(state)
        t_init = time.perf_counter() - t0
        t0 = time.perf_counter()
        mem = compiled_memory(step, state, batches[0])
        t_compile = time.perf_counter() - t0
        state, m = step(state, batches[0])  # warm-up
        jax.block_until_ready(m)
        t0 = time.perf_counter()
        for b in batches[1:]:
            state, m = step(state, b)
        jax.block_until_ready(m)
        dt = (time.perf_counter() - t0) / a.steps
        psi = sum(x.size for x in jax.tree.leaves(state.params))
        held = state_bytes_per_device(state)
        formula = 4 * psi / (n if zero == 3 else 1) + 8 * psi / (n if zero >= 1 else 1)
        rows.append({
            "zero": zero, "params": psi, "images_per_s": a.batch / dt, "step_s": dt,
            "init_s": t_init, "compile_s": t_compile, "loss": float(m["loss"]),
            "state_bytes": sum(held.values()), "state_parts": held, "formula_bytes": formula,
            "peak_bytes": mem.get("peak"), "temp_bytes": mem.get("temporaries"),
        })
        console.print(f"ZeRO-{zero}: {a.batch / dt:.2f} images/s, state {held}, peak {mem.get('peak')}")
    base = rows[0]
    t = Table(title=f"ResNet-{a.depth} {a.size}x{a.size}, batch {a.batch}, data={n} ({a.precision}, AdamW), per "
                    f"device; speed and savings relative to ZeRO-{base['zero']}")
    for col in ("ZeRO", "img/s", "speed", "state MiB", "formula MiB", "state/formula",
                "state saving (formula)", "peak MiB", "peak saving"):
        t.add_column(col, justify="right")
    for r in rows:
        r["state_ratio"] = base["state_bytes"] / r["state_bytes"]
        r["formula_ratio"] = base["formula_bytes"] / r["formula_bytes"]
        r["peak_ratio"] = base["peak_bytes"] / r["peak_bytes"] if r["peak_bytes"] else None
        r["speed_ratio"] = r["images_per_s"] / base["images_per_s"]
        t.add_row(str(r["zero"]), f"{r['images_per_s']:.2f}", f"{r['speed_ratio']:.2f}",
                  f"{r['state_bytes'] / 2**20:.1f}", f"{r['formula_bytes'] / 2**20:.1f}",
                  f"{r['state_bytes'] / r['formula_bytes']:.3f}",
                  f"{r['state_ratio']:.2f} ({r['formula_ratio']:.2f})",
                  f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] else "-",
                  f"{r['peak_ratio']:.2f}" if r["peak_ratio"] else "-")
    console.print(t)
    console.print("CPU figures from simulated devices; GPU images/s and memory need a GPU (none in this run).")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"config": vars(a), "device": jax.devices()[0].platform, "rows": rows}, f, indent=2)
    console.print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
