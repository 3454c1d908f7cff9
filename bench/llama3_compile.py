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
2. The pipeline as ``sk.pipeline`` runs it by default (``keep="input"``: stage inputs kept, the
   forward recomputed in each backward op; the paper's executor keeps every in-flight
   microbatch's residuals, ``keep="all"``, part 3) with the real shapes and 128 layers (the paper's 126
   padded to its 128 slots): one DP replica on pipe=16 x tensor=8 (128 GPUs; interleaved 1F1B
   v 8 and v 4, 1F1B; 64 layers at v 4), and the 8K runs' whole meshes, pipe=16 x data=64 x
   tensor=8 (8,192 GPUs, 32 microbatches) and x data=128 (16,384 GPUs, 16 microbatches), ZeRO-3.

3. The paper's layouts whole (``PUBLISHED``, ``bench/published.py``'s scale rows), each with
   ``sk.pipeline(keep=)`` = ``"input"`` (the stage input: each backward op recomputes its
   chunk's forward), ``"all"`` (every residual: Megatron's executor, no recompute) and
   ``"dots"`` (the matmul outputs kept, the rest recomputed), ``"lean"`` (the values the recipe
   names ``sk.LEAN_RESIDUALS``: no matmul recomputed): 8K on 8,192 and 16,384 GPUs, and
   128K (131,072 tokens) on pipe=16 x data=8 x context=16 x tensor=8 (16,384 GPUs, 16
   microbatches). Each row: the compiled peak against the H100's memory, and TFLOP/s per GPU in
   the paper's flop convention of a step timed by ``sk.cost.times`` on the compiled matmul
   flops and collectives (H100 links) plus the analytic memory-bound kernels' time.

Reduced against the published runs: the attention is ``flash_like`` (cuDNN's kernel cannot be
traced here; it computes the causally masked blocks too) at 8K, or with ``--attention triton``
the Pallas Triton flash kernel (``sk.attention``, causal blocks skipped); at 128K the context axis runs ``sk.context_attention``'s ring nested in
the stage (the Triton flash kernel per ring step); ``sk.pipeline``'s executor stands for the
paper's, 128 layers for 126.

    python bench/llama3_compile.py              # all three parts, 18 compiles
    python bench/llama3_compile.py --pipeline SCHEDULE,m,v[,layers[,data,zero[,context[,keep]]]] [--seq N]
    python bench/llama3_compile.py --published all|KEY:KEEP,...   # e.g. llama3-405b-128k-16384gpu:input
    python bench/llama3_compile.py --layer-remat lean,none --json PATH  # part 1's layers under a recipe remat
    XLA_FLAGS=--xla_gpu_memory_limit_slop_factor=300 python bench/llama3_compile.py --attention triton \
        --published llama3-405b-8k-16384gpu:lean   # the Triton kernel; XLA:GPU's own recompute limit raised

Writes bench/results/llama3_compile.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # published.py: the paper's runs


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=3000.0)
    p.add_argument("--pipeline", default="", help="compile one pipeline only: SCHEDULE,m,v[,layers[,data,zero"
                                                   "[,context[,keep]]]] (e.g. interleaved-1f1b,32,8)")
    p.add_argument("--published", default="", help="compile the paper's layouts only: 'all' or KEY:KEEP,... "
                                                    "(e.g. llama3-405b-128k-16384gpu:input)")
    p.add_argument("--layer-remat", default="", help="compile part 1's layers only, under each of these recipe "
                                                     "remat settings (e.g. none,lean): saved bytes and matmul "
                                                     "flops per layer and sequence")
    p.add_argument("--attention", choices=("flash_like", "triton"), default="flash_like",
                   help="the 8K attention: the blockwise stand-in (default) or the Pallas Triton flash "
                        "kernel (sk.attention's 'triton': causal blocks skipped)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.95,
                   help="the step's gpu_memory_fraction: XLA:GPU recomputes values past this share of the "
                        "H100 (default 0.95, shardkit's; an XLA_FLAGS slop factor overrides it)")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "llama3_compile.json"))
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402
from shardkit import cost  # noqa: E402

GIB = 2 ** 30
KEEPS = ("input", "all", "dots", "lean")  # sk.pipeline(keep=...): the stage input, every residual, a policy's,
# the values the recipe names sk.LEAN_RESIDUALS
GRID = ((2, 1), (4, 1), (2, 2), (4, 2), (8, 1))  # (layers, sequences) on tensor=8


