"""Mixture-of-experts benchmark: all-to-all traffic vs the formula, step time per EP layout,
and what the router's load-balancing loss does over training.

    python bench/moe.py --steps 100      # 8 simulated CPU devices; writes bench/results/moe.json
    python bench/moe.py --dispatch h100 tpu-v5p   # (d) only, deviceless; writes bench/results/moe_dispatch.json

(a) traffic: the compiled all-to-all bytes of the recipe's train step per device (dispatch +
    combine, forward + backward, every MoE layer) against ``cost.analytic.from_shape.moe_traffic`` through
    ``cost.estimate``, dropless and with capacity factor 1.25, per EP layout; and whether the
    step all-gathers anything over ``expert`` (pure EP should not: the experts stay put);
(b) step time: median of timed steps of each EP layout, as a ratio to the same MoE model on
    ``data=8`` (every device holds all experts; no all-to-all) in the same run;
(c) load balance: ``--steps`` steps on ``ep`` (capacity 1.25) with the load-balancing loss at
    weight 0, 0.01 (Switch Transformer's) and 0.1 (``--weights``), reporting on a fixed batch before and after:
    the coefficient of variation of tokens per expert (std/mean over experts, averaged over
    MoE layers), the busiest expert's share relative to uniform, E·Σf·P, and the drop fraction;
(d) dropless dispatch on targets (``--dispatch TARGET...``): one SwiGLU MoE layer's forward +
    backward (``--tokens`` × ``--experts`` experts, top-``--top-k``, ``--d-model`` →
    ``--d-ff``, bf16) on ``expert=8`` compiled deviceless for each target, padded vs ragged
    (``sk.moe(dispatch=...)``): temporaries per device, the dense all-to-all bytes, the
    ragged-all-to-all operands (the routed rows it may send) and results (the static receive
    buffer), XLA's dot flops and the kernels' custom calls.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100, help="training steps for the load-balance runs")
    p.add_argument("--timed", type=int, default=10, help="timed steps per layout")
    p.add_argument("--weights", type=lambda s: [float(w) for w in s.split(",")], default=[0.0, 0.01, 0.1],
                   help="load-balancing loss weights to train with (comma-separated)")
    p.add_argument("--out", default=None, help="default bench/results/moe.json (moe_dispatch.json with --dispatch)")
    p.add_argument("--dispatch", nargs="+", metavar="TARGET", help="only (d), for these targets (h100, tpu-v5p)")
    p.add_argument("--json", action="store_true", help="(d): print the rows as one JSON line")
    p.add_argument("--forms", nargs="+", default=["padded", "ragged"], choices=["padded", "ragged"],
                   help="(d): which dispatch forms to compile")
    for flag, default in (("tokens", 8192), ("experts", 64), ("top-k", 2), ("d-model", 1024), ("d-ff", 4096)):
        p.add_argument(f"--{flag}", type=int, default=default, help="(d) layer size")
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import shardkit as sk  # noqa: E402
from models.transformer import data as data_lib  # noqa: E402
from models.transformer.config import Config  # noqa: E402
from models.transformer.layouts import LAYOUTS, Layout, make_plan  # noqa: E402
from models.transformer.model import PipelineSpec, Transformer, moe_loss_fn  # noqa: E402
from shardkit.cost.analytic.from_shape import estimate  # noqa: E402
from shardkit.cost.compiled.hlo import traffic_from_hlo  # noqa: E402
from shardkit.cost.terms import Layout as CostLayout  # noqa: E402

BATCH = 32
CFG = Config(vocab=256, d_model=64, layers=4, heads=4, seq=64, moe_experts=8, moe_top_k=2, moe_every=1)
EP = ("ep", "ep_dp", "ep_tp", "ep_fsdp", "ep_pp")


def build(cfg: Config, seed: int = 0) -> Transformer:
    """Numpy-drawn N(0, 0.02) weights, norm scales 1 (no XLA sampler compile per shape)."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed)))
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    vals = {p: (np.ones(x.shape, np.float32) if "norm" in jax.tree_util.keystr(p)
                else rng.normal(0.0, 0.02, x.shape).astype(np.float32)) for p, x in flat}
    nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, x: jnp.asarray(vals[p]), state))
    return model


def make_step(layout: Layout, cfg: Config, lr: float = 3e-3):
    mesh = sk.make_mesh(layout.mesh)
    plan = make_plan(mesh, cfg, zero=layout.zero)
    pipe = PipelineSpec(4, layout.schedule) if "pipe" in mesh.shape else None
    step = sk.train_step(plan, optax.adamw(lr, b2=0.95))(lambda m, b: moe_loss_fn(m, b, pipe))
    return mesh, step


