"""The cost model against the compiler, and the layouts ``sk.search`` picks.

Part 1 compiles every layout of the tests (a two-layer MLP pytree, an 8-layer pipelined
pytree under GPipe / circular / 1F1B, and the transformer recipe, 8 simulated CPU devices) and
prints estimate/compiled per device for parameters, optimizer state, arguments, peak memory and
executed collective bytes by role. Part 2 ranks layouts of the ~1B and ~7B transformer on 8,
64 and 256 H100s with the achievable-efficiency step-time model, and predicts weak scaling.
Writes bench/results/cost_model.json.

    python bench/cost_model.py            # everything (~3-4 min on 2 cores)
    python bench/cost_model.py --no-compile   # the search part only
    python bench/cost_model.py --robustness   # the transformer on two configs the tests do not use
    python bench/cost_model.py --families     # model families the formulas were not written for
                                              # (tests/families.py: MLP with a lookup, CNN, scanned GPT)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-compile", action="store_true", help="skip the compiled comparison")
    p.add_argument("--robustness", action="store_true",
                   help="only the comparison on two transformer configs the tests do not use")
    p.add_argument("--families", action="store_true",
                   help="only the comparison on model families the formulas were not written for")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "cost_model.json"))
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402

sk.use_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

QUANTITIES = ("memory/params", "memory/opt_state", "memory/arguments", "memory/temporaries",
              "memory/peak", "collective/grad-reduce", "collective/param-gather",
              "collective/tensor-reduce", "collective/tensor-gather", "collective/pipe-permute",
              "collective/pipe-reduce", "collective/pipe-relayout", "collective/other", "flops")
D, F, L, B = 256, 1024, 2, 64
TP_RULES = [("w1", (None, None, "tensor")), ("w2", (None, "tensor", None)), (".*", ())]


def mlp_cases():
    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"w1": jax.random.normal(k1, (L, D, F)) * 0.02, "w2": jax.random.normal(k2, (L, F, D)) * 0.02}

    def loss(p, batch):
        def layer(x, w):
            h = sk.constrain(jnp.tanh(x @ w[0]), ("batch", "mlp"))
            return sk.constrain(x + h @ w[1], ("batch", None)), None
        return jnp.mean(jax.lax.scan(layer, batch["x"], (p["w1"], p["w2"]))[0] ** 2)

    for mesh, zero, m, prec in [("data=8", 0, 1, "fp32"), ("data=8", 1, 1, "fp32"), ("data=8", 2, 1, "fp32"),
                                ("data=8", 3, 1, "fp32"), ("data=4,tensor=2", 0, 1, "fp32"),
                                ("data=4,tensor=2", 1, 1, "fp32"), ("data=8", 0, 2, "fp32"),
                                ("data=8", 0, 1, "bf16"), ("data=8", 3, 1, "bf16")]:
        tp = "tensor" in mesh
        plan = sk.Plan(sk.make_mesh(mesh), rules=TP_RULES if tp else [(".*", ())],
                       axis_rules={"batch": "data", "mlp": "tensor" if tp else None}, zero=zero, precision=prec)
        step = sk.train_step(plan, optax.adam(1e-3), microbatches=m)(loss)
        state = step.init(init)
        yield f"mlp {mesh} zero={zero} m={m} {prec}", step.explain(state, {"x": jnp.ones((B, D))})


def pipeline_cases():
    import numpy as np

    PD, PB, PL, PM = 128, 32, 8, 4

    def layer(lp, h):
        return jnp.tanh(h @ lp["w"] + lp["b"][None])

    def head(hp, y, t):
        return jnp.mean((y @ hp["w"] - t) ** 2)

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"layers": {"w": jax.random.normal(k1, (PL, PD, PD)) / np.sqrt(PD), "b": jnp.zeros((PL, PD))},
                "head": {"w": jax.random.normal(k2, (PD, PD)) / np.sqrt(PD)}}

    for mesh, schedule, v, zero in [("pipe=4", "gpipe", 1, 0), ("data=2,pipe=4", "gpipe", 1, 1),
                                    ("pipe=4", "circular", 2, 0), ("data=2,pipe=4", "circular", 2, 1),
                                    ("pipe=4", "1f1b", 1, 0), ("data=2,pipe=4", "1f1b", 1, 1)]:
        devs = jax.devices()[:4] if "data" not in mesh else None
        plan = sk.Plan(sk.make_mesh(mesh, devices=devs), rules=[(r"layers", ("pipe",)), (r".*", ())], zero=zero)

        def loss(model, batch, schedule=schedule, v=v):
            return sk.pipeline(layer, model["layers"], batch["x"], microbatches=PM, schedule=schedule,
                               repeats=v, loss_fn=head, loss_params=model["head"], targets=batch["t"])

        step = sk.train_step(plan, optax.adam(1e-3))(loss)
        state = step.init(init)
        batch = {"x": jnp.ones((PB, PD)), "t": jnp.ones((PB, PD))}
        yield f"pipe pytree {mesh} zero={zero} {schedule}{'x' + str(v) if v > 1 else ''} m={PM}", \
            step.explain(state, batch)


def transformer_cases(d_model=64, layers=4, seq=32, batch_size=16, microbatches=4, only=None, tag=""):
    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.layouts import LAYOUTS, make_plan
    from models.transformer.model import PipelineSpec, Transformer, flops_per_token, loss_fn

    cfg = SIZES["test"].replace(d_model=d_model, heads=4, kv_heads=4, layers=layers, seq=seq)
    tokens = jnp.zeros((batch_size, cfg.seq), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    for name, lo in LAYOUTS.items():
        if only is not None and name not in only:
            continue
        mesh = sk.make_mesh(lo.mesh)
        plan = make_plan(mesh, cfg, zero=lo.zero, sequence_parallel=lo.sequence_parallel,
                         vocab_parallel=lo.vocab_parallel)
        pipe = PipelineSpec(microbatches, lo.schedule, lo.repeats) if "pipe" in mesh.shape else None
        step = sk.train_step(plan, optax.adam(1e-3))(lambda mdl, b, pipe=pipe: loss_fn(mdl, b, pipe))
        state = step.init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        try:
            report = step.explain(state, batch, flops_per_token=flops_per_token(cfg, cfg.seq))
        except Exception as e:  # noqa: BLE001 - a layout the recipe cannot run is reported, not fatal
            print(f"transformer {name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        yield f"transformer{tag} {name} ({lo.mesh}, zero={lo.zero}{', sp' if lo.sequence_parallel else ''}" \
              f"{', ' + lo.schedule if pipe else ''})", report


def robustness_cases():
    """The transformer layouts on two configs the tests do not use (bigger activations; deeper
    stages and more microbatches), to see the model hold off the tuned configs."""
    yield from transformer_cases(128, 4, 64, 32, 4, tag=" d128/T64/b32",
                                 only=("pp_1f1b", "dp_pp_tp_1f1b", "pp_gpipe", "pp_circular", "tp_pp",
                                       "tp", "fsdp_tp", "tp_sp"))
    yield from transformer_cases(64, 8, 32, 32, 8, tag=" L8/m8",
                                 only=("pp_1f1b", "pp_gpipe", "pp_circular", "dp_pp_tp", "tp", "hybrid"))


def family_cases():
    """The families of ``tests/families.py`` on DP, ZeRO-1/2/3, TP and a 3-axis hybrid, at the
    tests' sizes and at 8x their batch (activations then outweigh the weights)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import families as F

    for rows in (None, 256):
        for fam in F.FAMILIES:
            for mesh, zero in F.LAYOUTS:
                step, state, batch = F.build(fam, mesh, zero, rows=rows)
                yield f"{fam} {mesh} zero={zero}" + (f" batch={rows}" if rows else ""), step.explain(state, batch)


