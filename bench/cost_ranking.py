"""Does the analytic model rank layouts as the target compiler's programs do?

For each model family (``tests/families.py``, ``tests/third_party_families.py``) and each
device count (64, 256 H100s), ≥ 30 layouts (data × fsdp × tensor, ZeRO 0/1/3) are estimated
(``sk.cost.estimate_for_step``, the leaf-by-leaf estimate of a real step) and compiled
deviceless for the target; the step time of each is the step-time model on the estimate's
figures versus on the compiled program's flops and collectives (``Report.step_time``: bytes
and op counts per role). Reported per family and device count: whether the analytic first is
within the compiled top 3, and Spearman's ρ between the two orders. Compiled figures, with the
collectives by role, are cached in bench/results/cost_ranking.json.

    nice -n 10 timeout 3600 python bench/cost_ranking.py --reuse --families mlp,cnn   # compile what is missing
    python bench/cost_ranking.py --reestimate --write                             # the analytic side only

A family's layouts compile a chunk at a time in one ``simulate_many`` subprocess (``--chunk``):
one start of JAX and XLA:GPU per chunk. A layout alone took 8.1 s (GPT, 64 devices: export
0.4 s, compile 5.7 s of which most is the fresh compiler's start, the estimate ~1.5 s); in a chunk,
2-3.4 s at 64 and 8.5 s at 256 devices.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="gpt,mlp,gpt2,resnet18,cnn,griffin,bert")
    ap.add_argument("--devices", default="64,256")
    ap.add_argument("--reuse", action="store_true", help="compile only layouts not in the cache")
    ap.add_argument("--reestimate", action="store_true",
                    help="recompute the analytic side of cached layouts (tracing only, no compile)")
    ap.add_argument("--write", action="store_true", help="with --reestimate: write the new estimates to the cache")
    ap.add_argument("--chunk", type=int, default=8, help="layouts compiled per subprocess")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402

sk.use_cpu_devices(8)

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "cost_ranking.json"
ROWS = 256  # global batch rows: divisible by every data x fsdp below


def layouts(n: int) -> list[tuple[str, int]]:
    """(mesh, ZeRO stage): every data x fsdp x tensor factorisation of ``n`` with tensor ≤ 8
    and fsdp ≤ 16, under ZeRO 0/1/3 where they differ."""
    out = []
    for t, f in itertools.product((1, 2, 4, 8), (1, 2, 4, 16)):
        d = n // (t * f)
        if d < 1 or d * t * f != n:
            continue
        mesh = ",".join(f"{a}={s}" for a, s in (("data", d), ("fsdp", f), ("tensor", t)) if s > 1)
        for z in (0, 1, 3):
            if f > 1 and z == 0:
                continue  # fsdp shards the parameters: ZeRO-0 is ZeRO-3's program there
            out.append((mesh, z))
    return out


def small_mesh(mesh: str) -> str:
    """The same axis names at 8 devices (the step is built here, then compiled for ``mesh``)."""
    names = [p.split("=")[0] for p in mesh.split(",")]
    sizes = {1: (8,), 2: (4, 2), 3: (2, 2, 2)}[len(names)]
    return ",".join(f"{a}={s}" for a, s in zip(names, sizes))


def _job(module, family, mesh, zero) -> dict:
    # strict=False: a small model's leaves that do not split over 256 devices stay replicated (the
    # same program for the estimate and the compile).
    step, state, batch = module.build(family, small_mesh(mesh), zero, rows=ROWS, strict=False)
    return {"step": step, "state": state, "batch": batch, "mesh": mesh}


def _figures(report) -> dict:
    """What the cache keeps of one compiled layout: both step times, the peaks, and the
    compiled collectives by role (bytes, executions) beside the estimate's."""
    def nonzero(d):
        return {k: v for k, v in d.items() if v}
    return {"estimate": report.estimate["time/step"], "compiled": report.step_time["step"],
            "peak_estimate": report.estimate["memory/peak"], "peak_compiled": float(report.memory["peak"]),
            "roles": nonzero(report.roles()), "counts": nonzero(report.role_counts()),
            "flops": report.matmul_flops,
            "seconds": report.seconds["export"] + report.seconds["subprocess"]}


