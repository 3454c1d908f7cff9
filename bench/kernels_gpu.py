"""``sk.attention`` on one real GPU: its kernels against the plain form (forward and gradients)
and timed against XLA's attention.

    PYTHONPATH=. python bench/kernels_gpu.py --out-dir bench/results      # one GPU, < 2 min on an H200
    PYTHONPATH=. python bench/kernels_gpu.py --dry-run --out-dir /tmp/k   # the same code on CPU, tiny

1. Accuracy (B=1, T=--check-seq, causal, GQA --heads/--kv-heads): for bf16 and fp32 inputs,
   each implementation's output and q/k/v gradients against ``reference`` computed in fp32
   on the same (rounded) inputs: the largest absolute error. cuDNN has no fp32 kernel (its
   fp32 rows say so); ``auto`` is what ``sk.attention`` picks on this device.
2. Speed (bf16, B=--batch, T in --seqs): forward+backward of each implementation, median of
   --iters timed calls after a warm-up, and the ratio to XLA's
   (``jax.nn.dot_product_attention(implementation="xla")``, which holds the (T, T) scores).

3. Grouped matmul (``--sections grouped``): ``sk.kernels.grouped_matmul`` (the Mosaic GPU grouped
   GEMM on a real GPU; never yet run on one) against ``lax.ragged_dot`` in f32 on the same bf16
   inputs, forward and both gradients, and both timed.
4. Loss (``--sections loss``): ``sk.chunked_cross_entropy`` against the whole-logits form at
   Llama 3's vocabulary: loss and gradients against an f32 reference, temporaries, time.

An implementation that fails is recorded with its error and the rest go on; results are
written after each section (``kernels_gpu.json`` and ``kernels_gpu.md``; a dry run:
``kernels_gpu-dry-run.*``), so a lease that ends mid-run keeps what was measured. A dry run
has no GPU kernels: it runs the xla, blockwise and reference forms at tiny sizes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before JAX is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (xla, blockwise, reference)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--check-seq", type=int, default=2048)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sections", nargs="+", default=["accuracy", "timing", "grouped", "loss"],
                   choices=["accuracy", "timing", "grouped", "loss"])
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import shardkit as sk  # noqa: E402

GPU_IMPLS = ("auto", "cudnn", "triton", "blockwise")


def make_qkv(B, T, H, K, Q, dtype, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, T, H, Q), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, K, Q), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, K, Q), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (B, T, H, Q), jnp.float32).astype(dtype)
    return q, k, v, do


def attend_fn(impl):
    if impl == "xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return lambda q, k, v: sk.attention(q, k, v, causal=True, implementation=impl)


def fwd_bwd(impl):
    attend = attend_fn(impl)

    def f(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))

    return jax.jit(f)


def accuracy(a, impls) -> list[dict]:
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        q, k, v, do = make_qkv(1, a.check_seq, a.heads, a.kv_heads, a.head_dim, dtype)
        up = [x.astype(jnp.float32) for x in (q, k, v, do)]
        want = fwd_bwd("reference")(*up)
        for impl in impls:
            row = {"dtype": jnp.dtype(dtype).name, "implementation": impl}
            if impl == "cudnn" and dtype == jnp.float32:
                rows.append({**row, "error": "cuDNN has no fp32 kernel"})
                continue
            try:
                if impl == "auto":
                    row["picks"] = sk.kernels.attention_implementation(q.shape, dtype, causal=True).implementation
                got = fwd_bwd(impl)(q, k, v, do)
                errs = [float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) for g, w in zip(got, want)]
                row.update(zip(("out", "dq", "dk", "dv"), errs))
                row["scale"] = float(jnp.max(jnp.abs(want[0])))
            except Exception as err:  # noqa: BLE001 — recorded; the others go on
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rows.append(row)
    return rows


def _timed(fn, *args, iters: int) -> float:
    """Median milliseconds of ``iters`` calls of ``fn`` after one compile + warm-up call."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def timing(a, impls) -> list[dict]:
    rows = []
    for T in a.seqs:
        q, k, v, do = make_qkv(a.batch, T, a.heads, a.kv_heads, a.head_dim, jnp.bfloat16)
        base = None
        for impl in ("xla",) + tuple(impls):
            row = {"seq": T, "batch": a.batch, "implementation": impl}
            try:
                row["ms"] = _timed(fwd_bwd(impl), q, k, v, do, iters=a.iters)
                base = row["ms"] if impl == "xla" else base
                row["vs_xla"] = base / row["ms"] if base else None
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            rows.append(row)
    return rows