class Pipe(NamedTuple):
    """One pipeline compiled: ``sk.pipeline``'s schedule, microbatches per replica, chunks per
    stage, layers, the data axis and ZeRO stage, the context axis, ``keep``, the sequence
    length (0: ``--seq``), the recipe's ``Config.attention`` (``"xla"`` runs ``flash_like``,
    ``_use_flash_like``; ``"triton"`` the Pallas Triton kernel) and the step's
    ``gpu_memory_fraction`` (XLA:GPU recomputes past that share of the device)."""

    schedule: str
    m: int
    v: int
    layers: int = 128
    data: int = 1
    zero: int = 0
    context: int = 1
    keep: str = "input"
    seq: int = 0
    attention: str = "xla"
    fraction: float = 0.95  # sk.xla.GPU_MEMORY_FRACTION, the step's default


PIPELINES = (Pipe("interleaved-1f1b", 32, 8), Pipe("interleaved-1f1b", 32, 4), Pipe("interleaved-1f1b", 32, 4, 64),
             Pipe("1f1b", 32, 1), Pipe("interleaved-1f1b", 32, 8, 128, 64, 3),
             Pipe("interleaved-1f1b", 16, 8, 128, 128, 3))
# The paper's layouts (``bench/published.py``'s scale rows) whole, each ``keep`` compiled.
PUBLISHED = {"llama3-405b-8k-8192gpu": Pipe("interleaved-1f1b", 32, 8, 128, 64, 3),
             "llama3-405b-8k-16384gpu": Pipe("interleaved-1f1b", 16, 8, 128, 128, 3),
             "llama3-405b-128k-16384gpu": Pipe("interleaved-1f1b", 16, 8, 128, 8, 3, 16, "input", 131072)}


def config(layers: int, seq: int, attention: str = "xla", remat: str = "none"):
    from models.transformer.config import Config

    return Config(vocab=128256, d_model=16384, layers=layers, heads=128, kv_heads=8, d_ff=53248, seq=seq,
                  tie_embeddings=False, rope_theta=500000.0, remat=remat, attention=attention)


def flash_like(q_BxTxHxQ, k_BxTxKxQ, v_BxTxKxQ, impl="xla", block=512):
    """Causal attention computed ``block`` queries at a time, each block rematerialised: the
    backward keeps q, k, v and the output, what a flash kernel keeps (less its f32 row
    statistics, 4 bytes per head and token), and rebuilds one block's scores at a time (16
    heads x 512 x 8192 f32 at 8K: 256 MiB). cuDNN's fused kernel cannot be traced on a host
    without cuDNN (``models.transformer.attention.attention_impl``)."""
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
    from models.transformer import attention

    attention.causal_attention = flash_like


def _mesh(data: int = 1, context: int = 1, pipe: int = 1):
    spec = ",".join(f"{n}={k}" for n, k in (("pipe", pipe), ("data", data), ("context", context), ("tensor", 8))
                    if k > 1)
    return spec, sk.cost.abstract_mesh(spec, target="h100", max_devices=65536)


def layer_job(layers: int, seqs: int, seq: int, remat: str = "none", attention: str = "xla"):
    from models.transformer.plan import abstract_step

    spec, amesh = _mesh()
    step, state, batch = abstract_step(config(layers, seq, attention, remat), amesh, global_batch=seqs, zero=0, precision="bf16",
                                       sequence_parallel=True, target="h100")
    return step, state, batch, spec


def pipeline_job(pl: Pipe, seq: int):
    """One step of ``pl.layers`` layers through ``sk.pipeline`` on pipe=16 x data x context x
    tensor=8, ``pl.m`` sequences per replica of ``pl.seq or seq`` tokens."""
    from models.transformer.plan import abstract_step

    spec, amesh = _mesh(pl.data, pl.context, pipe=16)
    step, state, batch = abstract_step(config(pl.layers, pl.seq or seq, pl.attention), amesh,
                                       global_batch=pl.m * pl.data, zero=pl.zero, precision="bf16",
                                       sequence_parallel=True, schedule=pl.schedule, repeats=pl.v,
                                       pipeline_microbatches=pl.m, target="h100", keep=pl.keep,
                                       gpu_memory_fraction=pl.fraction)
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


def _pipe_row(pl: Pipe, r, seq: int) -> dict:
    lo = cost.Layout(pipe=16, data=pl.data, context=pl.context, tensor=8, zero=pl.zero, microbatches=pl.m,
                     schedule=pl.schedule, repeats=pl.v, sequence_parallel=True)
    return {"pipeline": list(pl[:8]), "seq": pl.seq or seq, "mesh": str(lo),
            "analytic": analytic(pl.layers, pl.seq or seq, pl.m * pl.data, lo), **_compiled(r)}


