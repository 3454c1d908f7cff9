"""Pipeline benchmark: bubble of the executed schedule tables, memory, step time, traffic.

    python bench/pipeline.py            # 8 simulated CPU devices; writes bench/results/pipeline.json

(a) bubble: idle (tick, stage) cells of the tables ``pipeline`` scans over
    (``sk.pipeline_schedule``), against the published formula, and against 1F1B's;
    (b) per-device temp bytes of the compiled value-and-grad, GPipe, interleaved 1F1B and ZB-H1
    against 1F1B, with a fixed microbatch so GPipe's saved activations grow with m; (c) step
    time of each schedule relative to the un-pipelined (data-parallel) model on the same 8
    devices; (d) compiled gradient all-reduce over `data` per step on data=2,pipe=4: one
    reduction of the stage (and head) parameters, not one per tick; (e) ZeRO-3: compiled
    parameter all-gather over `data` per step, against one stage's weights.
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
    """The command line (no options), read before JAX is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import optax  # noqa: E402

import shardkit as sk  # noqa: E402
from shardkit.mesh import make_mesh  # noqa: E402
from shardkit.pipeline import pipeline, pipeline_schedule  # noqa: E402

TABLES = (("gpipe", 1), ("circular", 2), ("circular", 4), ("1f1b", 1), ("interleaved-1f1b", 2),
          ("interleaved-1f1b", 4), ("zb-h1", 1))


def mlp_layer(lp, h_BxD):
    """Residual MLP: saves (B, 4D) activations, so activations dominate memory."""
    u_BxF = jax.nn.gelu(h_BxD @ lp["w1"])
    return h_BxD + u_BxF @ lp["w2"]


def mse(hp, y_BxD, t_BxD):
    return jnp.mean((y_BxD @ hp["w"] - t_BxD) ** 2)


