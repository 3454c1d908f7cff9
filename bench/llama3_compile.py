"""The "compile wins" check of the Llama 3 405B scale rows (``bench/published.py``): XLA:GPU,
deviceless for H100s (``sk.cost.simulate_many``), compiles the recipe transformer at Llama 3
405B's widths (d 16384, 128 heads, 8 KV heads, SwiGLU 53248, vocab 128,256, untied, RoPE
theta 500,000; bf16 with f32 master weights and Adam, AdamW, clip 1.0; TP8 with sequence
parallelism, no recompute), and the analytic model (``sk.cost.estimate``, activations counted
with ``ModelShape.activations="xla"``) counts each same layout.

1. Layers at TP8 on one host (``tensor=8``), no pipeline, no data axis: 2 and 4 layers x 1 and
   2 sequences of 8,192 tokens, and 8 layers x 1 (one pipeline stage of the 8K runs, one
   microbatch). The saved activations per layer and sequence are the mixed difference of the
   four temporaries (what grows with layers alone or with sequences alone cancels).
2. The pipeline as ``sk.pipeline`` runs it (stage inputs kept, the forward recomputed in each
   backward op: not the paper's executor, which keeps every in-flight microbatch's residuals;
   that one no compiler here can run) with the real shapes and 128 layers (the paper's 126
   padded to its 128 slots): one DP replica on pipe=16 x tensor=8 (128 GPUs; interleaved 1F1B
   v 8 and v 4, 1F1B; 64 layers at v 4), and the 8K runs' whole meshes, pipe=16 x data=64 x
   tensor=8 (8,192 GPUs, 32 microbatches) and x data=128 (16,384 GPUs, 16 microbatches), ZeRO-3.

Reduced against the published runs: the attention is ``flash_like`` (cuDNN's kernel cannot be
traced here), ``sk.pipeline``'s executor stands for the paper's, 128 layers for 126, and the
128K row (context=16) is not in the default run: XLA's SPMD partitioner aborted on pipe x context
x tensor (``--pipeline interleaved-1f1b,16,8,128,8,3,16 --seq 131072``), on a gather in the loss
that the recipe no longer emits (``sk.kernels.cross_entropy``, issue 37); that command is the
way to compile it.

    python bench/llama3_compile.py              # both parts, ~5 min on 2 shared cores
    python bench/llama3_compile.py --pipeline SCHEDULE,m,v[,layers[,data,zero[,context]]]

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


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--pipeline", default="", help="compile one pipeline only: SCHEDULE,m,v[,layers[,data,zero"
                                                   "[,context]]] (e.g. interleaved-1f1b,32,8)")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "llama3_compile.json"))
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402
from shardkit import cost  # noqa: E402

GIB = 2 ** 30
GRID = ((2, 1), (4, 1), (2, 2), (4, 2), (8, 1))  # (layers, sequences) on tensor=8
# (schedule, microbatches, chunks per stage, layers, data, zero): the pipelines compiled.
PIPELINES = (("interleaved-1f1b", 32, 8, 128, 1, 0), ("interleaved-1f1b", 32, 4, 128, 1, 0),
             ("interleaved-1f1b", 32, 4, 64, 1, 0), ("1f1b", 32, 1, 128, 1, 0),
             ("interleaved-1f1b", 32, 8, 128, 64, 3), ("interleaved-1f1b", 16, 8, 128, 128, 3))


def config(layers: int, seq: int, attention: str = "xla"):
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


def _use_flash_like() -> None:
    from models.transformer import model as recipe

    recipe.causal_attention = flash_like


def _mesh(data: int = 1, context: int = 1, pipe: int = 1):
    spec = ",".join(f"{n}={k}" for n, k in (("pipe", pipe), ("data", data), ("context", context), ("tensor", 8))
                    if k > 1)
    return spec, sk.cost.abstract_mesh(spec, target="h100", max_devices=65536)


def layer_job(layers: int, seqs: int, seq: int):
    from models.transformer.plan import abstract_step

    spec, amesh = _mesh()
    step, state, batch = abstract_step(config(layers, seq), amesh, global_batch=seqs, zero=0, precision="bf16",
                                       sequence_parallel=True, target="h100")
    return step, state, batch, spec


def pipeline_job(schedule: str, microbatches: int, repeats: int, layers: int = 128, data: int = 1, zero: int = 0,
                 context: int = 1, seq: int = 8192):
    """One step of ``layers`` layers through ``sk.pipeline`` on pipe=16 x data x context x
    tensor=8, ``microbatches`` sequences per replica."""
    from models.transformer.plan import abstract_step

    spec, amesh = _mesh(data, context, pipe=16)
    step, state, batch = abstract_step(config(layers, seq), amesh, global_batch=microbatches * data, zero=zero,
                                       precision="bf16", sequence_parallel=True, schedule=schedule,
                                       repeats=repeats, pipeline_microbatches=microbatches, target="h100")
    return step, state, batch, spec


def analytic(layers: int, seq: int, global_batch: int, layout) -> dict:
    """The analytic model's memory of the same layout, activations counted as XLA keeps them."""
    ms = dataclasses.replace(cost.model_shape(config(layers, seq)), activations="xla")
    return cost.estimate(ms, layout, "h100", global_batch=global_batch, precision="bf16").memory