def published_row(key: str, pl: Pipe, r) -> dict:
    """A paper layout's compile: its peak against the H100's memory, and the step time of the
    compiled matmul flops and collectives (``sk.cost.times``, the H100 links) plus the analytic
    memory-bound kernels' time (``steptime.memory_bound_time``, which a compile does not
    count), as TFLOP/s per GPU in the paper's flop convention (``published.source_flops``)."""
    import published

    run = next(x for x in published.RUNS if x.key == key)
    row = {"key": key, "keep": pl.keep, "pipeline": list(pl[:8]), "seq": run.seq, "published": run.value,
           "attention": "flash_like" if pl.attention == "xla" else pl.attention,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           # What the compile added (TrainStep.gpu_memory_fraction's XLA:GPU remat limit).
           "gpu_memory_fraction": pl.fraction, "compiler_options": sk.xla.compiler_options("gpu", pl.fraction),
           **_compiled(r)}
    if isinstance(r, Exception):
        return row
    # The memory-bound kernels of one forward and backward: keep="input"'s recomputed forward
    # runs its norms and activations again, which this leaves out (0.075 s of a ~10 s step).
    est = cost.estimate(published.model(run), published.layout(run), "h100", global_batch=run.global_batch,
                        precision="bf16")
    lo_c = cost.Layout(pipe=16, data=pl.data, context=pl.context, tensor=8, zero=pl.zero, microbatches=pl.m,
                       schedule=pl.schedule, repeats=pl.v, sequence_parallel=True)
    t = cost.times(r.roles(), r.role_counts(), r.matmul_flops, cost.hardware.lookup("h100"), lo_c,
                   memory_seconds=est.time["memory-bound"])
    row.update({"mesh": str(lo_c), "fits": bool(r.fits), "device_memory": float(r.device_memory),
                "matmul_flops": float(r.matmul_flops), "roles": r.roles(), "step_time": t,
                # what each role is made of: kind, axes, executions and bytes per device
                "traffic": [[x.kind, "+".join(x.axes), x.count, float(x.bytes)] for x in r.traffic],
                "model_flops_per_gpu": published.source_flops(run) / run.devices,
                "tflops": published.source_flops(run) / (run.devices * t["step"]) / 1e12})
    return row


def _published_line(row: dict) -> str:
    if "compiled" not in row:
        return f"{row['key']} keep={row['keep']}: {row['error'][:300]}"
    t = row["step_time"]
    return (f"{row['key']} keep={row['keep']}: compiled peak {row['compiled']['peak'] / GIB:.2f} GiB "
            f"({'fits' if row['fits'] else 'does not fit'} {row['device_memory'] / GIB:.1f}); step {t['step']:.2f} s "
            f"(compute {t['compute']:.2f}, bubble {t['bubble']:.2f}, exposed {t['exposed']:.2f}): "
            f"{row['tflops']:.1f} TFLOP/s per GPU vs {row['published']:.0f} "
            f"({row['tflops'] / row['published'] - 1:+.1%}); "
            f"matmul flops {row['matmul_flops'] / row['model_flops_per_gpu']:.2f}x the model's; compile "
            f"{row['seconds'].get('compile', 0):.0f} s")


def _published_jobs(spec: str, attention: str = "xla") -> list[tuple[str, Pipe]]:
    """``--published``: ``all`` (every row x every keep) or ``KEY:KEEP,...``, each with the
    recipe's ``attention``."""
    if spec == "all":
        return [(k, pl._replace(keep=keep, attention=attention)) for k, pl in PUBLISHED.items() for keep in KEEPS]
    out = []
    for item in spec.split(","):
        key, _, keep = item.partition(":")
        if key not in PUBLISHED or keep not in KEEPS:
            raise SystemExit(f"--published {item!r}: want KEY:KEEP, KEY one of {sorted(PUBLISHED)}, "
                             f"KEEP one of {KEEPS}")
        out.append((key, PUBLISHED[key]._replace(keep=keep, attention=attention)))
    return out


