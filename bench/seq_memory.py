"""Memory per device against sequence length for the recipe's 7B, with and without context
parallelism, compiled deviceless by XLA:GPU (H100s) and XLA:TPU (a v5p slice), beside the
estimates (issue 35).

Each point is the recipe's step (``models.transformer.plan.abstract_step``: AdamW, bf16, the
defaults ``attention="auto"`` — Triton flash on H100, Mosaic flash on v5p — and the chunked
loss) on ``--devices`` devices of a target, ZeRO-3, at one sequence length:

* without CP: ``data=N``, one sequence per device (global batch N);
* with CP: ``data=N/c,context=c``, one sequence per ``c`` devices (``sk.context_attention``'s
  ring over ``context``; each step runs the target's Pallas flash kernel on its block).

Every point is compiled in its own ``sk.cost.simulate_many`` subprocess (a compile that fails
or runs out of time is that point's answer: its reason is recorded), with ``estimate=True``:
``explain()``'s estimate of the traced program beside XLA's figures. Beside both, the
``ModelShape`` estimate (``sk.cost.estimate`` from the recipe's ``Config``), which needs no
trace and so is given at every point, compiled or not. Results are written after each point.

    python bench/seq_memory.py [--target h100 tpu-v5p] [--devices 64] [--context 8]
        [--seq 4096 8192 ...] [--remat dots] [--out bench/results/seq_memory.json] [--dry-run]

The committed series are ``--remat dots`` and ``--remat none``, with and without CP
(BENCHMARKS.md, issue 35's 7B section). CP with a remat policy compiles since the ring's
forward is one opaque primitive (``shardkit/_opaque.py``); before, every such point failed the
compiler's import (``docs/upstream/shardy_scan_shard_map_empty_operands.py``).

``--dry-run``: the points and their ModelShape estimates only (nothing traced, compiled or
written). ``--estimate-only``: those estimates written for the points ``--out`` lacks
(``"compiled": null``: not compiled), for points whose compiles did not fit the time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQS = (4096, 8192, 16384, 32768, 65536, 131072)
GIB = 2 ** 30


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before JAX is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="7b", help="models/transformer/config.py SIZES")
    p.add_argument("--target", nargs="+", default=["h100", "tpu-v5p"])
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--context", type=int, default=8, help="the context axis of the CP layout")
    p.add_argument("--cp", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--seq", type=int, nargs="+", default=list(SEQS))
    p.add_argument("--remat", default="dots", help="Config.remat")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per point's compile")
    p.add_argument("--out", default="bench/results/seq_memory.json",
                   help="JSON written after each point (existing points of other targets/seqs are kept)")
    p.add_argument("--dry-run", action="store_true", help="ModelShape estimates only: nothing compiled or written")
    p.add_argument("--estimate-only", action="store_true",
                   help="write the ModelShape estimates of points not in --out yet, marked not compiled")
    a = p.parse_args(argv)
    if a.devices % a.context:
        p.error(f"--context {a.context} does not divide --devices {a.devices}; pick a divisor")
    return a


def layouts(devices: int, context: int, cp: list[str]) -> list[dict]:
    """The layouts compared: mesh, global batch and the cost model's ``Layout`` sizes."""
    out = []
    if "off" in cp:
        out.append({"cp": False, "mesh": f"data={devices}", "global_batch": devices,
                    "layout": {"data": devices}})
    if "on" in cp:
        data = devices // context
        mesh = f"data={data},context={context}" if data > 1 else f"context={context}"
        out.append({"cp": True, "mesh": mesh, "global_batch": data, "layout": {"data": data, "context": context}})
    return out


def model_shape_estimate(cfg, lay: dict, target: str) -> dict:
    """``sk.cost.estimate`` of the recipe ``Config`` on the layout (ZeRO-3), bytes per device."""
    import shardkit as sk

    hw = _hardware(target)
    est = sk.cost.estimate(cfg, sk.cost.Layout(zero=3, remat=cfg.remat, **lay["layout"]), hw,
                           global_batch=lay["global_batch"], precision="bf16")
    return {k: float(est.memory[k]) for k in ("temporaries", "peak", "activations") if k in est.memory}


def _hardware(target: str) -> str:
    from shardkit.cost.compiled import targets

    return targets.get(target).hardware


