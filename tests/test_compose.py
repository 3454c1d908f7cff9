"""The axis-owning building blocks inside a whole train step: a small model whose layers call
``sk.context_attention`` and ``sk.moe`` trained with microbatches and ZeRO on meshes that split
the sequence or the experts, against the same step on one device (fp32, 1e-5 relative).

test_context.py and test_moe.py check the blocks' values and gradients on their own; this file
checks what only a train step does to them: microbatch accumulation (each microbatch routes and
attends on its own rows), ZeRO-sharded optimizer state and parameters gathered for the block,
and the batch placed by the plan's batch shardings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk

B, T, D, H, E, F = 16, 16, 16, 2, 4, 32
STEPS = 3


def init(seed=0):
    r = np.random.default_rng(seed)
    w = lambda *s: (r.normal(size=s) * 0.2).astype(np.float32)  # noqa: E731
    return {"attn": {"q": w(D, D), "k": w(D, D), "v": w(D, D), "o": w(D, D)},
            "router": w(D, E), "experts": {"w1": w(E, D, F), "w2": w(E, F, D)}}


def batches():
    r = np.random.default_rng(1)
    for _ in range(STEPS):
        yield {"x": r.normal(size=(B, T, D)).astype(np.float32),
               "y": r.normal(size=(B, T, D)).astype(np.float32)}


def expert(p, h_RxD):
    return jnp.tanh(h_RxD @ p["w1"]) @ p["w2"]


def loss(params, batch):
    x_BxTxD = sk.constrain(batch["x"], ("batch", "context", None))
    a = params["attn"]
    heads = lambda t: t.reshape(*t.shape[:2], H, D // H)  # noqa: E731  (B, T, H, D/H)
    o = sk.context_attention(heads(x_BxTxD @ a["q"]), heads(x_BxTxD @ a["k"]), heads(x_BxTxD @ a["v"]),
                             causal=True, load_balance=False)
    h_BxTxD = x_BxTxD + o.reshape(x_BxTxD.shape) @ a["o"]
    y_BxTxD, aux = sk.moe(h_BxTxD, h_BxTxD @ params["router"], expert, params["experts"], top_k=2)
    out = sk.constrain(h_BxTxD + y_BxTxD, ("batch", "context", None))
    return jnp.mean((out - batch["y"]) ** 2) + 0.01 * aux["load_balance"]


def train(mesh_spec, zero, devices=None):
    mesh = sk.make_mesh(mesh_spec, devices=devices)
    batch_axes = tuple(a for a in ("data", "expert") if a in mesh.shape)
    rules = [(r"experts/", ("expert",))] if "expert" in mesh.shape else []
    plan = sk.Plan(mesh, rules=rules + [(r".*", ())], zero=zero,
                   axis_rules=sk.AxisRules({"batch": batch_axes, "context": "context"}, drop_missing=True),
                   batch_axes=batch_axes)
    step = sk.train_step(plan, optax.adam(1e-2), microbatches=2)(loss)
    state = step.init(init())
    losses = []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.tree.map(np.asarray, state.params)


@pytest.fixture(scope="module")
def one_device():
    return train("data=1", 0, devices=jax.devices()[:1])


@pytest.mark.parametrize("mesh_spec,zero", [("data=2,context=4", 1), ("data=2,expert=4", 3),
                                            ("context=2,expert=4", 2)])
def test_blocks_under_microbatches_and_zero_equal_one_device(mesh_spec, zero, one_device):
    want_losses, want_params = one_device
    losses, params = train(mesh_spec, zero)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