def problem(n_layers, d, batch, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    params = {"w1": jax.random.normal(k[0], (n_layers, d, 4 * d)) / np.sqrt(d),
              "w2": jax.random.normal(k[1], (n_layers, 4 * d, d)) / np.sqrt(4 * d)}
    head = {"w": jax.random.normal(k[2], (d, d)) / np.sqrt(d)}
    x = jax.random.normal(k[3], (batch, d))
    return params, head, x, x[::-1]


def grad_fn(mesh, schedule, m, v=1):
    def loss(params, head, x, t):
        return pipeline(mlp_layer, params, x, microbatches=m, schedule=schedule, repeats=v,
                        loss_fn=mse, loss_params=head, targets=t, mesh=mesh)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def sequential_grad_fn():
    def loss(params, head, x, t):
        y = jax.lax.scan(lambda h, lp: (mlp_layer(lp, h), None), x, params)[0]
        return mse(head, y, t)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def bubbles():
    rows = []
    for p in (2, 4, 8):
        for mult in (1, 2, 4, 8):
            m = mult * p
            base = pipeline_schedule("1f1b", stages=p, microbatches=m).bubble_fraction
            for schedule, v in TABLES:
                tab = pipeline_schedule(schedule, stages=p, microbatches=m, repeats=v)
                got, want = tab.bubble_fraction, tab.formula_bubble
                rows.append(dict(schedule=schedule, p=p, m=m, v=v, ticks=tab.ticks, bubble=got,
                                 formula=want, match=abs(got - want) < 1e-12, vs_1f1b=got / base,
                                 peak_activations=max(tab.peak_activations)))
    return rows


def memory(p=4, d=64, mb=8, layers_per_stage=4):
    mesh = make_mesh(f"pipe={p}", devices=jax.devices()[:p])
    rows = []
    for mult in (4, 8):
        m = mult * p
        params, head, x, t = problem(p * layers_per_stage, d, m * mb)
        temps = {}
        for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
            compiled = grad_fn(mesh, schedule, m, v).lower(params, head, x, t).compile()
            temps[schedule] = compiled.memory_analysis().temp_size_in_bytes
        stage_param_bytes = layers_per_stage * 8 * d * d * 4
        rows.append(dict(p=p, m=m, microbatch=mb, d=d, layers=p * layers_per_stage,
                         gpipe_temp=temps["gpipe"], f1b_temp=temps["1f1b"],
                         interleaved_temp=temps["interleaved-1f1b"], zb_temp=temps["zb-h1"],
                         ratio=temps["1f1b"] / temps["gpipe"], p_over_m=p / m,
                         interleaved_vs_1f1b=temps["interleaved-1f1b"] / temps["1f1b"],
                         zb_vs_1f1b=temps["zb-h1"] / temps["1f1b"],
                         excess=temps["1f1b"] - p / m * temps["gpipe"],
                         stage_param_bytes=stage_param_bytes))
    return rows


def step_times(d=64, batch=64, reps=3):
    results = []
    devices = jax.devices()
    params, head, x, t = problem(16, d, batch)
    dp = make_mesh("data=8", devices=devices)
    put = lambda a, spec: jax.device_put(a, NamedSharding(dp, spec))  # noqa: E731
    base_args = (put(params, P()), put(head, P()), put(x, P("data")), put(t, P("data")))
    base = _time(sequential_grad_fn(), base_args, reps)
    results.append(dict(schedule="un-pipelined (data=8)", mesh="data=8", m=1, seconds=base, relative=1.0))
    for mesh_spec, m in (("pipe=8", 16), ("data=2,pipe=4", 8)):
        mesh = make_mesh(mesh_spec, devices=devices)
        for schedule, v in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
            sec = _time(grad_fn(mesh, schedule, m, v), (params, head, x, t), reps)
            results.append(dict(schedule=f"{schedule}" + (f" v={v}" if v > 1 else ""), mesh=mesh_spec,
                                m=m, seconds=sec, relative=sec / base))
    return results


def data_reduction(d=128, batch=32, m=8, layers=8):
    """Compiled all-reduce bytes over `data` per device per step on data=2,pipe=4 (value and
    grad), against one stage's parameter bytes: ~1x stage + head means one reduction per step
    (sk.pipeline's manual data axes), ~ticks x stage a reduction per tick."""
    from shardkit.cost.compiled.hlo import traffic_from_hlo
    from shardkit.cost.pipeline_note import pipeline_branch_weights

    mesh = make_mesh("data=2,pipe=4", devices=jax.devices())
    params, head, x, t = problem(layers, d, batch)
    x, t = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (x, t))
    stage = sum(a.nbytes for a in jax.tree.leaves(params)) // 4
    head_bytes = sum(a.nbytes for a in jax.tree.leaves(head))
    rows = []
    for schedule, v in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        hlo = grad_fn(mesh, schedule, m, v).lower(params, head, x, t).compile().as_text()
        # The explicit schedules' switch branches weighted by how often the schedule takes them (as explain() does).
        weights = pipeline_branch_weights({"stages": 4, "microbatches": m, "schedule": schedule, "repeats": v})
        over = [tr for tr in traffic_from_hlo(hlo, dict(mesh.shape), weights)
                if tr.kind == "all-reduce" and "data" in tr.axes]
        got = sum(tr.operand_bytes for tr in over)
        rows.append(dict(schedule=schedule, v=v, m=m, all_reduce_data=got, ops=sum(tr.count for tr in over),
                         stage_param_bytes=stage, head_bytes=head_bytes, per_stage=got / stage))
    return rows


def zero3_gathers(d=128, batch=32, m=8, layers=8):
    """ZeRO-3 on data=2,pipe=4 through ``sk.train_step``: compiled all-gather bytes over `data`
    per device per step (gathered sizes) against one stage's weights; a gather per microbatch
    would be m x."""
    mesh = make_mesh("data=2,pipe=4", devices=jax.devices())
    plan = sk.Plan(mesh, rules=[(r"layers", ("pipe",)), (r".*", ())], zero=3)
    rows = []
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):
        params, head, x, t = problem(layers * v, d, batch)

        @sk.train_step(plan, optax.sgd(0.1))
        def step(model, b, schedule=schedule, v=v):
            return pipeline(mlp_layer, model["layers"], b["x"], microbatches=m, schedule=schedule,
                            repeats=v, loss_fn=mse, loss_params=model["head"], targets=b["t"])

        state = step.init({"layers": params, "head": head})
        report = step.explain(state, {"x": x, "t": t})
        stage = sum(a.nbytes for a in jax.tree.leaves(params)) // 4
        over = [tr for tr in report.traffic if tr.kind == "all-gather" and "data" in tr.axes]
        got = sum(tr.bytes for tr in over)
        rows.append(dict(schedule=schedule, v=v, m=m, all_gather_data=got, ops=sum(tr.count for tr in over),
                         stage_param_bytes=stage, per_stage=got / stage))
    return rows