def compile_point(cfg, lay: dict, target: str, timeout: float) -> dict:
    """One point compiled by the target's compiler: its figures, or why there are none."""
    import shardkit as sk
    from models.transformer.plan import abstract_step

    t0 = time.time()
    try:
        step, state, batch = abstract_step(cfg, lay["mesh"], global_batch=lay["global_batch"], zero=3,
                                           precision="bf16", target=target)
        (r,) = sk.cost.simulate_many([(step, state, batch, lay["mesh"])], target=target, estimate=True,
                                     timeout=timeout)
    except Exception as err:  # noqa: BLE001 — a point that cannot be traced or compiled is recorded
        r = err
    out = {"seconds": round(time.time() - t0, 1)}
    if isinstance(r, Exception):
        return {**out, "error": f"{type(r).__name__}: {str(r).strip().replace(str(ROOT) + '/', '')[:400]}"}
    est = {c["quantity"]: c["estimate"] for c in r.comparison()}
    return {**out, "temporaries": float(r.memory["temporaries"]), "peak": float(r.memory["peak"]),
            "device_memory": float(r.device_memory), "fits": r.fits,
            "explain_estimate": {k: float(est[f"memory/{k}"]) for k in ("temporaries", "peak")
                                 if f"memory/{k}" in est}}


def _load(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"points": []}


def _key(p: dict) -> tuple:
    return (p["target"], p["devices"], p["cp"], p["seq"], p["remat"], p["size"])


def table(points: list[dict]):
    """A rich table of the points, GiB per device."""
    from rich.table import Table

    t = Table(title="Memory per device vs sequence (GiB): compiled / explain estimate / ModelShape")
    for col in ("target", "mesh", "remat", "seq", "compiled peak", "fits", "explain est. peak", "ModelShape peak",
                "compiled temps", "ModelShape temps", "note"):
        t.add_column(col, justify="right" if col not in ("target", "mesh", "remat", "note") else "left")
    g = lambda v: f"{v / GIB:,.2f}" if isinstance(v, (int, float)) else "–"  # noqa: E731
    for p in sorted(points, key=lambda p: (p["target"], p["cp"], p["remat"], p["seq"])):
        c = p["compiled"] or {}
        t.add_row(p["target"], p["mesh"], p["remat"], f"{p['seq']:,}", g(c.get("peak")),
                  {True: "yes", False: "no"}.get(c.get("fits"), "–"), g((c.get("explain_estimate") or {}).get("peak")),
                  g(p["model_shape"].get("peak")), g(c.get("temporaries")), g(p["model_shape"].get("temporaries")),
                  c.get("error", "")[:80] if c else "not compiled")
    return t


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from rich.console import Console

    from models.transformer.config import SIZES

    console = Console(width=200)
    out = ROOT / a.out if not os.path.isabs(a.out) else pathlib.Path(a.out)
    data = {"points": []} if a.dry_run else _load(out)
    command = "python bench/seq_memory.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for target in a.target:
        for seq in a.seq:
            for lay in layouts(a.devices, a.context, a.cp):
                cfg = SIZES[a.size].replace(seq=seq, remat=a.remat)
                point = {"command": command, "target": target, "devices": a.devices, "size": a.size,
                         "remat": a.remat, "seq": seq, "cp": lay["cp"], "mesh": lay["mesh"],
                         "global_batch": lay["global_batch"], "zero": 3,
                         "model_shape": model_shape_estimate(cfg, lay, target), "compiled": None}
                if a.dry_run:
                    data["points"].append(point)
                    continue
                if a.estimate_only:
                    if any(_key(p) == _key(point) for p in _load(out)["points"]):
                        continue  # a compiled (or tried) point is never replaced by an estimate alone
                else:
                    point["compiled"] = c = compile_point(cfg, lay, target, a.timeout)
                    console.print(f"{target} {lay['mesh']} seq {seq}: "
                                  + (c["error"][:160] if "error" in c else
                                     f"peak {c['peak'] / GIB:.2f} GiB (fits: {c['fits']}), {c['seconds']} s"))
                data = _load(out)  # re-read: another run (another target) may have written since
                data["points"] = [p for p in data["points"] if _key(p) != _key(point)] + [point]
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, indent=1))
    console.print(table(data["points"]))
    return data["points"]


if __name__ == "__main__":
    main()
