"""The explicit-pipeline memory count off the model family it was checked on (issue 37): the
Llama 3 405B compiles set ``cost.estimate``'s terms for ``sk.pipeline``'s explicit schedules
(``tests/test_published.py``); here a model unlike it — full multi-head attention (K/V heads =
query heads), a 4·d MLP, 64-wide heads, a 32K tied vocabulary, tensor=4 — goes through the
recipe (``models.transformer.plan.builder``) pipelined, each ``keep``, compiled deviceless by
XLA:GPU for H100s, beside the analytic peak of the same layout. Nothing here was fitted.
The attention is ``bench/llama3_compile.py``'s ``flash_like`` (what the Llama 3 compiles ran:
q, k, v and the output kept, the scores rebuilt a block at a time), or with ``--attention
triton`` the Pallas Triton kernel the recipe runs on an H100 target (its custom VJP keeps the
same four and the row log-sum-exp, named: ``shardkit/kernels/kept.py``).

    python bench/keep_out_of_sample.py [--attention triton]   # 3 compiles in one subprocess (~1-4 min)

Writes bench/results/keep_out_of_sample.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MESH = dict(pipe=4, data=2, tensor=4)
LAYOUT = dict(zero=3, microbatches=8, schedule="interleaved-1f1b", repeats=2, sequence_parallel=True)
MODEL = dict(vocab=32000, d_model=1024, layers=16, heads=16, kv_heads=16, d_ff=4096, seq=4096, tie_embeddings=True)
GLOBAL_BATCH = 16
KEEPS = ("input", "lean", "all")


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", choices=("flash_like", "triton"), default="flash_like")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "keep_out_of_sample.json"))
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import shardkit as sk
    from models.transformer.config import Config
    from models.transformer.plan import builder

    if args.attention == "flash_like":
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        import llama3_compile

        llama3_compile._use_flash_like()  # under the recipe's attention="xla"
    cfg = Config(**MODEL, attention="xla" if args.attention == "flash_like" else "triton")
    build = builder(cfg, global_batch=GLOBAL_BATCH, target="h100")
    # flash_like keeps what a flash kernel keeps (no scores), as the Llama 3 rows count it.
    ms = dataclasses.replace(sk.cost.model_shape(cfg), flash_attention=True)
    layouts = [sk.cost.Layout(**MESH, **LAYOUT, keep=k) for k in KEEPS]
    jobs = []
    for lo in layouts:
        step, state, batch = build(lo)
        jobs.append({"step": step, "state": state, "batch": batch, "mesh": step.plan.mesh})
    reports = sk.cost.simulate_many(jobs, target="h100")
    rows = []
    for lo, report in zip(layouts, reports):
        if isinstance(report, Exception):
            raise report
        analytic = sk.cost.estimate(ms, lo, "h100", global_batch=GLOBAL_BATCH).memory["peak"]
        compiled = float(report.memory["peak"])
        rows.append({"layout": str(lo), "keep": lo.keep, "analytic_gib": analytic / 2**30,
                     "compiled_gib": compiled / 2**30, "ratio": analytic / compiled})
        print(f"{lo}: analytic {analytic / 2**30:.2f} GiB, compiled {compiled / 2**30:.2f} GiB, "
              f"ratio {analytic / compiled:.3f}")
    out = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            out = json.load(f)
    out.update({"model": MODEL, "global_batch": GLOBAL_BATCH, "target": "h100"})
    out[args.attention] = rows
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