def compare(console: Console, robustness: bool = False, families: bool = False) -> list[dict]:
    rows = []
    t = Table(title="estimate / compiled, per device (8 simulated CPU devices)")
    t.add_column("layout")
    short = [q.split("/")[-1] for q in QUANTITIES]
    for s in short:
        t.add_column(s, justify="right")
    groups = ((robustness_cases(),) if robustness else (family_cases(),) if families
              else (mlp_cases(), pipeline_cases(), transformer_cases()))
    for cases in groups:
        for name, report in cases:
            got = {r["quantity"]: r for r in report.comparison()}
            row = {"layout": name}
            cells = []
            for q in QUANTITIES:
                r = got.get(q)
                if r is None or (not r["estimate"] and not r["compiled"]):
                    cells.append("")
                    continue
                ratio = r["estimate"] / r["compiled"] if r["compiled"] else float("inf")
                row[q] = {"estimate": r["estimate"], "compiled": r["compiled"], "ratio": ratio}
                style = "green" if abs(ratio - 1) <= 0.1 else "yellow" if abs(ratio - 1) <= 0.25 else "red"
                cells.append(f"[{style}]{ratio:.2f}[/{style}]")
            t.add_row(name, *cells)
            rows.append(row)
            console.print(f"  done: {name}", style="dim")
    console.print(t)
    return rows


def rankings(console: Console) -> dict:
    out = {}
    for model in ("1b", "7b"):
        for n in (8, 64, 256):
            res = sk.search(model, devices=n, hardware="h100", global_batch=2 * n)
            console.print(res.table(5))
            best = res.best
            scaling = sk.cost.weak_scaling(model, best.layout, "h100", per_device_batch=2,
                                           devices=tuple(d for d in (8, 64, 256) if d <= n) or (n,))
            out[f"{model}@{n}"] = {"top": res.rows[:5], "weak_scaling": scaling,
                                   "fitting_layouts": sum(r["fits"] for r in res.rows),
                                   "layouts": len(res.rows)}
            console.print(f"  best {model}@{n}: {best.layout}  MFU {best.mfu:.1%}  "
                          f"step {best.step_time:.3f}s  exposed comm {best.time['exposed']:.3f}s")
            if n == 256:
                for r in scaling:
                    console.print(f"  weak scaling {model}: {r['devices']:4d} GPUs {r['layout']:44s} "
                                  f"efficiency {r['efficiency']:.1%}")
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    console = Console(width=170)
    result = {"devices": 8, "platform": jax.default_backend()}
    if a.robustness:
        result["robustness"] = compare(console, robustness=True)
        a.out = a.out.replace(".json", "_robustness.json")
    elif a.families:
        result["families"] = compare(console, families=True)
        a.out = a.out.replace(".json", "_families.json")
    else:
        if not a.no_compile:
            result["comparison"] = compare(console)
        result["search"] = rankings(console)
    pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=float)
    console.print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
