"""The analytic estimate of steps that run ``sk.attention``'s Pallas flash kernels and the
chunked loss, against the target compiler's program (issue 35): ``explain()``'s rows for
temporaries, peak and flops, compiled deviceless by XLA:GPU (8 H100s) and XLA:TPU (v5p-8).

Two models: the transformer recipe (``models/transformer``, which the reader's flash rules
were written against), a few layers of its ``1b``; and a GPT-2-style block written here
(LayerNorm, GELU MLP of 4d, learned positions, tied head, f32, 16 heads of 64: Triton's f32
kernel at head_dim 128 asks more shared memory than an H100 has), which calls ``sk.attention``
directly — a model the estimate was not fitted to. Each with the flash kernel
(``attention="auto"``) and with the plain (T, T) form, one sequence per device on ``data=8``.

    python bench/kernel_cost.py [--target h100 tpu-v5p] [--layers 2] [--models recipe gpt] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _gpt(attention: str, *, d=1024, heads=16, layers=2, vocab=8192, seq=2048):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    import shardkit as sk

    def loss(p, batch):
        tokens = batch["tokens"]
        x = jnp.take(p["embed"], tokens, axis=0) + p["pos"][None]
        x = sk.constrain(x, ("batch", None, None))

        def ln(x, g):
            mu = jnp.mean(x, -1, keepdims=True)
            return (x - mu) * lax.rsqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True) + 1e-5) * g[None, None]

        def layer(x, w):
            h = ln(x, w["ln1"])
            q, k, v = (jnp.einsum("btd,dhk->bthk", h, w["qkv"][:, i]) for i in range(3))
            o = sk.attention(q, k, v, causal=True, implementation=attention)
            x = x + jnp.einsum("bthk,hkd->btd", o, w["proj"])
            return x + jax.nn.gelu(ln(x, w["ln2"]) @ w["fc"]) @ w["fc_out"], None

        x, _ = lax.scan(layer, x, p["layers"])
        logp = jax.nn.log_softmax((ln(x, p["ln_f"]) @ p["embed"].T).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))

    s = lambda *shape: jax.ShapeDtypeStruct(shape, np.float32)  # noqa: E731
    L, Q = layers, d // heads
    params = {"embed": s(vocab, d), "pos": s(seq, d), "ln_f": s(d),
              "layers": {"ln1": s(L, d), "qkv": s(L, d, 3, heads, Q), "proj": s(L, heads, Q, d),
                         "ln2": s(L, d), "fc": s(L, d, 4 * d), "fc_out": s(L, 4 * d, d)}}
    return loss, params, seq, vocab


def jobs(target: str, layers: int, models=("recipe", "gpt")):
    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    out = []
    base = SIZES["1b"].replace(layers=layers)
    for attention, chunk in (("auto", -1), ("reference", 0)) if "recipe" in models else ():
        step, state, batch = abstract_step(base.replace(attention=attention, loss_chunk=chunk), "data=8",
                                           global_batch=8, target=target)
        out.append((f"recipe 1b x{layers} layers, attention={attention}, loss_chunk={chunk}", step, state, batch))
    for attention in ("auto", "reference") if "gpt" in models else ():
        out.append((f"GPT-2-style x{layers} (f32), sk.attention {attention}",
                    *gpt_step(target, attention, layers=layers)))
    return out


def gpt_step(target: str, attention: str, **sizes):
    """``(step, abstract state, abstract batch)`` of the GPT-2-style block (``_gpt``'s sizes)
    on ``data=8`` devices of ``target``, one sequence a device, AdamW."""
    import jax
    import numpy as np
    import optax

    import shardkit as sk

    loss, params, seq, vocab = _gpt(attention, **sizes)
    amesh = sk.cost.abstract_mesh("data=8", target=target)
    plan = sk.Plan(amesh, rules=[(r".*", ())], axis_rules=sk.AxisRules({"batch": "data", "heads": "tensor"},
                                                                      drop_missing=True))
    step = sk.train_step(plan, optax.adamw(1e-3))(loss)
    state = step.abstract_state(lambda: jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), params))
    batch = {k: jax.ShapeDtypeStruct((8, seq), np.int32) for k in ("tokens", "labels")}
    return step, state, batch


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", nargs="+", default=["h100", "tpu-v5p"])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["recipe", "gpt"], choices=["recipe", "gpt"])
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    import shardkit as sk

    rows = []
    for target in a.target:
        named = jobs(target, a.layers, a.models)
        reports = sk.cost.simulate_many([(st, s, b, "data=8") for _, st, s, b in named], target=target,
                                        estimate=True, timeout=1800)
        for (name, *_), r in zip(named, reports):
            if isinstance(r, Exception):
                rows.append({"target": target, "model": name, "error": str(r)[:300]})
                continue
            for c in r.comparison():
                if c["quantity"] in ("memory/temporaries", "memory/peak", "flops"):
                    rows.append({"target": target, "model": name, **c})
    if a.json:
        print(json.dumps(rows))
        return rows
    for r in rows:
        if "error" in r:
            print(f"{r['target']:8} {r['model']:55} ERROR {r['error']}")
            continue
        unit = 2**30 if r["quantity"].startswith("memory") else 1e12
        print(f"{r['target']:8} {r['model']:55} {r['quantity']:19} est {r['estimate'] / unit:9.3f} compiled "
              f"{r['compiled'] / unit:9.3f} ratio {r['estimate'] / max(r['compiled'], 1):5.2f} "
              f"band {r['band']} caveat {r['caveat']}")
    return rows


if __name__ == "__main__":
    main()
