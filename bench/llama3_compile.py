"""The "compile wins" check of the Llama 3 405B scale rows (``bench/published.py``): XLA:GPU,
deviceless for H100s (``sk.cost.simulate_many``), compiles the per-device program of one
pipeline stage of Llama 3 405B (d 16384, 128 heads, 8 KV heads, SwiGLU 53248, vocab 128,256,
untied) at TP8 with sequence parallelism on one host (``tensor=8``), without the pipeline and
without data parallelism, and the analytic model (``sk.cost.estimate``) counts the same layout.

Reduced against the published runs: no pipeline (one stage's layers run as a plain scanned
stack, so one microbatch's activations are alive, not the schedule's in-flight ones), no data
axis (no ZeRO/FSDP shard, no gradient reduction), the whole head and embedding on the stage.
What is compared is what the analytic model builds the scale rows from: per-device parameter,
optimizer and gradient bytes, and the saved activations per layer and sequence, read off four
compiles as the mixed difference over layers {2, 4} x sequences {1, 2} (everything that grows
with layers alone or with sequences alone cancels).

    python bench/llama3_compile.py [--seq 8192] [--timeout 3000]

Writes bench/results/llama3_compile.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import shardkit as sk  # noqa: E402
from shardkit import cost  # noqa: E402

GIB = 2 ** 30


def config(layers: int, seq: int, attention: str = "auto"):
    from models.transformer.config import Config

    return Config(vocab=128256, d_model=16384, layers=layers, heads=128, kv_heads=8, d_ff=53248, seq=seq,
                  tie_embeddings=False, rope_theta=500000.0, remat="none", attention=attention)


def flash_like(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ, impl="xla", block=512):
    """Causal attention computed ``block`` queries at a time, each block rematerialised: the
    backward keeps q, k, v and the output, what a flash kernel keeps (less its f32 row
    statistics, 4 bytes per head and token), and rebuilds one block's scores at a time (16
    heads x 512 x 8192 f32 at 8K: 256 MiB). cuDNN's fused kernel cannot be traced on a host
    without cuDNN (``models.transformer.model.attention_impl``)."""
    import math

    import jax
    import jax.numpy as jnp

    B, T, H, Q = q_BxTxHxQ.shape
    K = k_BxTxKxQ.shape[2]
    n = T // block
    q_NxBxCxKxGxQ = jnp.moveaxis((q_BxTxHxQ * jnp.asarray(1 / math.sqrt(Q), q_BxTxHxQ.dtype)).reshape(
        B, n, block, K, H // K, Q), 1, 0)

    @jax.checkpoint
    def one(i, q_BxCxKxGxQ):
        s_BxKxGxCxS = jnp.einsum("bckgq,bskq->bkgcs", q_BxCxKxGxQ, k_BxTxKxQ, preferred_element_type=jnp.float32)
        causal_CxS = (i * block + jnp.arange(block))[:, None] >= jnp.arange(T)[None, :]
        s_BxKxGxCxS = jnp.where(causal_CxS, s_BxKxGxCxS, jnp.finfo(jnp.float32).min)
        p_BxKxGxCxS = jax.nn.softmax(s_BxKxGxCxS, axis=-1).astype(v_BxTxKxQ.dtype)
        return jnp.einsum("bkgcs,bskq->bckgq", p_BxKxGxCxS, v_BxTxKxQ, preferred_element_type=jnp.float32
                          ).astype(v_BxTxKxQ.dtype)

    o_NxBxCxKxGxQ = jax.lax.map(lambda args: one(*args), (jnp.arange(n), q_NxBxCxKxGxQ))
    return jnp.moveaxis(o_NxBxCxKxGxQ, 0, 1).reshape(B, T, H, Q)


def jobs(seq: int, grid, sp: bool, attention: str):
    from models.transformer import model as recipe
    from models.transformer.plan import abstract_step

    if attention == "flash-like":
        recipe.causal_attention = flash_like
        attention = "xla"

    out = []
    for layers, seqs in grid:
        step, state, batch = abstract_step(config(layers, seq, attention), "tensor=8", global_batch=seqs, zero=0,
                                           precision="bf16", sequence_parallel=sp, target="h100")
        out.append((step, state, batch, "tensor=8"))
    return out


def pipeline_job(microbatches: int, repeats: int, seq: int, attention: str, schedule: str, layers: int = 128,
                 data: int = 1, zero: int = 0, context: int = 1):
    """One DP replica of the 8K runs as ``sk.pipeline`` runs it: 128 layers (the paper's 126
    padded to its 128 slots) over pipe=16 x tensor=8 (16 hosts), ``microbatches`` sequences."""
    from models.transformer import model as recipe
    from models.transformer.plan import abstract_step

    if attention == "flash-like":
        recipe.causal_attention = flash_like
        attention = "xla"
    mesh = ",".join(f"{n}={k}" for n, k in (("pipe", 16), ("data", data), ("context", context), ("tensor", 8))
                    if k > 1)
    amesh = sk.cost.abstract_mesh(mesh, target="h100", max_devices=65536)
    step, state, batch = abstract_step(config(layers, seq, attention), amesh, global_batch=microbatches * data, zero=zero,
                                       precision="bf16", sequence_parallel=True, schedule=schedule,
                                       repeats=repeats, pipeline_microbatches=microbatches, target="h100")
    return step, state, batch, mesh


def analytic(layers: int, seqs: int, seq: int, sp: bool) -> dict:
    """The analytic model's memory of the same layout, activations counted as XLA keeps them."""
    ms = dataclasses.replace(cost.model_shape(config(layers, seq)), activations="xla")
    e = cost.estimate(ms, cost.Layout(tensor=8, sequence_parallel=sp), "h100", global_batch=seqs,
                      precision="bf16")
    return e.memory


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--grid", default="2x1,4x1,2x2,4x2,8x1",
                   help="layers x sequences per compile (8x1: one stage of the 8K runs, one microbatch)")
    p.add_argument("--attention", default="flash-like",
                   help="the recipe's Config.attention, or flash-like (default: see flash_like)")
    p.add_argument("--pipeline", default="",
                   help="instead: compile one DP replica through sk.pipeline, 'SCHEDULE,m,v[,layers[,data,zero[,context]]]' "
                        "(e.g. interleaved-1f1b,32,8; 128 layers, no data axis by default)")
    p.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "llama3_compile.json"))
    a = p.parse_args(argv)
    sp = not a.no_sp
    if a.pipeline:
        schedule, m, v, *more = a.pipeline.split(",")
        t0 = time.perf_counter()
        (r,) = sk.cost.simulate_many([pipeline_job(int(m), int(v), a.seq, a.attention, schedule,
                                                   *map(int, more))],
                                     target="h100", timeout=a.timeout)
        out = {"pipeline": a.pipeline, "seq": a.seq,
               "wall_s": time.perf_counter() - t0}
        if isinstance(r, Exception):
            out["error"] = str(r)[:3000]
        else:
            out["compiled"] = {k: float(v) for k, v in r.memory.items()}
            out["seconds"] = {k: float(v) for k, v in (r.seconds or {}).items()}
        print(json.dumps(out, indent=1))
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        return out
    grid = [tuple(int(x) for x in g.split("x")) for g in a.grid.split(",")]
    t0 = time.perf_counter()
    reports = sk.cost.simulate_many(jobs(a.seq, grid, sp, a.attention), target="h100", timeout=a.timeout)
    wall = time.perf_counter() - t0
    rows = []
    for (layers, seqs), r in zip(grid, reports):
        est = analytic(layers, seqs, a.seq, sp)
        row = {"layers": layers, "seqs": seqs, "analytic": est}
        if isinstance(r, Exception):
            row["error"] = str(r)[:2000]
        else:
            row["compiled"] = {k: float(v) for k, v in r.memory.items()}
            row["seconds"] = {k: float(v) for k, v in (r.seconds or {}).items()}
        rows.append(row)
        c = row.get("compiled", {})
        ratio = f" (analytic/compiled peak {est['peak'] / c['peak']:.3f})" if c else ""
        print(f"L={layers} seqs={seqs}: compiled peak {c.get('peak', 0) / GIB:.2f} GiB temporaries "
              f"{c.get('temporaries', 0) / GIB:.2f} args {c.get('arguments', 0) / GIB:.2f}; analytic peak "
              f"{est['peak'] / GIB:.2f} temporaries {est['temporaries'] / GIB:.2f} activations "
              f"{est['activations'] / GIB:.2f} args {est['arguments'] / GIB:.2f}{ratio} "
              f"{row.get('seconds', {}).get('compile', 0):.0f} s {row.get('error', '')[:200]}")
    by = {(r["layers"], r["seqs"]): r for r in rows if "compiled" in r}
    out = {"seq": a.seq, "sequence_parallel": sp, "mesh": "tensor=8", "target": "h100", "wall_s": wall,
           "rows": rows}
    if all(k in by for k in ((2, 1), (4, 1), (2, 2), (4, 2))):
        def mixed(get):
            return (get(by[4, 2]) - get(by[2, 2]) - get(by[4, 1]) + get(by[2, 1])) / 2

        comp = mixed(lambda r: r["compiled"]["temporaries"])
        # The analytic temporaries take the larger of the pass's peak and the update's, which
        # hides the activations at these sizes: compare its activations term.
        model = mixed(lambda r: r["analytic"]["activations"])
        out["per_layer_sequence"] = {"compiled": comp, "analytic": model}
        print(f"saved activations per layer and sequence: compiled {comp / GIB:.3f} GiB, analytic "
              f"{model / GIB:.3f} GiB ({model / comp - 1:+.1%})")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{wall:.0f} s; wrote {a.json}")
    return out


if __name__ == "__main__":
    main()
