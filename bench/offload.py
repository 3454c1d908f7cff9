"""Host offload and fp8 on H100s, by XLA:GPU's word (deviceless): per-GPU device and pinned
host bytes of the recipe with and without each feature, and the largest model that fits.

Part 1 — the recipe (default 7B, remat full, bf16, seq 4096) on 8 and 64 H100s, each layout
compiled as it is and with one feature on: ``--offload opt_state`` (the optimizer state in
pinned host memory), ``--remat offload`` (the weight-stationary matmul outputs saved in host
memory; beside it ``dots_no_batch``, the same policy saving on the device), ``--precision fp8``.
Device peak = arguments + outputs − aliased + temporaries in device memory; host = the same in
pinned host memory (``memory_analysis()``'s ``host_*``), per GPU.

Part 2 — the largest model of one family (d_model 8192, 64 heads, 8 KV heads, d_ff 28672,
vocab 32000, seq 4096, remat full: Llama-2-70B's shape, deeper or shallower) whose step fits
an H100 (79.1 GiB) under ZeRO-3 over N GPUs, one sequence per GPU, with and without the
optimizer state offloaded: the depth is bisected to ``--resolution`` layers, each probe
compiled.

    python bench/offload.py [--size 7b] [--gpus 8 64] [--skip-fit] [--skip-table]
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
    ap.add_argument("--size", default="7b")
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--resolution", type=int, default=4, help="layers the largest-model bisection resolves")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--variants", nargs="+", help="only these variants (and 'as is'), e.g. fp8")
    ap.add_argument("--skip-table", action="store_true")
    ap.add_argument("--skip-fit", action="store_true")
    ap.add_argument("--out", default="bench/results/offload.json")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk

GIB = 2 ** 30
# Layouts per GPU count: mesh, ZeRO stage, sequences per GPU. data=8 with ZeRO-1 at 3
# sequences is the layout that does not fit an H100 without offload.
LAYOUTS = {8: [("data=8", 1, 3), ("fsdp=8", 3, 1)], 64: [("data=8,fsdp=8", 1, 1), ("fsdp=64", 3, 1)]}
VARIANTS = [("as is", {}), ("offload opt_state", {"offload": ("opt_state",)}),
            ("remat dots_no_batch", {"remat": "dots_no_batch"}), ("remat offload", {"remat": "offload"}),
            ("fp8", {"precision": "fp8"})]


def _job(cfg, mesh, zero, seqs, gpus, remat=None, offload=(), precision="bf16"):
    from models.transformer.plan import abstract_step

    model = cfg if remat is None else cfg.replace(remat=remat)
    step, state, batch = abstract_step(model, mesh, global_batch=seqs * gpus, zero=zero, precision=precision,
                                       target="h100", offload=offload)
    return step, state, batch, mesh


def table(a, console) -> list[dict]:
    from rich.table import Table

    from models.transformer.config import SIZES

    cfg = SIZES[a.size].replace(remat="full")
    jobs, names = [], []
    for n in a.gpus:
        for mesh, zero, seqs in LAYOUTS[n]:
            for name, kw in VARIANTS:
                if a.variants and name not in a.variants and name != "as is":
                    continue
                jobs.append(_job(cfg, mesh, zero, seqs, n, **kw))
                names.append((n, mesh, zero, seqs, name))
    t0 = time.perf_counter()
    reports = sk.cost.simulate_many(jobs, target="h100", timeout=a.timeout)
    t = Table(title=f"recipe {a.size} (remat full unless named, bf16, seq {cfg.seq}) compiled by XLA:GPU for H100s "
                    f"({time.perf_counter() - t0:.0f} s)")
    for c in ("GPUs", "mesh", "ZeRO", "seq/GPU", "variant", "device peak GiB", "Δ device", "host GiB",
              "temporaries GiB", "fits 79.1 GiB"):
        t.add_column(c, justify="left" if c in ("mesh", "variant") else "right")
    rows, base = [], {}
    for (n, mesh, zero, seqs, name), r in zip(names, reports):
        if isinstance(r, Exception):
            t.add_row(str(n), mesh, str(zero), str(seqs), name, "error", str(r)[:80], "", "", "")
            rows.append({"gpus": n, "mesh": mesh, "variant": name, "error": str(r)[:2000]})
            continue
        peak, host = r.memory["peak"], r.memory.get("host_peak", 0)
        base.setdefault((n, mesh), peak)
        t.add_row(str(n), mesh, str(zero), str(seqs), name, f"{peak / GIB:.2f}",
                  f"{(peak - base[(n, mesh)]) / GIB:+.2f}", f"{host / GIB:.2f}",
                  f"{r.memory['temporaries'] / GIB:.2f}", "yes" if r.fits else "[bold red]no[/bold red]")
        rows.append({"gpus": n, "mesh": mesh, "zero": zero, "seqs_per_gpu": seqs, "variant": name,
                     "memory": r.memory, "fits": r.fits})
    console.print(t)
    return rows


def largest(a, console) -> list[dict]:
    """Bisects the family's depth for the largest model that fits, per GPU count, with and
    without the optimizer state offloaded."""
    from rich.table import Table

    from models.transformer.config import Config
    from models.transformer.model import param_count

    def family(layers: int) -> Config:
        return Config(vocab=32000, d_model=8192, layers=layers, heads=64, kv_heads=8, d_ff=28672, seq=4096,
                      tie_embeddings=False, remat="full")

    per_layer = param_count(family(2)) - param_count(family(1))
    t = Table(title="largest model of the 8192-wide family that fits an H100 (79.1 GiB), ZeRO-3, 1 sequence "
                    "of 4096 per GPU, remat full, bf16, by XLA:GPU")
    for c in ("GPUs", "offload", "layers", "parameters", "device peak GiB", "host GiB", "next depth (does not fit)",
              "compiles", "seconds"):
        t.add_column(c, justify="right")
    rows = []
    for n in a.gpus:
        for offload in ((), ("opt_state",)):
            t0, probes = time.perf_counter(), {}

            def fits(layers: int, probes=probes, n=n, offload=offload):
                if layers not in probes:
                    (r,) = sk.cost.simulate_many([_job(family(layers), f"fsdp={n}", 3, 1, n, offload=offload)],
                                                 target="h100", timeout=a.timeout)
                    probes[layers] = r
                r = probes[layers]
                return (not isinstance(r, Exception)) and bool(r.fits)

            # 16 bytes of state per parameter (f32 params, grads, Adam) over N GPUs, 8 of them
            # on the host with offload: the guess the bisection starts from.
            guess = int(0.8 * 79.1 * GIB * n / ((8 if offload else 16) * per_layer))
            step = a.resolution
            first = max(step, round(guess / step) * step)
            if fits(first):  # walk up in strides of 8 steps, then bisect
                lo, hi = first, first + 8 * step
                while fits(hi):
                    lo, hi = hi, hi + 8 * step
            else:
                lo, hi = first - 8 * step, first
                while lo > 0 and not fits(lo):
                    lo, hi = lo - 8 * step, lo
                lo = max(lo, 0)
            while hi - lo > step:
                mid = max(lo + step, (lo + hi) // 2 // step * step)
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            if lo == 0:
                probes[0] = RuntimeError("no depth fits")
            r = probes[lo]
            ok = not isinstance(r, Exception) and r.fits
            row = {"gpus": n, "offload": list(offload), "layers": lo if ok else 0,
                   "params": param_count(family(lo)) if ok else 0, "next_layers": hi,
                   "peak": r.memory["peak"] if ok else None, "host": r.memory.get("host_peak", 0) if ok else None,
                   "compiles": len(probes), "seconds": time.perf_counter() - t0}
            rows.append(row)
            t.add_row(str(n), ", ".join(offload) or "-", str(row["layers"]), f"{row['params'] / 1e9:.1f} B",
                      f"{(row['peak'] or 0) / GIB:.2f}", f"{(row['host'] or 0) / GIB:.2f}",
                      f"{hi} ({param_count(family(hi)) / 1e9:.1f} B)", str(len(probes)), f"{row['seconds']:.0f}")
            console.print(f"{n} GPUs, offload {offload or '-'}: {row['layers']} layers fit "
                          f"({len(probes)} compiles, {row['seconds']:.0f} s)")
    console.print(t)
    return rows


def main(argv=None) -> None:
    a = parse_args(argv)
    sk.use_cpu_devices(1)  # this process only traces; the compiles run in a child
    from rich.console import Console

    console = Console(width=160)
    result = {}
    if not a.skip_table:
        result["table"] = table(a, console)
    if not a.skip_fit:
        result["largest"] = largest(a, console)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