def measure(module, family, todo: list[tuple[str, int]], chunk: int = 8):
    """Compiles ``todo`` layouts of ``family`` for H100s, ``chunk`` per subprocess (one start of
    JAX and XLA:GPU for several layouts: ``simulate_many``); yields ``(mesh, zero, figures or
    error)`` as each chunk finishes."""
    for i in range(0, len(todo), chunk):
        part = todo[i:i + chunk]
        jobs, built = [], []
        for mesh, zero in part:
            try:
                jobs.append({**_job(module, family, mesh, zero), "zero": zero})
                built.append((mesh, zero))
            except Exception as e:  # a layout the family cannot take (a split that does not divide)
                yield mesh, zero, {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        t0 = time.perf_counter()
        reports = sk.cost.simulate_many(jobs, target="h100", estimate=True) if jobs else []
        wall = (time.perf_counter() - t0) / max(len(jobs), 1)
        for (mesh, zero), r in zip(built, reports):
            if isinstance(r, Exception):
                yield mesh, zero, {"error": f"{type(r).__name__}: {str(r)[:200]}"}
            else:
                yield mesh, zero, {**_figures(r), "wall": wall}


def reestimate(module, family, mesh, zero) -> dict:
    """The analytic side only (tracing, no compile): the estimate ``search`` would rank with,
    for the layout as the compile saw it (the plan on an abstract mesh of H100s)."""
    from shardkit.cost.compiled.simulated import _on, abstract_inputs, abstract_mesh, simulated_plan
    from shardkit.cost.analytic.from_step import step_estimate

    job = _job(module, family, mesh, zero)
    step = job["step"]
    sim = step.with_plan(simulated_plan(step.plan, abstract_mesh(mesh, max_devices=65536, target="h100"),
                                        zero=zero))
    state, batch = abstract_inputs(sim, job["state"], job["batch"])
    with _on(sim.plan):
        est = step_estimate(sim, state, batch, hardware="h100")
    return {"estimate": est.step_time, "peak_estimate": est.memory["peak"]}


def _save(entries: dict) -> None:
    """Merges ``entries`` into the cache file as it is now (another run may be writing others)."""
    cache = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    cache.update(entries)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(cache, indent=1, sort_keys=True))


def spearman(a, b) -> float:
    ra, rb = (np.argsort(np.argsort(x)).astype(float) for x in (a, b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main(argv=None) -> None:
    import families as house

    args = parse_args(argv)
    try:
        import third_party_families as third
        third_names = third.available()
    except ImportError:
        third, third_names = None, []
    cache = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    console = Console(width=160)
    fams = [f for f in args.families.split(",") if f in house.FAMILIES or f in third_names]
    for family in fams:
        module = house if family in house.FAMILIES else third
        for n in map(int, args.devices.split(",")):
            keys = {f"{family}|{m}|{z}": (m, z) for m, z in layouts(n)}
            if args.reestimate:
                for key, (mesh, zero) in keys.items():
                    if "estimate" in cache.get(key, {}):
                        cache[key].update(reestimate(module, family, mesh, zero))
                if args.write:
                    _save({key: cache[key] for key in keys if key in cache})
                continue
            # Reused: entries with the compiled collectives by role (older ones kept only the times).
            todo = [(m, z) for key, (m, z) in keys.items() if not (args.reuse and "counts" in cache.get(key, {}))]
            for mesh, zero, figures in measure(module, family, todo, args.chunk):
                key = f"{family}|{mesh}|{zero}"
                cache[key] = figures
                console.print(f"[red]{key}: {figures['error']}" if "error" in figures
                              else f"{key}: {figures['seconds']:.1f} s (wall {figures['wall']:.1f} s)")
                _save({key: figures})
    table = Table(title="analytic vs compiled (H100, deviceless) ranking of layouts by step time")
    for c in ("family", "devices", "layouts", "Spearman ρ", "analytic #1", "its compiled rank", "compiled #1"):
        table.add_column(c, justify="left" if c in ("family", "analytic #1", "compiled #1") else "right")
    for family in fams:
        for n in map(int, args.devices.split(",")):
            rows = [(f"{m} z{z}", cache[f"{family}|{m}|{z}"]) for m, z in layouts(n)
                    if "estimate" in cache.get(f"{family}|{m}|{z}", {})]
            if len(rows) < 2:
                continue
            est = [r["estimate"] for _, r in rows]
            comp = [r["compiled"] for _, r in rows]
            first = int(np.argmin(est))
            rank = 1 + sum(c < comp[first] for c in comp)
            table.add_row(family, str(n), str(len(rows)), f"{spearman(est, comp):.2f}", rows[first][0], str(rank),
                          rows[int(np.argmin(comp))][0])
    console.print(table)


if __name__ == "__main__":
    main()
