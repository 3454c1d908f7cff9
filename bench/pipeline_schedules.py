"""Issue 25 benchmark: what each pipeline schedule executes and holds, against 1F1B and the
un-pipelined model in the same run.

    python bench/pipeline_schedules.py            # CPU tables + H100 compile (deviceless)
    python bench/pipeline_schedules.py --no-h100  # CPU only
    python bench/pipeline_schedules.py --no-h100 --layers 16  # two-layer chunks at v=2
    python bench/pipeline_schedules.py --no-cpu --tpu --validate  # (c) on H100 and TPU v5p, (c')
    python bench/pipeline_schedules.py --no-cpu --no-h100 --keep  # (d) keep= on H100, three shapes

(a) bubble of each executed table (p=4, m=8) against its formula; (b) CPU compile (8
simulated devices, pipe=4, m=8, a residual-MLP stack): matmul flops per device read off the
compiled program (``cost.hlo.matmul_flops_from_hlo``, through loops, the explicit executor's
switch weighted by its table) over 1F1B's, temporaries over 1F1B's, and step time over the
un-pipelined model's (one device; noisy on a shared machine: a ratio, same run); (c) the
recipe transformer (8 layers, d=512, seq 512, remat full, bf16, vocab 8000, 4 pipeline
microbatches, batch 32) compiled for 16 H100s (XLA:GPU, deviceless) on data=2,pipe=2,tensor=4:
per-GPU temporaries against the un-pipelined data=2,fsdp=2,tensor=4 and against the step
estimate's (``explain``'s formula), matmul flops over 1F1B's, and the all-to-alls in the
program (the natural layer order's relayout); ``--tpu``: the same on 16 TPU v5p chips;
(c') ``--validate``: estimate / compiled on H100 for (c) and two shapes the formula was not
fitted on; (d) ``--keep``: every explicit schedule with ``keep="input"``, ``"dots"``, ``"all"``
and ``"lean"`` (``--keeps``: some of them) on the three shapes, H100 temporaries and matmul
flops against ``keep="input"`` (of this run, else the results file's).
Writes bench/results/pipeline_schedules.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


KEEPS = ("input", "dots", "all", "lean")  # (d): sk.pipeline(keep=...) compiled


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before JAX is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-cpu", action="store_true", help="skip (b), the CPU compile and step times")
    ap.add_argument("--layers", type=int, default=None, help="layers of (b)'s residual-MLP stack "
                    "(default 8: two per stage)")
    ap.add_argument("--no-h100", action="store_true", help="skip (c), the deviceless H100 compile")
    ap.add_argument("--tpu", action="store_true", help="(c) also on 16 TPU v5p chips")
    ap.add_argument("--validate", action="store_true", help="(c'): estimate / compiled on H100 for (c) and "
                    "two shapes the formula was not fitted on")
    ap.add_argument("--keep", action="store_true", help="(d) what each explicit schedule keeps for its "
                    "backward ops (sk.pipeline(keep=...)): temporaries and matmul flops on H100, every shape")
    ap.add_argument("--keeps", default=",".join(KEEPS), help="the keep settings --keep compiles, comma-separated; "
                    "the results file keeps the others' last run")
    ap.add_argument("--shapes", default="c,d1024,pipe4", help="the shapes --keep compiles, comma-separated "
                    "(default all three: c,d1024,pipe4; held out from the formula's fitting: d768, l12m8); "
                    "the results file keeps the other shapes' last run")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import shardkit as sk  # noqa: E402
from pipeline import mlp_layer, mse, problem  # noqa: E402  (bench/pipeline.py)
from shardkit.cost.compiled.hlo import matmul_flops_from_hlo  # noqa: E402
from shardkit.cost.pipeline_note import pipeline_branch_weights  # noqa: E402
from shardkit.pipeline import pipeline, pipeline_schedule  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))
console = Console()


def bubbles(p=4, m=8):
    t = Table(title=f"(a) bubble of the executed table, p={p} m={m}")
    for c in ("schedule", "grid", "formula", "vs 1F1B"):
        t.add_column(c)
    base = pipeline_schedule("1f1b", p, m).bubble_fraction
    out = {}
    for s, v in SCHEDULES:
        tab = pipeline_schedule(s, p, m, v)
        out[s] = (tab.bubble_fraction, tab.formula_bubble)
        t.add_row(s, f"{tab.bubble_fraction:.4f}", f"{tab.formula_bubble:.4f}", f"{tab.bubble_fraction / base:.2f}x")
    console.print(t)
    return out


def cpu(p=4, m=8, d=64, reps=5, layers=None):
    mesh = sk.make_mesh(f"pipe={p}", devices=jax.devices()[:p])
    params, head, x, t = problem(layers or 2 * p, d, 8 * m)

    def seq_loss(P_, H):
        return mse(H, jax.lax.scan(lambda h, lp: (mlp_layer(lp, h), None), x, P_)[0], t)

    def timed(f):
        jax.block_until_ready(f(params, head))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(params, head))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    base_t = timed(jax.jit(jax.value_and_grad(seq_loss, argnums=(0, 1))))
    rows = {}
    for s, v in SCHEDULES:
        f = jax.jit(jax.value_and_grad(
            lambda P_, H, s=s, v=v: pipeline(mlp_layer, P_, x, microbatches=m, schedule=s, repeats=v, loss_fn=mse,
                                            loss_params=H, targets=t, mesh=mesh), argnums=(0, 1)))
        c = f.lower(params, head).compile()
        weights = pipeline_branch_weights({"stages": p, "microbatches": m, "schedule": s, "repeats": v})
        rows[s] = {"flops": matmul_flops_from_hlo(c.as_text(), weights),
                   "temp": c.memory_analysis().temp_size_in_bytes, "time": timed(f)}
    tab = Table(title=f"(b) CPU, 8 simulated devices, pipe={p} m={m}, MLP d={d}: per device, vs 1F1B; "
                      "step time vs the un-pipelined model (1 device) in the same run")
    for c in ("schedule", "matmul flops", "vs 1F1B", "temporaries", "vs 1F1B", "step time", "vs un-pipelined"):
        tab.add_column(c)
    f1 = rows["1f1b"]
    for s, r in rows.items():
        tab.add_row(s, f"{r['flops']:.4g}", f"{r['flops'] / f1['flops']:.3f}", f"{r['temp'] / 2**20:.2f} MiB",
                    f"{r['temp'] / f1['temp']:.2f}", f"{r['time'] * 1e3:.1f} ms", f"{r['time'] / base_t:.2f}x")
    console.print(tab)
    return {"unpipelined_time": base_t, **rows}


# (c)'s model and meshes, and the validation shapes the formula was not fitted on (issue 25):
# d=1024 at seq 1024; 16 layers of d=768 (12 heads / 4 KV heads) on pipe=4 with 8 microbatches.
SHAPES = {
    "c": (dict(layers=8, d_model=512, heads=8, kv_heads=4, d_ff=2048, seq=512, vocab=8000), "data=2,pipe=2,tensor=4",
          "data=2,fsdp=2,tensor=4", 4),
    "d1024": (dict(layers=8, d_model=1024, heads=8, kv_heads=4, d_ff=4096, seq=1024, vocab=8000),
              "data=2,pipe=2,tensor=4", "data=2,fsdp=2,tensor=4", 4),
    "pipe4": (dict(layers=16, d_model=768, heads=12, kv_heads=4, d_ff=3072, seq=512, vocab=8000),
              "data=1,pipe=4,tensor=4", "data=1,fsdp=4,tensor=4", 8),
}

# --keep's held-out shapes (issue 37): the keep= formula was not fitted on them. k = rows = 4 at
# d=768, 12 heads, seq 1024; 1F1B chunks of 6 layers over 8 microbatches of 2 rows, 16/4 heads.
HELD_OUT = {
    "d768": (dict(layers=8, d_model=768, heads=12, kv_heads=4, d_ff=2048, seq=1024, vocab=8000),
             "data=2,pipe=2,tensor=4", "data=2,fsdp=2,tensor=4", 4),
    "l12m8": (dict(layers=12, d_model=1024, heads=16, kv_heads=4, d_ff=2816, seq=512, vocab=8000),
              "data=2,pipe=2,tensor=4", "data=2,fsdp=2,tensor=4", 8),
}


def compiled(target="h100", shape="c", layer_order="natural"):
    """The recipe transformer (remat full, bf16, batch 32) compiled for ``target`` (deviceless),
    un-pipelined and under every schedule: per-device temporaries and the step estimate's."""
    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    kw, pmesh, umesh, pm = SHAPES[shape]
    cfg = SIZES["1b"].replace(**kw, remat="full")
    jobs, names = [], []
    step, state, batch = abstract_step(cfg, umesh, global_batch=32, zero=1, target=target)
    jobs.append((step, state, batch, umesh))
    names.append("un-pipelined")
    for s, v in SCHEDULES:
        step, state, batch = abstract_step(cfg, pmesh, global_batch=32, schedule=s,
                                           repeats=v if s == "interleaved-1f1b" else 1, pipeline_microbatches=pm,
                                           target=target, layer_order=layer_order)
        jobs.append((step, state, batch, pmesh))
        names.append(s)
    reports = dict(zip(names, sk.cost.simulate_many(jobs, target=target, estimate=True)))
    out = {}
    for name, r in reports.items():
        if isinstance(r, Exception):
            out[name] = {"error": repr(r)[:200]}
            continue
        est = next((row["estimate"] for row in r.comparison() if row["quantity"] == "memory/temporaries"), None)
        out[name] = {"temporaries": r.memory["temporaries"], "estimate": est, "matmul_flops": r.matmul_flops,
                     "all_to_all": sum(c.count for c in r.collectives if c.kind == "all-to-all")}
    return out


