"""Per-device temporaries of the kernels' programs, compiled deviceless for a target: an
attention layer's forward+backward (``sk.attention``, the target's kernel), a context-parallel
attention layer's (``sk.context_attention``'s ring, its blocks by the target's kernel beside
the blockwise online softmax) and the output projection + cross-entropy
(``sk.chunked_cross_entropy``), each beside the plain form.

    PYTHONPATH=. python bench/kernels_memory.py --target h100 tpu-v5p [--out-dir bench/results]

Runs under ``JAX_PLATFORMS=cpu`` (it sets it): the target's compile-only devices come from its
PJRT plugin (``shardkit.cost.compiled.targets.device_mesh``). For each program it reports the compiled
temporaries per device (``memory_analysis``), the kernels' custom calls in the compiled HLO,
the matmul flops per device it runs (``hlo.matmul_flops_from_hlo``: dots, and the flash
kernels' calls by the program reader's formula), and whether any buffer has a (T, T) score
shape (the ring's rows: whether any buffer has two dims of a ring block's query or key
length, ``T/c`` or ``T/2c``: a block's scores or mask). Prints a table; ``--json`` prints the rows as
one JSON line (what tests/test_kernels.py reads); ``--out-dir`` writes ``kernels_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
# libtpu's machine-wide lock (/tmp/libtpu_lockfile) is for processes that drive TPU chips; this
# one only compiles for compile-only devices, beside whatever else compiles (as in cost.compiled.child).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before JAX is imported: ``--help`` answers at once."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", nargs="+", default=["h100", "tpu-v5p"])
    p.add_argument("--mesh", default="data=8", help="mesh axes (data for the batch, tensor for heads)")
    p.add_argument("--what", nargs="+", default=["attention"], choices=["attention", "context", "loss"])
    p.add_argument("--context-mesh", default="data=2,context=4",
                   help="context: mesh axes (the sequence over context, the batch over data)")
    p.add_argument("--context-seq", type=int, default=None, help="context: the sequence (default --seq)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vocab", type=int, default=128256, help="loss: vocabulary (Llama 3's)")
    p.add_argument("--d-model", type=int, default=4096, help="loss: hidden width")
    p.add_argument("--loss-seq", type=int, default=8192, help="loss: tokens per sequence")
    p.add_argument("--loss-chunk", type=int, default=512, help="loss: positions per chunk")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON line")
    p.add_argument("--out-dir", default=None)
    return p.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import shardkit as sk  # noqa: E402
from shardkit.cost.compiled import targets  # noqa: E402
from shardkit.cost.compiled.hlo import matmul_flops_from_hlo  # noqa: E402

CUSTOM_CALLS = ("__gpu$xla.gpu.triton", "tpu_custom_call", "__cudnn$fmha")
MiB = 2 ** 20


def _compiled_row(name, fn, args, T=None, ring=None):
    compiled = jax.jit(fn).lower(*args).compile()
    text = compiled.as_text()
    row = {"program": name, "temporaries_mib": compiled.memory_analysis().temp_size_in_bytes / MiB,
           "custom_calls": {c: text.count(c) for c in CUSTOM_CALLS if c in text},
           "matmul_flops": matmul_flops_from_hlo(text)}
    if T is not None:  # any array with two trailing-ish dims of T (a score matrix)
        row["TxT_buffer"] = bool(re.search(rf"\[[0-9,]*\b{T},{T}\b", text))
    if ring is not None:  # a ring block's (queries, keys) pair: any two dims of its lengths
        n = "|".join(str(x) for x in ring)
        row["ring_block_buffer"] = bool(re.search(rf"\[[0-9,]*\b(?:{n}),[0-9,]*\b(?:{n})\b", text))
    return row


def attention_rows(mesh, a) -> list[dict]:
    """An attention layer's q/k/v gradients, batch over ``data``, heads over ``tensor``."""
    spec = P("data", None, "tensor" if "tensor" in mesh.shape else None, None)
    dtype = jnp.dtype(a.dtype)
    q = jax.ShapeDtypeStruct((a.batch, a.seq, a.heads, a.head_dim), dtype, sharding=NamedSharding(mesh, spec))
    kv = jax.ShapeDtypeStruct((a.batch, a.seq, a.kv_heads, a.head_dim), dtype, sharding=NamedSharding(mesh, spec))

    def grads(attend):
        loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))

    forms = {"plain (reference, f32 T×T scores)":
             lambda q, k, v: sk.attention(q, k, v, causal=True, implementation="reference")}
    if jax.sharding.get_abstract_mesh().abstract_device.platform == "gpu":
        forms["XLA (jax.nn, implementation='xla')"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla")
    forms["sk.attention (auto)"] = lambda q, k, v: sk.attention(q, k, v, causal=True, spec=spec)
    # The same inside a type-checked shard_map manual over data (as a pipeline stage is over
    # pipe): the kernel's own rules in a nested region (shardkit/kernels/manual_flash.py).
    inner = P(None, None, spec[2], None)
    forms["sk.attention (auto, in a shard_map manual over data)"] = lambda q, k, v: jax.shard_map(
        lambda q, k, v: sk.attention(q, k, v, causal=True, spec=inner), in_specs=spec, out_specs=spec,
        axis_names={"data"}, check_vma=True)(q, k, v)
    rows = []
    for name, attend in forms.items():
        row = _compiled_row(name, grads(attend), (q, kv, kv), T=a.seq)
        row["implementation"] = sk.kernels.attention_implementation(q.shape, dtype, causal=True).implementation \
            if "auto" in name else name.split(" ")[0]
        rows.append(row)
    return rows


def context_rows(mesh, a) -> list[dict]:
    """A causal CP attention layer's q/k/v gradients (zig-zag order, ring strategy): the
    sequence over ``context``, the batch over ``data`` and heads over ``tensor`` where the
    mesh has them (a plan names them, as the recipe's does)."""
    names, T = mesh.axis_names, a.context_seq or a.seq
    spec = P("data" if "data" in names else None, "context", "tensor" if "tensor" in names else None, None)
    dtype = jnp.dtype(a.dtype)
    q = jax.ShapeDtypeStruct((a.batch, T, a.heads, a.head_dim), dtype, sharding=NamedSharding(mesh, spec))
    kv = jax.ShapeDtypeStruct((a.batch, T, a.kv_heads, a.head_dim), dtype, sharding=NamedSharding(mesh, spec))
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules=sk.AxisRules({"batch": "data", "heads": "tensor"},
                                                                      drop_missing=True))
    c = dict(mesh.shape)["context"]
    rows = []
    for impl in ("blockwise", "auto"):
        def loss(q, k, v, impl=impl):
            with plan.active():
                o = sk.context_attention(q, k, v, causal=True, order="zigzag", implementation=impl)
            return jnp.sum(o.astype(jnp.float32))

        name = f"sk.context_attention ({impl}, ring over context={c})"
        row = _compiled_row(name, jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv), T=T, ring=(T // c, T // (2 * c)))
        row["implementation"] = impl if impl == "blockwise" else {"gpu": "triton", "tpu": "mosaic"}.get(
            jax.sharding.get_abstract_mesh().abstract_device.platform, "blockwise")
        rows.append(row)
    return rows


def loss_rows(mesh, a) -> list[dict]:
    """The head's loss gradients (hidden states and output matrix): sequences over ``data``,
    the vocabulary over ``tensor`` where the mesh has it."""
    dtype = jnp.dtype(a.dtype)
    vocab = "tensor" if "tensor" in mesh.shape else None
    x = jax.ShapeDtypeStruct((a.batch, a.loss_seq, a.d_model), dtype, sharding=NamedSharding(mesh, P("data")))
    w = jax.ShapeDtypeStruct((a.vocab, a.d_model), dtype, sharding=NamedSharding(mesh, P(vocab)))
    t = jax.ShapeDtypeStruct((a.batch, a.loss_seq), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    forms = {"plain (whole f32 logits)": sk.kernels.reference_cross_entropy,
             f"sk.chunked_cross_entropy (chunk {a.loss_chunk})":
             lambda x, w, t: sk.chunked_cross_entropy(x, w, t, chunk=a.loss_chunk)}
    return [_compiled_row(name, jax.grad(fn, argnums=(0, 1)), (x, w, t)) for name, fn in forms.items()]


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    a.kv_heads = a.kv_heads or a.heads
    rows = []
    for name in a.target:
        for what in a.what:
            spec = a.context_mesh if what == "context" else a.mesh
            mesh, _ = targets.device_mesh(targets.get(name), sk.parse_mesh_spec(spec))
            with jax.set_mesh(mesh):
                for row in {"attention": attention_rows, "context": context_rows, "loss": loss_rows}[what](mesh, a):
                    rows.append({"target": name, "mesh": spec, "what": what, **row})
    if a.json:
        print(json.dumps(rows))
    else:
        print("| target | what | program | temporaries/device (MiB) | matmul GFLOP/device | custom calls "
              "| (T,T) buffer | ring block buffer |\n|---|---|---|---:|---:|---|---|---|")
        for r in rows:
            calls = ", ".join(f"{k}×{v}" for k, v in r["custom_calls"].items()) or "none"
            print(f"| {r['target']} | {r['what']} | {r['program']} | {r['temporaries_mib']:,.1f} | {r['matmul_flops'] / 1e9:,.2f} | {calls} "
                  f"| {'yes' if r.get('TxT_buffer') else 'no'} "
                  f"| {'–' if 'ring_block_buffer' not in r else 'yes' if r['ring_block_buffer'] else 'no'} |")
    if a.out_dir:
        out = pathlib.Path(a.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels_memory.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