def layer_remat(a) -> dict:
    """``--layer-remat``: part 1's four layer compiles (2/4 layers x 1/2 sequences, tensor=8 +
    SP) under each recipe remat; the mixed differences are the temporaries kept and the matmul
    flops run per layer and sequence (what a pipeline's in-flight chunk-microbatch of one layer
    keeps under the ``keep`` of the same policy, and what its backward recomputes)."""
    remats, grid = a.layer_remat.split(","), GRID[:4]
    attention = _attention(a)
    jobs = [layer_job(L, n, a.seq, r, attention) for r in remats for L, n in grid]
    reports = iter(sk.cost.simulate_many(jobs, target="h100", timeout=a.timeout))
    model = cost.model_shape(config(1, a.seq))  # one layer's weights (norms' scales: 2 x d of 0.9 G)
    out = json.load(open(a.json)) if os.path.exists(a.json) else {}
    for r in remats:
        by = {g: next(reports) for g in grid}
        if bad := [g for g, x in by.items() if isinstance(x, Exception)]:
            print(f"remat {r}: {bad[0]} failed: {str(by[bad[0]])[:300]}")
            continue

        def mixed(get):
            return (get(by[4, 2]) - get(by[2, 2]) - get(by[4, 1]) + get(by[2, 1])) / 2

        kept = mixed(lambda x: float(x.memory["temporaries"]))
        flops = mixed(lambda x: float(x.matmul_flops))
        # the model's: 6 x a layer's matmul weights x tokens, over the tensor ranks (no attention)
        dense = 6 * model.layer_params * a.seq / 8
        out.setdefault("layer_remat", {})[r] = {"kept": kept, "matmul_flops": flops, "dense_flops": dense,
                                                "seq": a.seq}
        print(f"remat {r}: kept {kept / GIB:.3f} GiB per layer and sequence (tensor=8 + SP, {a.seq} tokens); "
              f"matmul flops {flops / 1e12:.2f} T per layer and sequence, {flops / dense:.2f}x 6 x the layer's "
              "matmul weights x tokens")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return out


def _attention(a) -> str:
    """The recipe's ``Config.attention`` for ``--attention`` (``flash_like`` patched in for "xla")."""
    if a.attention == "triton":
        return "triton"
    _use_flash_like()
    return "xla"


def main(argv=None) -> dict:
    a = parse_args(argv)
    grid, pipes, pubs = [], [], []
    if a.layer_remat:
        return layer_remat(a)
    attention = _attention(a)
    if a.pipeline:
        schedule, *rest = a.pipeline.split(",")
        nums, keep = (rest[:-1], rest[-1]) if len(rest) == 7 else (rest, "input")
        pipes = [Pipe(schedule, *map(int, nums), keep=keep)]
    elif a.published:
        pubs = _published_jobs(a.published, attention)
    else:
        grid, pipes, pubs = list(GRID), list(PIPELINES), _published_jobs("all", attention)
    pipes = [pl._replace(attention=attention) for pl in pipes]
    pipes, pubs = ([pl._replace(fraction=a.gpu_memory_fraction) for pl in pipes],
                   [(k, pl._replace(fraction=a.gpu_memory_fraction)) for k, pl in pubs])
    t0 = time.perf_counter()
    jobs = [layer_job(L, n, a.seq, attention=attention) for L, n in grid]
    jobs += [pipeline_job(pl, a.seq) for pl in pipes] + [pipeline_job(pl, a.seq) for _, pl in pubs]
    reports = sk.cost.simulate_many(jobs, target="h100", timeout=a.timeout)
    # A partial run (--pipeline, --published) replaces its own rows of the JSON and keeps the rest.
    old = json.load(open(a.json)) if os.path.exists(a.json) and (a.pipeline or a.published) else {}
    out = {"seq": a.seq, "target": "h100", "layers": [], "pipelines": [], "published": [], **old,
           "wall_s": time.perf_counter() - t0}
    for (L, n), r in zip(grid, reports):
        row = {"layers": L, "seqs": n, "mesh": "tensor=8",
               "analytic": analytic(L, a.seq, n, cost.Layout(tensor=8, sequence_parallel=True)), **_compiled(r)}
        out["layers"].append(row)
        print(_line(f"tensor=8, {L} layers x {n} sequences", row))
    rest = reports[len(grid):]
    for pl, r in zip(pipes, rest):
        row = _pipe_row(pl, r, a.seq)
        same = (row["pipeline"], row["seq"])
        out["pipelines"] = [x for x in out["pipelines"] if (x["pipeline"], x.get("seq", a.seq)) != same]
        out["pipelines"].append(row)
        print(_line(f"{row['mesh']}, {pl.layers} layers, keep={pl.keep}", row))
    for (key, pl), r in zip(pubs, rest[len(pipes):]):
        row = published_row(key, pl, r)
        out["published"] = [x for x in out["published"] if (x["key"], x["pipeline"]) != (key, row["pipeline"])]
        out["published"].append(row)
        print(_published_line(row))
    by = {(r["layers"], r["seqs"]): r for r in out["layers"] if "compiled" in r}
    if grid and all(k in by for k in ((2, 1), (4, 1), (2, 2), (4, 2))):
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