def h100(tpu=False):
    out = {"h100": compiled("h100")}
    if tpu:
        out["tpu-v5p"] = compiled("tpu-v5p")
    tab = Table(title="(c) recipe transformer (8 layers, d=512, seq 512, remat full, bf16), 16 x H100 "
                      "(XLA:GPU deviceless), data=2,pipe=2,tensor=4; per device; estimate: the step estimate's "
                      "temporaries" + (" (TPU: 16 x v5p, XLA:TPU)" if tpu else ""))
    cols = ["schedule", "temporaries", "vs un-pipelined", "estimate", "estimate/compiled", "matmul flops", "vs 1F1B",
            "all-to-alls"] + (["TPU temporaries", "TPU estimate/compiled"] if tpu else [])
    for c in cols:
        tab.add_column(c)
    h = out["h100"]
    f1, base = h["1f1b"].get("matmul_flops"), h["un-pipelined"].get("temporaries")
    for name, r in h.items():
        if "error" in r:
            tab.add_row(name, r["error"][:60], *[""] * (len(cols) - 2))
            continue
        temp, est = r["temporaries"], r["estimate"]
        row = [name, f"{temp / 2**20:.1f} MiB", f"{temp / base:.2f}x", f"{est / 2**20:.1f} MiB" if est else "-",
               f"{est / temp:.2f}" if est else "-", f"{r['matmul_flops']:.5g}",
               f"{r['matmul_flops'] / f1:.3f}" if name != "un-pipelined" else "-", str(r["all_to_all"])]
        if tpu:
            t = out["tpu-v5p"].get(name, {})
            row += ([f"{t['temporaries'] / 2**20:.1f} MiB", f"{t['estimate'] / t['temporaries']:.2f}"]
                    if "temporaries" in t else [t.get("error", "-")[:40], "-"])
        tab.add_row(*row)
    console.print(tab)
    return out


