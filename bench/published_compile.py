"""Published runs compiled at their real device counts: MaxText's Llama 2 7B on 8–128 H100s and
Megatron-LM's 145.6B GPT on 1,536 A100s (``bench/published.py``'s rows), each through the
transformer recipe, compiled deviceless by XLA:GPU for that GPU (``sk.cost.simulate_many``).

Per run: the compiled peak per GPU against the GPU's memory (fits or not), and the step-time
model (``sk.cost``'s ``times``) fed with the compiled matmul flops and collectives on the run's
own hardware entry (``h100-a3``: Google Cloud A3's 12.5 GB/s between VMs; ``a100``: Selene's
InfiniBand), plus the non-matmul kernels' memory-bound time of the analytic model — in the
source's unit beside the published figure. Llama 3 405B's rows: ``bench/llama3_compile.py``.

What the recipe changes from the published models (said per row in the JSON): MaxText's
``remat_policy: minimal_flash`` (matmul and flash outputs saved) is ``remat="dots"``; its
``ici_fsdp=8, dcn_data=N`` is ``fsdp=8,data=N`` at ZeRO-0 (weights, gradients and Adam sharded
over fsdp, replicated over data). Megatron's GPT has a GELU MLP of 4h and learned positions;
the recipe's SwiGLU takes d_ff = 8h/3 (the same parameters and flops) and RoPE; its interleaved
1F1B with 2 chunks per stage is ``sk.pipeline``'s ``interleaved-1f1b`` (each backward op
recomputes its chunk's forward, as Megatron's full recompute does too), 48 microbatches of 2.

    python bench/published_compile.py                  # every row (~10 min on 2 shared cores)
    python bench/published_compile.py --runs maxtext24-llama2-7b-1node

Writes bench/results/published_compile.json after each row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RUNS = ("maxtext24-llama2-7b-1node", "maxtext24-llama2-7b-2node", "maxtext24-llama2-7b-4node",
        "maxtext24-llama2-7b-8node", "maxtext24-llama2-7b-16node", "megatron21-145.6b")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    p.add_argument("--timeout", type=float, default=3000.0, help="seconds per compile")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "published_compile.json"))
    return p.parse_args(argv)


def recipe(run):
    """``(Config, mesh spec, abstract_step keywords, target, what changed)`` for a published run."""
    from models.transformer.config import Config

    if run.source == "maxtext24":
        cfg = Config(vocab=run.vocab, d_model=run.d_model, layers=run.layers, heads=run.heads,
                     kv_heads=run.kv_heads, d_ff=run.d_ff, seq=run.seq, tie_embeddings=False, remat="dots")
        mesh = f"data={run.data},fsdp={run.fsdp}" if run.data > 1 else f"fsdp={run.fsdp}"
        return cfg, mesh, dict(zero=0), "h100", "remat dots for minimal_flash; fsdp x data at ZeRO-0"
    if run.source == "megatron21":
        cfg = Config(vocab=run.vocab, d_model=run.d_model, layers=run.layers, heads=run.heads,
                     d_ff=8 * run.d_model // 3, seq=run.seq, tie_embeddings=True, remat="full")
        mesh = f"data={run.data},pipe={run.pipe},tensor={run.tensor}"
        kw = dict(zero=run.zero, sequence_parallel=run.sequence_parallel,
                  schedule="interleaved-1f1b" if run.virtual > 1 else "1f1b", repeats=run.virtual,
                  pipeline_microbatches=run.microbatches)
        return cfg, mesh, kw, "a100", ("SwiGLU d_ff 8h/3 for GELU 4h (same parameters and flops), RoPE for "
                                       "learned positions, bf16 for fp16")
    raise ValueError(f"{run.key}: no recipe mapping for source {run.source!r}")


def compile_run(run, timeout: float) -> dict:
    import shardkit as sk
    from models.transformer.plan import abstract_step
    from shardkit.cost import hardware as hw_lib
    from shardkit.cost.analytic.steptime import memory_bound_time, roofline_excess, times

    import published

    cfg, mesh, kw, target, changed = recipe(run)
    t0 = time.time()
    row = {"key": run.key, "mesh": mesh, "target": target, "hardware": run.hardware, "devices": run.devices,
           "global_batch": run.global_batch, "seq": run.seq, "published": run.value, "unit": run.unit,
           "changed": changed, "keywords": {k: v for k, v in kw.items()}}
    try:
        step, state, batch = abstract_step(cfg, mesh, global_batch=run.global_batch, precision="bf16",
                                           target=target, **kw)
        (r,) = sk.cost.simulate_many([(step, state, batch, mesh)], target=target, timeout=timeout)
        if isinstance(r, Exception):
            raise r
    except Exception as err:  # noqa: BLE001 — a row that cannot be compiled is recorded with why
        return {**row, "seconds": round(time.time() - t0, 1), "error": f"{type(err).__name__}: {str(err)[:600]}"}
    hw, lay = hw_lib.lookup(run.hardware), published.layout(run)
    memory_s = memory_bound_time(published.model(run), lay, hw, global_batch=run.global_batch, flash=run.flash,
                                 gated=run.arch == "llama", dropout=run.dropout)
    t = times(r.roles(), r.role_counts(), r.matmul_flops, hw, lay, memory_seconds=memory_s)
    modelled = published.in_source_unit(run, t["step"])
    # The same with each compiled kernel at its roofline (flops or device-memory bytes) instead
    # of the ModelShape's memory-bound formula.
    roof = times(r.roles(), r.role_counts(), r.matmul_flops, hw, lay, memory_seconds=roofline_excess(r.kernels, hw))
    return {**row, "seconds": round(time.time() - t0, 1), "peak_gib": r.memory["peak"] / 2**30,
            "temporaries_gib": r.memory["temporaries"] / 2**30, "device_gib": r.device_memory / 2**30,
            "fits": bool(r.fits), "matmul_tflop": r.matmul_flops / 1e12, "step_s": t["step"],
            # bench/published.py's sign: published seconds over modelled, less 1 (+: the run was slower)
            "modelled": modelled, "error": published.published_seconds(run) / t["step"] - 1.0,
            "roofline_step_s": roof["step"], "roofline_modelled": published.in_source_unit(run, roof["step"]),
            "roofline_error": published.published_seconds(run) / roof["step"] - 1.0,
            "collectives_gib": {k: v / 2**30 for k, v in r.roles().items() if v}}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import published

    by_key = {r.key: r for r in published.RUNS}
    rows = []
    for key in args.runs:
        row = compile_run(by_key[key], args.timeout)
        rows.append(row)
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        if isinstance(row["error"], str):  # a compiled row's "error" is its relative error
            print(f"{key}: {row['error']}", flush=True)
        else:
            print(f"{key}: {row['mesh']} on {row['devices']} {row['target']}: peak {row['peak_gib']:.2f} of "
                  f"{row['device_gib']:.1f} GiB ({'fits' if row['fits'] else 'does not fit'}); modelled "
                  f"{row['modelled']:.0f} vs published {row['published']:.0f} {row['unit']} "
                  f"(error {row['error']:+.1%}); kernels' roofline {row['roofline_modelled']:.0f} "
                  f"({row['roofline_error']:+.1%}); {row['seconds']:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()