def traffic(layout: Layout, cfg: Config, batch) -> dict:
    mesh, step = make_step(layout, cfg)
    state = step.init(build(cfg))
    hlo = step.lower(state, batch).compile().as_text()
    rows = traffic_from_hlo(hlo, dict(mesh.shape))
    compiled = sum(t.bytes for t in rows if t.kind == "all-to-all")
    est = estimate(cfg, CostLayout(**dict(mesh.shape), zero=layout.zero), "h100", global_batch=BATCH,
                   precision="fp32")
    gathers = sum(t.bytes for t in rows if t.kind == "all-gather" and "expert" in t.axes)
    return {"compiled": compiled, "formula": est.collectives["expert-all-to-all"],
            "expert_all_gather_bytes": gathers}


def step_time(layout: Layout, cfg: Config, batches, steps: int) -> float:
    _, step = make_step(layout, cfg)
    state = step.init(build(cfg))
    times = []
    for i in range(steps + 2):
        t = time.perf_counter()
        state, metrics = step(state, batches[i % len(batches)])
        jax.block_until_ready(metrics["loss"])
        if i >= 2:  # the first two compile and warm up
            times.append(time.perf_counter() - t)
    return float(np.median(times))


def balance(model: Transformer, tokens) -> dict:
    """Router statistics of every MoE layer on one fixed batch (one device, no training)."""
    _, aux = jax.jit(lambda m, t: m.hidden(t, with_aux=True))(model, tokens)
    tpe = np.asarray(aux["tokens_per_expert"])  # (MoE layers, E)
    return {"cv": float(np.mean(tpe.std(axis=1) / tpe.mean(axis=1))),
            "max_over_uniform": float(np.mean(tpe.max(axis=1) / tpe.mean(axis=1))),
            "load_balance": float(np.mean(aux["load_balance"])),
            "dropped": float(np.mean(aux["dropped_fraction"]))}


def train_balance(cfg: Config, batches, tokens, steps: int) -> dict:
    mesh, step = make_step(LAYOUTS["ep"], cfg)
    model = build(cfg)
    before = balance(model, tokens)
    state = step.init(model)
    for i in range(steps):
        state, _ = step(state, batches[i % len(batches)])
    return {"before": before, "after": balance(step.model(state), tokens)}


def dispatch_rows(target: str, a: argparse.Namespace) -> list[dict]:
    """(d): one MoE layer's gradients compiled for ``target`` on ``expert=8``, padded and ragged."""
    import re

    from jax.sharding import NamedSharding, PartitionSpec as P

    from models.transformer.model import swiglu_expert
    from shardkit.cost import targets
    from shardkit.cost.compiled.hlo import matmul_flops_from_hlo

    mesh, _ = targets.device_mesh(targets.get(target), [("expert", 8)])
    bf16, E, D, F = jnp.bfloat16, a.experts, a.d_model, a.d_ff
    put = lambda shape, spec: jax.ShapeDtypeStruct(shape, bf16, sharding=NamedSharding(mesh, spec))  # noqa: E731
    x, router = put((a.tokens, D), P("expert")), put((D, E), P())
    w = {"gate": put((E, D, F), P("expert")), "up": put((E, D, F), P("expert")), "down": put((E, F, D), P("expert"))}
    rows = []
    for dispatch in a.forms:
        def loss(x, router, w):
            y, _ = sk.moe(x, x @ router, swiglu_expert, w, top_k=a.top_k, dispatch=dispatch)
            return jnp.sum(y.astype(jnp.float32))

        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss, argnums=(0, 2))).lower(x, router, w).compile()
        text = compiled.as_text()
        dense = sum(t.bytes for t in traffic_from_hlo(text, {"expert": 8}) if t.kind == "all-to-all")
        sent, buffers = ragged_bytes(text)
        calls = {c: text.count(f'custom_call_target="{c}"') for c in ("mosaic_gpu_v2", "tpu_custom_call")}
        rows.append({"target": target, "dispatch": dispatch,
                     "temporaries_mib": compiled.memory_analysis().temp_size_in_bytes / 2 ** 20,
                     "all_to_all_bytes": dense, "ragged_routed_bytes": sent, "ragged_buffer_bytes": buffers,
                     "ragged_ops": len(re.findall(r" ragged-all-to-all(?:-start)?\(", text)),
                     "dot_flops": matmul_flops_from_hlo(text),
                     "custom_calls": {c: n for c, n in calls.items() if n}})
    return rows