def validate():
    """Estimate over compiled temporaries on H100 for (c) and the two held-out shapes, the
    layers stored stage-major (no relayout)."""
    out = {shape: compiled("h100", shape, layer_order="stage-major") for shape in SHAPES}
    tab = Table(title="(c') step estimate / compiled temporaries, 16 x H100, remat full, layers stage-major")
    tab.add_column("schedule")
    for shape, (kw, pmesh, _, pm) in SHAPES.items():
        tab.add_column(f"{shape}: {kw['layers']} layers d={kw['d_model']} seq {kw['seq']}, {pmesh}, m={pm}")
    for name in out["c"]:
        tab.add_row(name, *[f"{r[name]['temporaries'] / 2**20:.1f} MiB -> {r[name]['estimate'] / r[name]['temporaries']:.2f}"
                            if "temporaries" in r[name] else r[name]["error"][:40] for r in out.values()])
    console.print(tab)
    return out




def keep(target="h100", shape="c", keeps=KEEPS, stored=None):
    """(d) what each explicit schedule keeps for its backward ops (``sk.pipeline(keep=...)``):
    the recipe transformer of ``shape`` without remat (the keep setting is the only recompute
    choice), compiled for ``target`` (deviceless), layers stored stage-major; per-device
    temporaries and matmul flops against the same schedule with ``keep="input"`` (``stored``:
    the results file's rows of the shape, where ``keeps`` leaves it out)."""
    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    kw, pmesh, _, pm = {**SHAPES, **HELD_OUT}[shape]
    cfg = SIZES["1b"].replace(**kw, remat="none")
    cases = [(s, v, k) for s, v in SCHEDULES if s != "gpipe" for k in keeps]
    jobs = [(*abstract_step(cfg, pmesh, global_batch=32, schedule=s, repeats=v if s == "interleaved-1f1b" else 1,
                            pipeline_microbatches=pm, target=target, layer_order="stage-major", keep=k), pmesh)
            for s, v, k in cases]
    out = dict(stored or {})
    for (s, _, k), r in zip(cases, sk.cost.simulate_many(jobs, target=target, estimate=True)):
        if isinstance(r, Exception):
            out[f"{s}/{k}"] = {"error": repr(r)[:200]}
            continue
        est = next((row["estimate"] for row in r.comparison() if row["quantity"] == "memory/temporaries"), None)
        out[f"{s}/{k}"] = {"temporaries": r.memory["temporaries"], "estimate": est, "matmul_flops": r.matmul_flops}
    tab = Table(title=f"(d) keep=, recipe transformer ({kw['layers']} layers d={kw['d_model']} seq {kw['seq']}, "
                      f"remat none, bf16), {target} deviceless, {pmesh}, m={pm}; per device, vs keep='input'")
    for c in ("schedule", "keep", "temporaries", "vs input", "estimate", "matmul flops", "vs input"):
        tab.add_column(c)
    for (s, _, k) in cases:
        r, base = out[f"{s}/{k}"], out.get(f"{s}/input", {"error": "no keep='input' row"})
        if "error" in r or "error" in base:
            tab.add_row(s, k, r.get("error", base.get("error", ""))[:60], "", "", "", "")
            continue
        tab.add_row(s, k, f"{r['temporaries'] / 2**20:.1f} MiB", f"{r['temporaries'] / base['temporaries']:.2f}x",
                    f"{r['estimate'] / 2**20:.1f} MiB" if r["estimate"] else "-", f"{r['matmul_flops']:.5g}",
                    f"{r['matmul_flops'] / base['matmul_flops']:.3f}")
    console.print(tab)
    return out


def main(argv=None):
    args = parse_args(argv)
    shapes = args.shapes.split(",")
    if unknown := sorted(set(shapes) - set(SHAPES) - set(HELD_OUT)):
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {sorted(SHAPES) + sorted(HELD_OUT)}")
    path = pathlib.Path(__file__).parent / "results" / "pipeline_schedules.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["bubbles"] = bubbles()
    if not args.no_cpu:
        results["cpu"] = cpu(layers=args.layers)
    if not args.no_h100:
        results["h100"] = h100(tpu=args.tpu)
    if args.validate:
        results["validate"] = validate()
    if args.keep:
        old = results.get("keep", {})
        keeps = tuple(args.keeps.split(","))
        if unknown := sorted(set(keeps) - set(KEEPS)):
            raise SystemExit(f"--keeps: unknown {unknown}; choose from {KEEPS}")
        results["keep"] = {**old, **{shape: keep("h100", shape, keeps, old.get(shape)) for shape in shapes}}
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=float))


if __name__ == "__main__":
    main()
