"""The analytic estimate's error bands against a target compiler, per quantity.

Builds every model family (``tests/families.py``: MLP with a lookup, CNN, scanned GPT, MoE;
``tests/third_party_families.py``: models installed from pip, where installed) on each of its
layouts and the hybrid ones (``HYBRID_LAYOUTS``: ZeRO-1..3 on data x fsdp x tensor and data x
fsdp, ZeRO-1/2 on data x tensor), compiles the step for the target deviceless (``step.explain(..., mesh=, target=)``) and
reads ``estimate / compiled`` per quantity. A quantity's band is the range of ``ratio - 1`` over
the families fitted; the held-out family's band is printed apart. Rows the estimate marks "not
modelled" are counted apart (they print a reason, not a number), as are rows the program
does not execute (compiled 0).

    python bench/cost_bands.py --target h100                      # measure, print (reuse: --reuse)
    python bench/cost_bands.py --target h100 --reuse --write-bands    # + write shardkit/cost/compiled/bands.py
    python bench/cost_bands.py --target tpu-v5p --layouts hybrid     # 8 v5p chips (XLA:TPU via libtpu)

Compiled figures are cached in bench/results/cost_bands.json (``--reuse`` reads them back).
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import re
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--families", default="", help="comma-separated subset (default: all installed)")
    ap.add_argument("--held-out", default="bert",
                    help="the family kept out of the fitting (HF Flax BERT since issue 24 fixed the model on ResNet-18)")
    ap.add_argument("--layouts", default="all", choices=("all", "hybrid", "base"),
                    help="the families' own layouts (base), the hybrid ones (hybrid), or both")
    ap.add_argument("--reuse", action="store_true", help="read compiled figures back from bench/results")
    ap.add_argument("--write-bands", action="store_true", help="write the bands into shardkit/cost/compiled/bands.py")
    ap.add_argument("--reestimate", action="store_true",
                    help="recompute the estimates of the cached layouts (no compile): after a model change")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402

sk.use_cpu_devices(8)

import jax  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import families as house  # noqa: E402

QUANTITIES = ("memory/temporaries", "memory/peak", "collective/grad-reduce", "collective/param-gather",
              "collective/tensor-reduce", "collective/tensor-gather", "collective/expert-all-to-all", "flops")
RESULTS = ROOT / "bench" / "results" / "cost_bands.json"
BANDS_PY = ROOT / "shardkit" / "cost" / "compiled" / "bands.py"
# Hybrid meshes, where the data axes share a weight's dims with fsdp and tensor (issue 36): every
# family runs them on top of its own layouts (the 3-axis ZeRO-1 one is among those already).
HYBRID_LAYOUTS = [("data=2,fsdp=2,tensor=2", z) for z in (1, 2, 3)] + [("data=4,fsdp=2", z) for z in (1, 2, 3)] + [
    ("data=2,tensor=4", z) for z in (1, 2)]


def sources(which: str = "all") -> dict:
    """family -> (module with ``build``, its layouts): its own (``which="base"``), the hybrid
    ones (``"hybrid"``) or both (``"all"``)."""
    def pick(own):
        if which != "all":
            return list(HYBRID_LAYOUTS if which == "hybrid" else own)
        return own + [lo for lo in HYBRID_LAYOUTS if lo not in own]

    out = {f: (house, pick(house.LAYOUTS + (house.EXPERT_LAYOUTS if f == "moe" else []))) for f in house.FAMILIES}
    try:
        import third_party_families as third
    except ImportError:
        return out
    for f in third.available():
        out[f] = (third, pick(third.LAYOUTS))
    return out


def save(layouts: dict) -> None:
    """Layouts' figures (key -> figures) into the cache file, under a lock and merged with what
    is there: sweeps of two targets may run at once."""
    import fcntl

    RESULTS.parent.mkdir(exist_ok=True)
    with open(RESULTS.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
        cache.update(layouts)
        RESULTS.write_text(json.dumps(cache, indent=1, sort_keys=True))


def measure(family, module, mesh, zero, target) -> dict:
    step, state, batch = module.build(family, mesh, zero)
    t0 = time.perf_counter()
    report = step.explain(state, batch, mesh=mesh, target=target)
    rows = {r["quantity"]: [r["estimate"], r["compiled"], r["caveat"]] for r in report.comparison()}
    return {"rows": rows, "seconds": time.perf_counter() - t0}


def reestimate(family, module, mesh, zero, target, rows: dict) -> dict:
    """The cached compiled figures beside a fresh estimate (no compile): for changing the model
    and re-reading its error against the same programs."""
    from shardkit.cost.compiled import simulated, targets
    from shardkit.cost.analytic.from_step import step_estimate
    from shardkit.cost.compiled.report import Report
    from shardkit.plan import detailed_notes

    # Traced only: a builder that can leaves the state abstract (ResNet-18's init alone took
    # minutes of CPU per layout on the shared machine).
    abstract = {"abstract": True} if "abstract" in inspect.signature(module.build).parameters else {}
    step, state, batch = module.build(family, mesh, zero, **abstract)
    tgt = targets.get(target)
    amesh = simulated.abstract_mesh(mesh, max_devices=simulated.MAX_TARGET_DEVICES, target=tgt)
    sim = step.with_plan(simulated.simulated_plan(step.plan, amesh))
    abs_state, abs_batch = simulated.abstract_inputs(sim, state, batch)
    with simulated._on(sim.plan), detailed_notes():
        # The trace explain()'s export makes first: what the loss's blocks note (sk.moe's
        # dispatch, sk.pipeline's schedule) the estimate and its caveats read.
        jax.eval_shape(sim.step_function(), abs_state, abs_batch)
        est = step_estimate(sim, abs_state, abs_batch, hardware=tgt.hardware)
    new = est.as_dict()
    out = {}
    for q, (_, comp, _) in rows.items():
        # The report's own caveat logic (the peak flag) on the new figure.
        r = Report("", {}, [], 0.0, estimate={q: new.get(q, 0.0)}, caveats=dict(est.caveats), target=target)
        r.compiled = lambda comp=comp, q=q: {q: comp}
        row = r.comparison()[0] if r.comparison() else {"caveat": est.caveats.get(q)}
        out[q] = [new.get(q, 0.0), comp, row["caveat"]]
    return out


def bands(cache: dict, target: str, keep) -> dict[str, tuple[float, float, int, int]]:
    """quantity -> (low, high, layouts, models) over the cached rows of the families ``keep``
    accepts."""
    ratios: dict[str, list[tuple[float, str]]] = {}
    for key, got in cache.items():
        family, mesh, zero, tgt = key.split("|")
        if tgt != target or not keep(family):
            continue
        for q, (est, comp, caveat) in got["rows"].items():
            if q not in QUANTITIES or not comp or (caveat or "").startswith("not modelled"):
                continue
            ratios.setdefault(q, []).append((est / comp - 1, family))
    return {q: (min(r for r, _ in v), max(r for r, _ in v), len(v), len({f for _, f in v}))
            for q, v in ratios.items()}


def write_bands(target: str, fitted: dict, held: dict, held_family: str) -> None:
    text = BANDS_PY.read_text()
    old = dict(_read_tables(text))
    tables = {"BANDS": {**old.get("BANDS", {}), target: fitted}, "HELD_OUT": {**old.get("HELD_OUT", {}), target: held}}
    fmt = lambda t: "{\n" + "".join(  # noqa: E731
        f"    {tg!r}: {{\n" + "".join(f"        {q!r}: ({lo:.3f}, {hi:.3f}, {n}, {m}),\n"
                                     for q, (lo, hi, n, m) in sorted(v.items())) + "    },\n"
        for tg, v in sorted(t.items())) + "}"
    block = ("# --- measured: bench/cost_bands.py --write-bands ---\n"
             f"BANDS: dict[str, dict[str, tuple[float, float, int, int]]] = {fmt(tables['BANDS'])}\n"
             f"HELD_OUT: dict[str, dict[str, tuple[float, float, int, int]]] = {fmt(tables['HELD_OUT'])}\n"
             f"HELD_OUT_FAMILY = {held_family!r}\n# --- end ---")
    text = re.sub(r"# --- measured: bench/cost_bands.py --write-bands ---.*?# --- end ---", lambda _: block, text,
                  flags=re.S)
    BANDS_PY.write_text(text)


def _read_tables(text):
    namespace: dict = {}
    exec(re.search(r"# --- measured.*?# --- end ---", text, re.S).group(0), namespace)  # our own file
    return [(k, namespace[k]) for k in ("BANDS", "HELD_OUT")]


def main(argv=None) -> None:
    args = parse_args(argv)
    cache = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    fams = sources(args.layouts)
    wanted = [f for f in fams if not args.families or f in args.families.split(",")]
    console = Console(width=160)
    for family in wanted:
        module, layouts = fams[family]
        for mesh, zero in layouts:
            key = f"{family}|{mesh}|{zero}|{args.target}"
            if args.reestimate and key in cache:
                cache[key]["rows"] = reestimate(family, module, mesh, zero, args.target, cache[key]["rows"])
                save({key: cache[key]})  # this key only: runs for other families or targets may be saving theirs
                console.print(f"{key}: re-estimated")
                continue
            if args.reuse and key in cache:
                continue
            try:
                cache[key] = measure(family, module, mesh, zero, args.target)
            except Exception as e:  # a layout the family's rules cannot take: say so, go on
                console.print(f"[red]{key}: {type(e).__name__}: {str(e)[:300]}")
                continue
            console.print(f"{key}: {cache[key]['seconds']:.1f} s")
            save({key: cache[key]})
    held = args.held_out
    fitted = bands(cache, args.target, lambda f: f != held and f in fams)
    held_band = bands(cache, args.target, lambda f: f == held)
    table = Table(title=f"estimate / compiled - 1 on {args.target} (fitted: all families but {held})")
    for c in ("quantity", "band (fitted)", "layouts", "models", f"band ({held}, held out)", "layouts "):
        table.add_column(c, justify="left" if c == "quantity" else "right")
    for q in QUANTITIES:
        f, h = fitted.get(q), held_band.get(q)
        pct = lambda b: f"{b[0] * 100:+.0f}%..{b[1] * 100:+.0f}%" if b else "-"  # noqa: E731
        table.add_row(q, pct(f), str(f[2]) if f else "0", str(f[3]) if f else "0", pct(h), str(h[2]) if h else "0")
    console.print(table)
    per_family = Table(title="rows per family: modelled / not modelled / peak under by >10% unflagged")
    for c in ("family", "layouts", "not modelled rows", "peak est/compiled (min..max)", "unflagged peak miss"):
        per_family.add_column(c)
    for family in wanted:
        got = [v for k, v in cache.items() if k.startswith(family + "|") and k.endswith("|" + args.target)]
        peaks = [v["rows"]["memory/peak"] for v in got if "memory/peak" in v["rows"]]
        nm = sum((c or "").startswith("not modelled") for v in got for _, _, c in v["rows"].values())
        miss = sum(e < 0.9 * c and not (cv or "").startswith(("not modelled", "under-estimate")) for e, c, cv in peaks)
        rs = [e / c for e, c, _ in peaks if c]
        per_family.add_row(family, str(len(got)), str(nm), f"{min(rs):.2f}..{max(rs):.2f}" if rs else "-", str(miss))
    console.print(per_family)
    if args.write_bands:
        write_bands(args.target, fitted, held_band, held)
        console.print(f"wrote {BANDS_PY.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