def _compiled(r) -> dict:
    if isinstance(r, Exception):
        return {"error": str(r)[:3000]}
    return {"compiled": {k: float(v) for k, v in r.memory.items()},
            "seconds": {k: float(v) for k, v in (r.seconds or {}).items()}}


def _line(name: str, row: dict) -> str:
    c, e = row.get("compiled"), row["analytic"]
    if c is None:
        return f"{name}: {row['error'][:300]}"
    return (f"{name}: compiled peak {c['peak'] / GIB:.2f} GiB (temporaries {c['temporaries'] / GIB:.2f}), analytic "
            f"{e['peak'] / GIB:.2f} ({e['temporaries'] / GIB:.2f}): {e['peak'] / c['peak'] - 1:+.1%}; compile "
            f"{row['seconds'].get('compile', 0):.0f} s")


def main(argv=None) -> dict:
    a = parse_args(argv)
    _use_flash_like()
    if a.pipeline:
        schedule, *nums = a.pipeline.split(",")
        pipes, grid = [(schedule, *map(int, nums))], []
    else:
        pipes, grid = list(PIPELINES), list(GRID)
    t0 = time.perf_counter()
    jobs = [layer_job(L, n, a.seq) for L, n in grid]
    jobs += [pipeline_job(*pl, seq=a.seq) for pl in pipes]
    reports = sk.cost.simulate_many(jobs, target="h100", timeout=a.timeout)
    out = {"seq": a.seq, "target": "h100", "wall_s": time.perf_counter() - t0, "layers": [], "pipelines": []}
    for (L, n), r in zip(grid, reports):
        row = {"layers": L, "seqs": n, "mesh": "tensor=8",
               "analytic": analytic(L, a.seq, n, cost.Layout(tensor=8, sequence_parallel=True)), **_compiled(r)}
        out["layers"].append(row)
        print(_line(f"tensor=8, {L} layers x {n} sequences", row))
    for pl, r in zip(pipes, reports[len(grid):]):
        schedule, m, v, L, data, zero, context = (tuple(pl) + (128, 1, 0, 1)[len(pl) - 3:])[:7]
        lo = cost.Layout(pipe=16, data=data, context=context, tensor=8, zero=zero, microbatches=m,
                         schedule=schedule, repeats=v, sequence_parallel=True)
        row = {"pipeline": [schedule, m, v, L, data, zero, context], "mesh": str(lo),
               "analytic": analytic(L, a.seq, m * data, lo), **_compiled(r)}
        out["pipelines"].append(row)
        print(_line(f"{lo}, {L} layers", row))
    by = {(r["layers"], r["seqs"]): r for r in out["layers"] if "compiled" in r}
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
    print(f"{out['wall_s']:.0f} s; wrote {a.json}")
    return out


if __name__ == "__main__":
    main()