def _temp_mib(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def grouped(a, _impls) -> list[dict]:
    """``sk.kernels.grouped_matmul`` (the Mosaic GPU grouped GEMM on a real GPU) against
    ``lax.ragged_dot`` in f32 on the same bf16 inputs (forward, input and weight gradients),
    and both timed (XLA:GPU expands ``ragged_dot`` to a masked product over every group)."""
    M, K, N, G = (256, 128, 256, 4) if a.dry_run else (8192, 1024, 4096, 64)
    ks = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (G, K, N), jnp.float32) / K ** 0.5).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (M, N), jnp.float32).astype(jnp.bfloat16)
    cuts = jnp.sort(jax.random.randint(ks[3], (G - 1,), 0, M))
    sizes = jnp.diff(jnp.concatenate([jnp.zeros(1, cuts.dtype), cuts, jnp.full(1, M, cuts.dtype)])).astype(jnp.int32)

    def fwd_bwd(dot):
        def f(x, w, dy):
            y, vjp = jax.vjp(lambda x, w: dot(x, w, sizes), x, w)
            return (y, *vjp(dy))
        return jax.jit(f)

    ref = fwd_bwd(lambda x, w, g: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32))
    want = ref(*(t.astype(jnp.float32) for t in (x, w, dy)))
    row = {"M": M, "K": K, "N": N, "groups": G,
           "kernel": sk.kernels.grouped.grouped_kernel(x, w)[0]}
    try:
        got = fwd_bwd(sk.kernels.grouped_matmul)(x, w, dy)
        for name, g_, w_ in zip(("y", "dx", "dw"), got, want):
            row[name] = float(jnp.max(jnp.abs(g_.astype(jnp.float32) - w_)))
            row[name + "_scale"] = float(jnp.max(jnp.abs(w_)))
        row["kernel_ms"] = _timed(fwd_bwd(sk.kernels.grouped_matmul), x, w, dy, iters=a.iters)
    except Exception as err:  # noqa: BLE001 — recorded beside the reference's time
        row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
    row["ragged_dot_ms"] = _timed(fwd_bwd(jax.lax.ragged_dot), x, w, dy, iters=a.iters)
    row["routed_tflop"] = 3 * 2 * M * K * N / 1e12  # forward + two gradients, the routed rows only
    return [row]


def loss(a, _impls) -> list[dict]:
    """``sk.chunked_cross_entropy`` against the whole-logits form: loss and gradients (x, w)
    against an f32 reference on the same bf16 inputs, temporaries and time of each."""
    B, T, D, V = (2, 128, 64, 512) if a.dry_run else (4, 4096, 4096, 128256)
    ks = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(ks[0], (B, T, D), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (V, D), jnp.float32) / D ** 0.5).astype(jnp.bfloat16)
    t = jax.random.randint(ks[2], (B, T), 0, V)
    grads = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))  # noqa: E731
    want = grads(sk.kernels.reference_cross_entropy)(x.astype(jnp.float32), w.astype(jnp.float32), t)
    rows = []
    for name, fn in (("plain (bf16 in, f32 logits)", sk.kernels.reference_cross_entropy),
                     ("chunked (512)", sk.kernels.chunked_cross_entropy)):
        row = {"B": B, "T": T, "D": D, "V": V, "form": name}
        try:
            g = grads(fn)
            (val, (dx, dw)) = g(x, w, t)
            row["loss_err"] = float(abs(val - want[0]))
            row["dx"] = float(jnp.max(jnp.abs(dx.astype(jnp.float32) - want[1][0])))
            row["dw"] = float(jnp.max(jnp.abs(dw.astype(jnp.float32) - want[1][1])))
            row["temp_mib"] = _temp_mib(g, x, w, t)
            row["ms"] = _timed(g, x, w, t, iters=a.iters)
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {str(err)[:400]}"
        rows.append(row)
    return rows


