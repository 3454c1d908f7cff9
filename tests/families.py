"""Model families the cost model was not written against, for ``test_cost_families.py`` and
``bench/cost_model.py --families``: each is a plain function of a parameter pytree, written the
way a user would, with its own rules for each layout. Parameters are built with NumPy (no
jitted init), so building one costs nothing.

* ``mlp``: an embedding table looked up with ``jnp.take``, residual GELU MLP blocks held in a
  dict and run in a Python loop (unscanned), RMS-norm scales, an untied head.
* ``cnn``: NHWC convolutions (``lax.conv_general_dilated``), ReLU, a strided convolution, global
  average pooling and a dense classifier; tensor parallelism splits the channels.
* ``gpt``: a pre-LayerNorm causal transformer whose layers are stacked and run with
  ``lax.scan``, activations named through ``sk.constrain``, learned positions, tied
  embedding/head.
* ``moe``: an embedding lookup, then blocks of a dense GELU MLP and a mixture-of-experts MLP
  (a linear router, ``sk.moe`` top-2 dropless over 8 expert MLPs whose weights carry a
  leading expert dimension), Switch's load-balancing loss added to the objective; on the
  common layouts plus expert parallelism (``EXPERT_LAYOUTS``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import shardkit as sk

# One table for every layout: axes a mesh lacks are dropped, on purpose.
AXIS_RULES = sk.AxisRules({"batch": ("data", "fsdp", "expert"), "mlp": "tensor", "heads": "tensor", "channels": "tensor"},
                          drop_missing=True)


def _normal(rng, shape, scale=0.02):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---- a Python-loop MLP with an embedding lookup ------------------------------------------------

def mlp_params(d=128, h=512, vocab=256, blocks=4, seed=0):
    r = np.random.default_rng(seed)
    p = {"tok": _normal(r, (vocab, d)), "out": _normal(r, (d, vocab)), "final_norm": np.ones((d,), np.float32)}
    for i in range(blocks):
        p[f"block{i}"] = {"norm": np.ones((d,), np.float32), "up": _normal(r, (d, h)), "down": _normal(r, (h, d))}
    return p


def _last(v, x):
    """``v`` shaped to broadcast along the last axis of ``x`` (the tests forbid implicit rank
    promotion)."""
    return v.reshape((1,) * (x.ndim - 1) + (-1,))


def _rms(x, scale):
    return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * _last(scale, x)


def mlp_loss(p, batch):
    x = sk.constrain(jnp.take(p["tok"], batch["tokens"], axis=0), ("batch", None, None))
    for name in sorted(k for k in p if k.startswith("block")):
        b = p[name]
        h = sk.constrain(jax.nn.gelu(_rms(x, b["norm"]) @ b["up"]), ("batch", None, "mlp"))
        x = x + h @ b["down"]
    logits = _rms(x, p["final_norm"]) @ p["out"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))


def mlp_rules(tp: bool):
    return ([(r"up", (None, "tensor")), (r"down", ("tensor", None))] if tp else []) + [(r".*", ())]


def mlp_batch(rows=32, seq=16, vocab=256):
    r = np.random.default_rng(1)
    return {"tokens": r.integers(0, vocab, (rows, seq)).astype(np.int32),
            "labels": r.integers(0, vocab, (rows, seq)).astype(np.int32)}


# ---- a small CNN ------------------------------------------------------------------------------

def cnn_params(channels=(32, 64, 64), classes=10, seed=0):
    r = np.random.default_rng(seed)
    p, cin = {}, 3
    for i, c in enumerate(channels):
        p[f"conv{i}"] = {"w": _normal(r, (3, 3, cin, c), 0.1), "b": np.zeros((c,), np.float32)}
        cin = c
    p["head"] = {"w": _normal(r, (cin, classes)), "b": np.zeros((classes,), np.float32)}
    return p


def _conv(x, w, stride):
    return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def cnn_loss(p, batch):
    x = sk.constrain(batch["images"], ("batch", None, None, None))
    convs = sorted(k for k in p if k.startswith("conv"))
    for i, name in enumerate(convs):
        c = p[name]
        y = _conv(x, c["w"], 2 if i == 1 else 1)
        x = jax.nn.relu(y + _last(c["b"], y))
    feats = jnp.mean(x, axis=(1, 2))
    logits = feats @ p["head"]["w"]
    logits = logits + _last(p["head"]["b"], logits)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][:, None], -1))


def cnn_rules(tp: bool):
    # Megatron for convolutions: the first splits its output channels, the second its input.
    split = [(r"conv0/w", (None, None, None, "tensor")), (r"conv0/b", ("tensor",)),
             (r"conv1/w", (None, None, "tensor", None))]
    return (split if tp else []) + [(r".*", ())]


def cnn_batch(rows=32, size=16, classes=10):
    r = np.random.default_rng(2)
    return {"images": r.standard_normal((rows, size, size, 3)).astype(np.float32),
            "labels": r.integers(0, classes, (rows,)).astype(np.int32)}


# ---- a scanned GPT written against sk.constrain ------------------------------------------------

def gpt_params(d=64, heads=8, layers=3, vocab=128, seq=32, seed=0):
    r = np.random.default_rng(seed)
    L = layers
    return {"embed": _normal(r, (vocab, d)), "pos": _normal(r, (seq, d)),
            "layers": {"ln1": np.ones((L, d), np.float32), "qkv": _normal(r, (L, d, 3, heads, d // heads)),
                       "proj": _normal(r, (L, heads, d // heads, d)), "ln2": np.ones((L, d), np.float32),
                       "fc": _normal(r, (L, d, 4 * d)), "fc_out": _normal(r, (L, 4 * d, d))},
            "ln_f": np.ones((d,), np.float32)}


def _ln(x, g):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) * lax.rsqrt(var + 1e-5) * _last(g, x)


def gpt_loss(p, batch):
    tokens = batch["tokens"]
    T = tokens.shape[1]
    x = jnp.take(p["embed"], tokens, axis=0) + p["pos"][None, :T]
    x = sk.constrain(x, ("batch", None, None))
    mask = jnp.tril(jnp.ones((T, T), bool))

    def layer(x, w):
        h = _ln(x, w["ln1"])
        q, k, v = (sk.constrain(jnp.einsum("btd,dhk->bthk", h, w["qkv"][:, i]), ("batch", None, "heads", None))
                   for i in range(3))
        s = jnp.einsum("bthk,bshk->bhts", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        o = jnp.einsum("bhts,bshk->bthk", a, v)
        x = x + jnp.einsum("bthk,hkd->btd", o, w["proj"])
        f = sk.constrain(jax.nn.gelu(_ln(x, w["ln2"]) @ w["fc"]), ("batch", None, "mlp"))
        return x + f @ w["fc_out"], None

    x, _ = lax.scan(layer, x, p["layers"])
    logits = _ln(x, p["ln_f"]) @ p["embed"].T
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))


def gpt_rules(tp: bool):
    split = [(r"layers/qkv", (None, None, None, "tensor", None)), (r"layers/proj", (None, "tensor", None, None)),
             (r"layers/fc_out", (None, "tensor", None)), (r"layers/fc", (None, None, "tensor"))]
    return (split if tp else []) + [(r".*", ())]


def gpt_batch(rows=32, seq=32, vocab=128):
    r = np.random.default_rng(3)
    return {"tokens": r.integers(0, vocab, (rows, seq)).astype(np.int32),
            "labels": r.integers(0, vocab, (rows, seq)).astype(np.int32)}


# ---- a mixture-of-experts model (sk.moe) --------------------------------------------------------

def moe_params(d=64, h=128, experts=8, vocab=128, blocks=2, seed=0):
    r = np.random.default_rng(seed)
    p = {"tok": _normal(r, (vocab, d)), "out": _normal(r, (d, vocab))}
    for i in range(blocks):
        p[f"block{i}"] = {"up": _normal(r, (d, h)), "down": _normal(r, (h, d)), "router": _normal(r, (d, experts)),
                          "experts": {"w_in": _normal(r, (experts, d, h)), "w_out": _normal(r, (experts, h, d))}}
    return p


def _expert_mlp(w, x):
    return jax.nn.gelu(x @ w["w_in"]) @ w["w_out"]


def moe_loss(p, batch):
    x = sk.constrain(jnp.take(p["tok"], batch["tokens"], axis=0), ("batch", None, None))
    aux_loss = 0.0
    for name in sorted(k for k in p if k.startswith("block")):
        b = p[name]
        x = x + sk.constrain(jax.nn.gelu(x @ b["up"]), ("batch", None, "mlp")) @ b["down"]
        y, aux = sk.moe(x, x @ b["router"], _expert_mlp, b["experts"], top_k=2)
        x, aux_loss = x + y, aux_loss + aux["load_balance"]
    logp = jax.nn.log_softmax((x @ p["out"]).astype(jnp.float32))
    ce = -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))
    return ce + 0.01 * aux_loss


def moe_rules(tp: bool, ep: bool = False):
    split = [(r"up$", (None, "tensor")), (r"down$", ("tensor", None)),
             (r"experts/w_in", (None, None, "tensor")), (r"experts/w_out", (None, "tensor", None))] if tp else []
    experts = [(r"experts/w_in", ("expert", None, None)), (r"experts/w_out", ("expert", None, None))] if ep else []
    return split + experts + [(r".*", ())]


def moe_batch(rows=32, seq=16, vocab=128):
    r = np.random.default_rng(4)
    return {"tokens": r.integers(0, vocab, (rows, seq)).astype(np.int32),
            "labels": r.integers(0, vocab, (rows, seq)).astype(np.int32)}


FAMILIES = {
    "mlp": (mlp_params, mlp_loss, mlp_rules, mlp_batch),
    "cnn": (cnn_params, cnn_loss, cnn_rules, cnn_batch),
    "gpt": (gpt_params, gpt_loss, gpt_rules, gpt_batch),
    "moe": (moe_params, moe_loss, moe_rules, moe_batch),
}
# (mesh, ZeRO stage): DP, ZeRO-1/2/3, TP, a 3-axis hybrid.
LAYOUTS = [("data=8", 0), ("data=8", 1), ("data=8", 2), ("data=8", 3), ("tensor=8", 0),
           ("data=2,fsdp=2,tensor=2", 1)]
# Expert parallelism, for the MoE family only: the batch is split over ``expert`` too.
EXPERT_LAYOUTS = [("expert=8", 0), ("data=2,expert=4", 1), ("fsdp=2,expert=4", 3)]


def build(family: str, mesh: str, zero: int, *, rows: int | None = None, strict: bool = True, **sizes):
    """``(step, state, batch)`` for one family on one layout (fp32, AdamW); ``strict``: as
    ``sk.Plan``'s (False keeps leaves too small to shard replicated)."""
    import optax

    make_params, loss, rules, make_batch = FAMILIES[family]
    m = sk.make_mesh(mesh)
    if "expert" in m.axis_names:
        plan = sk.Plan(m, rules=rules("tensor" in m.axis_names, ep=True), axis_rules=AXIS_RULES, zero=zero,
                       strict=strict, batch_axes=tuple(a for a in m.axis_names if a in ("data", "fsdp", "expert")))
    else:
        plan = sk.Plan(m, rules=rules("tensor" in m.axis_names), axis_rules=AXIS_RULES, zero=zero,
                       strict=strict)
    step = sk.train_step(plan, optax.adamw(1e-3))(loss)
    state = step.init(make_params(**sizes))
    batch = make_batch(**({"rows": rows} if rows else {}))
    return step, state, batch