def _time(fn, args, reps):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None):
    parse_args(argv)
    console = Console()
    out = {"devices": jax.device_count(), "backend": jax.default_backend()}

    out["bubble"] = bubbles()
    tab = Table(title="(a) bubble: idle stage-ticks of the executed tables vs the published formula")
    for col in ("schedule", "p", "m", "v", "ticks", "measured", "formula", "match", "vs 1F1B", "peak act"):
        tab.add_column(col)
    for r in out["bubble"]:
        tab.add_row(r["schedule"], str(r["p"]), str(r["m"]), str(r["v"]), str(r["ticks"]),
                    f"{r['bubble']:.4f}", f"{r['formula']:.4f}", "yes" if r["match"] else "NO",
                    f"{r['vs_1f1b']:.3f}", str(r["peak_activations"]))
    console.print(tab)

    out["memory"] = memory()
    tab = Table(title="(b) per-device temp bytes of value_and_grad (fixed microbatch; GPipe grows with m)")
    for col in ("p", "m", "mb", "layers", "GPipe", "1F1B", "1F1B/GPipe", "p/m", "excess", "stage W",
                "interleaved v=2", "ZB-H1", "interleaved/1F1B", "ZB-H1/1F1B"):
        tab.add_column(col)
    for r in out["memory"]:
        tab.add_row(str(r["p"]), str(r["m"]), str(r["microbatch"]), str(r["layers"]),
                    f"{r['gpipe_temp'] / 2**20:.2f}M", f"{r['f1b_temp'] / 2**20:.2f}M",
                    f"{r['ratio']:.3f}", f"{r['p_over_m']:.3f}", f"{r['excess'] / 2**20:.2f}M",
                    f"{r['stage_param_bytes'] / 2**20:.2f}M", f"{r['interleaved_temp'] / 2**20:.2f}M",
                    f"{r['zb_temp'] / 2**20:.2f}M", f"{r['interleaved_vs_1f1b']:.3f}", f"{r['zb_vs_1f1b']:.3f}")
    console.print(tab)
    console.print("excess = 1F1B - (p/m)·GPipe: the m-independent part (stage W = the stage's f32 "
                  "gradient accumulator, plus the stage-input ring)")

    out["step_time"] = step_times()
    tab = Table(title="(c) step time (value_and_grad), 8 simulated CPU devices, vs un-pipelined")
    for col in ("schedule", "mesh", "m", "seconds", "relative"):
        tab.add_column(col)
    for r in out["step_time"]:
        tab.add_row(r["schedule"], r["mesh"], str(r["m"]), f"{r['seconds'] * 1e3:.1f} ms", f"{r['relative']:.2f}x")
    console.print(tab)

    out["data_reduction"] = data_reduction()
    tab = Table(title="(d) all-reduce over data per step, data=2,pipe=4 (one reduction ≈ stage W + head)")
    for col in ("schedule", "m", "bytes", "ops", "stage W", "head", "bytes / stage W"):
        tab.add_column(col)
    for r in out["data_reduction"]:
        tab.add_row(r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else ""), str(r["m"]), f"{r['all_reduce_data']:,}",
                    f"{r['ops']:.0f}", f"{r['stage_param_bytes']:,}", f"{r['head_bytes']:,}", f"{r['per_stage']:.2f}")
    console.print(tab)

    out["zero3_gathers"] = zero3_gathers()
    tab = Table(title="(e) ZeRO-3: all-gather over data per step, data=2,pipe=4 (once ≈ stage W)")
    for col in ("schedule", "m", "bytes", "ops", "stage W", "bytes / stage W"):
        tab.add_column(col)
    for r in out["zero3_gathers"]:
        tab.add_row(r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else ""), str(r["m"]), f"{r['all_gather_data']:,}",
                    f"{r['ops']:.0f}", f"{r['stage_param_bytes']:,}", f"{r['per_stage']:.2f}")
    console.print(tab)

    path = pathlib.Path(__file__).resolve().parent / "results" / "pipeline.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