def table(result) -> str:
    lines = [f"# sk.attention on {result['device']}{' (DRY RUN)' if result['dry_run'] else ''}", "",
             "| dtype | implementation | max abs error out / dq / dk / dv (|out| max) |", "|---|---|---|"]
    for r in result.get("accuracy", []):
        name = r["implementation"] + (f" (→ {r['picks']})" if "picks" in r else "")
        cell = r.get("error") or (f"{r['out']:.2e} / {r['dq']:.2e} / {r['dk']:.2e} / {r['dv']:.2e} "
                                  f"({r['scale']:.2f})")
        lines.append(f"| {r['dtype']} | {name} | {cell} |")
    lines += ["", "| T | batch | implementation | fwd+bwd ms (bf16) | speed vs XLA |", "|---:|---:|---|---:|---:|"]
    for r in result.get("timing", []):
        if "error" in r:
            cell = f"{r['error'][:120]} | –"
        else:
            cell = f"{r['ms']:.2f} | " + (f"{r['vs_xla']:.2f}x" if r.get("vs_xla") else "–")
        lines.append(f"| {r['seq']} | {r['batch']} | {r['implementation']} | {cell} |")
    for r in result.get("grouped", []):
        lines += ["", f"Grouped matmul, {r['M']} rows x {r['groups']} groups, {r['K']}->{r['N']}, bf16, "
                      f"kernel {r['kernel']}:"]
        lines.append(r.get("error") or (f"max abs error y {r['y']:.2e} (of {r['y_scale']:.2f}), dx {r['dx']:.2e} "
                                        f"(of {r['dx_scale']:.2f}), dw {r['dw']:.2e} (of {r['dw_scale']:.2f}); "
                                        f"fwd+bwd {r['kernel_ms']:.2f} ms"))
        lines.append(f"lax.ragged_dot fwd+bwd {r['ragged_dot_ms']:.2f} ms ({r['routed_tflop']:.2f} routed TFLOP)")
    if result.get("loss"):
        lines += ["", "| loss form | B x T x D, V | loss err | dx err | dw err | temporaries MiB | ms |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in result["loss"]:
            shape = f"{r['B']}x{r['T']}x{r['D']}, {r['V']}"
            lines.append(f"| {r['form']} | {shape} | " + (r["error"][:150] if "error" in r else
                         f"{r['loss_err']:.2e} | {r['dx']:.2e} | {r['dw']:.2e} | {r['temp_mib']:.0f} | {r['ms']:.2f}") + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    a = parse_args(argv)
    impls = GPU_IMPLS
    if a.dry_run:
        a.seqs, a.batch, a.heads, a.kv_heads, a.head_dim, a.check_seq, a.iters = [256], 1, 2, 1, 32, 128, 2
        impls = ("auto", "blockwise")
    dev = jax.devices()[0]
    result = {"device": f"{dev.device_kind} ({dev.platform})", "jax": jax.__version__, "dry_run": a.dry_run,
              "args": vars(a)}
    out = pathlib.Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "kernels_gpu-dry-run" if a.dry_run else "kernels_gpu"

    def write():
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(table(result))

    for section, fn in (("accuracy", accuracy), ("timing", timing), ("grouped", grouped), ("loss", loss)):
        if section not in a.sections:
            continue
        try:
            result[section] = fn(a, impls)
        except Exception:  # noqa: BLE001 — keep what the other section measured
            result[f"{section}_error"] = traceback.format_exc()[-2000:]
        write()
    print(table(result))
    return result


if __name__ == "__main__":
    main()
