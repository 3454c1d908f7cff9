"""The step-time roofline against the H200 run of ``bench/gpu.py`` (BENCHMARKS.md, "GPU").

The two recipe steps that run measured on one H200 — ResNet-50 v1.5 at batch 256 (224×224,
bf16, SGD) and the ~1B transformer at batch 8 × 2048 (bf16, AdamW, ``flops_per_token`` as
``bench/gpu.py`` passes it) — timed by the step-time model without the GPU: the analytic
estimate (the traced pass's kernels, what ``explain()`` prints as ``time/step``) and, with
``--compile``, the step-time model on the kernels of the program XLA:GPU compiles for an H200
deviceless (``Report.step_time``). The measured step times are the GPU run's.

    PYTHONPATH=. python bench/step_roofline.py [--compile]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# bench/gpu.py on one H200, 2026-11-28 (BENCHMARKS.md, "GPU"): measured step seconds.
MEASURED = {"resnet50": 38.2e-3, "transformer-1b": 254.6e-3}


def build(name: str):
    """``(step, abstract state, abstract batch, flops_per_token)`` of one measured step on a
    1-device mesh of this process (the estimate re-plans it for the target)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import shardkit as sk

    if name == "resnet50":
        from models.resnet.config import Config
        from models.resnet.model import ResNet
        from models.resnet.train import make_optimizer, make_plan, make_step

        cfg = Config(depth=50, num_classes=1000, stem="imagenet")
        step = make_step(make_plan(sk.make_mesh("data=1"), precision="bf16"), make_optimizer("sgd", 0.1, steps=1000))
        state = step.abstract_state(lambda: ResNet(cfg, rngs=nnx.Rngs(0)))
        batch = {"image": jax.ShapeDtypeStruct((256, 224, 224, 3), jnp.float32),
                 "label": jax.ShapeDtypeStruct((256,), jnp.int32)}
        return step, state, batch, None
    from models.transformer.config import SIZES
    from models.transformer.layouts import make_plan
    from models.transformer.model import Transformer, flops_per_token, loss_fn

    cfg = SIZES["1b"]
    step = sk.train_step(make_plan(sk.make_mesh("data=1"), cfg, precision="bf16"),
                         optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1))(lambda model, b: loss_fn(model, b))
    state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    batch = {k: jax.ShapeDtypeStruct((8, cfg.seq), jnp.int32) for k in ("inputs", "targets")}
    return step, state, batch, flops_per_token(cfg)


def analytic(step, state, batch, fpt, target: str) -> dict:
    """The estimate for ``target`` without compiling: the step re-planned on an abstract mesh of
    one such device, traced and read (as ``simulate``'s estimate is)."""
    import jax
    import jax.numpy as jnp

    from shardkit.cost.analytic.from_step import step_estimate
    from shardkit.cost.compiled.simulated import _on, abstract_inputs, abstract_mesh, simulated_plan

    sim = step.with_plan(simulated_plan(step.plan, abstract_mesh("data=1", target=target)))
    state = state.replace(model_state=jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), state.model_state))
    state, batch = abstract_inputs(sim, state, batch)
    with _on(sim.plan):
        return step_estimate(sim, state, batch, hardware=target, flops_per_token=fpt).time


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile", action="store_true", help="also compile for an H200 deviceless (minutes)")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "step_roofline.json"))
    args = p.parse_args(argv)
    import shardkit as sk

    sk.use_cpu_devices(1)
    rows = []
    for name, measured in MEASURED.items():
        step, state, batch, fpt = build(name)
        t = analytic(step, state, batch, fpt, "h200")
        row = {"model": name, "measured_s": measured, "analytic_s": t["step"], "analytic_memory_s": t["memory-bound"],
               "measured_over_analytic": measured / t["step"]}
        if args.compile:
            r = sk.cost.simulate(step, state, batch, "data=1", target="h200", flops_per_token=fpt, timeout=3600)
            row.update(compiled_s=r.step_time["step"], compiled_memory_s=r.step_time["memory-bound"],
                       measured_over_compiled=measured / r.step_time["step"])
        rows.append(row)
        print(f"{name}: measured {measured * 1e3:.1f} ms; analytic {t['step'] * 1e3:.1f} ms (memory-bound "
              f"{t['memory-bound'] * 1e3:.1f}), measured/analytic {row['measured_over_analytic']:.2f}"
              + (f"; compiled kernels {row['compiled_s'] * 1e3:.1f} ms (memory-bound "
                 f"{row['compiled_memory_s'] * 1e3:.1f}), measured/compiled {row['measured_over_compiled']:.2f}"
                 if args.compile else ""), flush=True)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