def ragged_bytes(hlo: str) -> tuple[int, int]:
    """Per device, summed over the program's ragged-all-to-alls: the rows each can carry on its
    routed side (its smaller buffer: the sorted assignments sent out, or received back home)
    and its static receive buffers (the larger), in bytes. Async (``-start``) ops list
    ``((operand, output, offsets...), result)``; sync ones name their operand."""
    import re

    shape = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
    itemsize = {"bf16": 2, "f16": 2, "f32": 4}

    def size(m):
        return itemsize[m[0]] * int(np.prod([int(d) for d in m[1].split(",") if d] or [1]))

    defs = dict(re.findall(r"%([\w.\-]+) = ([a-z]+[0-9]*\[[0-9,]*\])", hlo))
    routed = buffers = 0
    for line in hlo.splitlines():
        if m := re.search(r"= \(\((.*?)\), ([^)]*)\) ragged-all-to-all-start\(", line):
            operand, result = shape.findall(m.group(1))[0], shape.findall(m.group(2))[0]
        elif m := re.search(r"= (\S+) ragged-all-to-all\(%([\w.\-]+)", line):
            operand, result = shape.findall(defs[m.group(2)])[0], shape.findall(m.group(1))[0]
        else:
            continue
        routed += min(size(operand), size(result))
        buffers += max(size(operand), size(result))
    return routed, buffers


def dispatch_table(args) -> int:
    rows = [r for t in args.dispatch for r in dispatch_rows(t, args)]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"(d) one MoE layer's forward+backward per device, expert=8: {args.tokens} tokens, {args.experts} "
          f"experts, top-{args.top_k}, SwiGLU {args.d_model}→{args.d_ff}, bf16\n"
          "| target | dispatch | temporaries (MiB) | all-to-all bytes | ragged-all-to-all routed rows (bytes) | "
          "ragged receive buffers (bytes) | XLA dot flops | kernel calls |\n|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        calls = ", ".join(f"{k}×{v}" for k, v in r["custom_calls"].items()) or "none"
        print(f"| {r['target']} | {r['dispatch']} | {r['temporaries_mib']:,.0f} | {r['all_to_all_bytes']:,} | "
              f"{r['ragged_routed_bytes']:,} | {r['ragged_buffer_bytes']:,} | {r['dot_flops']:.3g} | {calls} |")
    out = pathlib.Path(args.out or pathlib.Path(__file__).parent / "results" / "moe_dispatch.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dispatch:
        return dispatch_table(args)
    args.out = args.out or str(pathlib.Path(__file__).parent / "results" / "moe.json")
    console = Console(width=150)
    train, _ = data_lib.stdlib_corpus(max_bytes=1 << 22)
    feed = data_lib.Batches(train, BATCH, CFG.seq, seed=0)
    batches = [next(feed) for _ in range(max(args.steps, 8))]
    result = {"config": repr(CFG), "batch": BATCH}

    t = Table(title="(a) all-to-all bytes per device per step: compiled vs cost.estimate (moe_traffic)")
    for col in ("layout", "capacity", "compiled", "formula", "ratio", "all-gather over expert"):
        t.add_column(col)
    result["traffic"] = {}
    for name in EP[:-1]:  # inside ep_pp's stages XLA moves the tokens (sk.moe runs nested)
        for cap in (None, 1.25):
            r = traffic(LAYOUTS[name], CFG.replace(moe_capacity=cap), batches[0])
            result["traffic"][f"{name}/{cap}"] = r
            t.add_row(name, str(cap or "dropless"), f"{r['compiled']:,}", f"{r['formula']:,.0f}",
                      f"{r['compiled'] / r['formula']:.3f}", f"{r['expert_all_gather_bytes']:,}")
    console.print(t)

    t = Table(title=f"(b) CPU step time (median of {args.timed}), capacity 1.25, ratio to data=8")
    for col in ("layout", "mesh", "step ms", "ratio"):
        t.add_column(col)
    cfg = CFG.replace(moe_capacity=1.25)
    base = step_time(Layout("data=8"), cfg, batches, args.timed)
    result["step_time"] = {"data=8": base}
    t.add_row("dp (all experts on every device)", "data=8", f"{base * 1e3:.1f}", "1.00")
    for name in EP:
        s = step_time(LAYOUTS[name], cfg, batches, args.timed)
        result["step_time"][name] = s
        t.add_row(name, LAYOUTS[name].mesh, f"{s * 1e3:.1f}", f"{s / base:.2f}")
    console.print(t)

    t = Table(title=f"(c) router balance on a fixed batch, before and after {args.steps} steps on ep "
                    "(capacity 1.25)")
    for col in ("aux weight", "CV tokens/expert", "max/uniform", "E·Σf·P", "dropped"):
        t.add_column(col)
    tokens = jnp.asarray(batches[-1]["inputs"])
    result["balance"] = {}
    for w in args.weights:
        r = train_balance(cfg.replace(moe_aux_weight=w), batches, tokens, args.steps)
        result["balance"][str(w)] = r
        fmt = lambda k: f"{r['before'][k]:.3f} → {r['after'][k]:.3f}"  # noqa: E731
        t.add_row(str(w), fmt("cv"), fmt("max_over_uniform"), fmt("load_balance"), fmt("dropped"))
    console.print(t)
    pathlib.Path(args.out).parent.mkdir(exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
