"""The small set ``bench/gpu.py`` runs first on an accelerator (``pytest -m gpu``): each test
uses one device (the first of ``jax.devices()``), so the same tests pass on CPU, where CI runs
them, and on a single GPU. Core layouts, bf16 precision, a pipeline, a checkpoint round trip
and the fast attention path against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk

pytestmark = pytest.mark.gpu

D, B = 32, 16


@pytest.fixture(scope="module")
def one():
    return jax.devices()[:1]


@pytest.fixture(autouse=True)
def exact_f32_matmuls():
    """f32 matmuls in full f32 on GPUs too (XLA:GPU may otherwise use TF32), so the 1e-5
    comparisons hold on every platform."""
    with jax.default_matmul_precision("float32"):
        yield


def mlp_loss(p, batch):
    h = jax.nn.gelu(sk.constrain(batch["x"], ("batch", None)) @ p["w1"])
    return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)


def params0():
    rng = np.random.default_rng(0)
    return {"w1": rng.normal(0, D ** -0.5, (D, 4 * D)).astype(np.float32),
            "w2": rng.normal(0, (4 * D) ** -0.5, (4 * D, D)).astype(np.float32)}


def batch0():
    rng = np.random.default_rng(1)
    return {"x": rng.normal(size=(B, D)).astype(np.float32), "y": rng.normal(size=(B, D)).astype(np.float32)}


@functools.lru_cache(maxsize=None)
def plain_adam(steps: int):
    """The same training as plain JAX + Optax on the default device: the oracle (one jitted
    step; computed once for the tests that compare with it)."""
    tx, p = optax.adam(1e-2), jax.tree.map(jnp.asarray, params0())

    @jax.jit
    def update(p, s, batch):
        loss, g = jax.value_and_grad(mlp_loss)(p, batch)
        u, s = tx.update(g, s, p)
        return loss, optax.apply_updates(p, u), s

    s, losses = tx.init(p), []
    for _ in range(steps):
        loss, p, s = update(p, s, batch0())
        losses.append(float(loss))
    return np.array(losses), jax.tree.map(np.asarray, p)


def run3(step):
    """Three steps from ``params0`` on ``batch0``: the final state, the losses, the last metrics."""
    state, losses = step.init(params0()), []
    for _ in range(3):
        state, m = step(state, batch0())
        losses.append(float(m["loss"]))
    return state, losses, m


@pytest.mark.parametrize("zero", [0, 3])
def test_one_device_layouts_match_plain_jax(one, zero):
    """fp32 on one device: the step equals plain JAX + Optax to 1e-5 (reduction order only)."""
    plan = sk.Plan(sk.make_mesh("data=1,tensor=1", devices=one), rules=[(r"w1", (None, "tensor")),
                   (r"w2", ("tensor", None)), (r".*", ())], axis_rules={"batch": "data"}, zero=zero)
    step = sk.train_step(plan, optax.adam(1e-2))(mlp_loss)
    state, losses, m = run3(step)
    ref_losses, ref = plain_adam(3)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k in ref:
        np.testing.assert_allclose(np.asarray(state.params[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6)


def test_bf16_precision_keeps_f32_master_and_tracks_fp32(one):
    """bf16 compute, f32 master weights and moments: losses within 2e-2 of fp32 (8 mantissa
    bits), params stay f32 and move."""
    plan = sk.Plan(sk.make_mesh("data=1", devices=one), rules=[(r".*", ())], axis_rules={"batch": "data"},
                   precision="bf16")
    step = sk.train_step(plan, optax.adam(1e-2))(mlp_loss)
    state, losses, m = run3(step)
    assert state.params["w1"].dtype == jnp.float32 and m["loss"].dtype == jnp.float32
    np.testing.assert_allclose(losses, plain_adam(3)[0], rtol=2e-2)
    assert not np.allclose(np.asarray(state.params["w1"]), params0()["w1"])


def test_pipeline_on_a_one_device_mesh(one):
    """sk.pipeline over a pipe axis of size 1 (4 microbatches) equals the layers run in a
    loop: output and gradients, fp32, to 1e-5."""
    mesh = sk.make_mesh("pipe=1", devices=one)
    w = jnp.asarray(np.random.default_rng(2).normal(0, D ** -0.5, (4, D, D)).astype(np.float32))
    x = jnp.asarray(batch0()["x"])

    def layer(w_l, h):
        return jnp.tanh(h @ w_l)

    def piped(w, x):
        return jnp.sum(sk.pipeline(layer, w, x, microbatches=4, mesh=mesh) ** 2)

    def looped(w, x):
        return jnp.sum(jax.lax.scan(lambda h, w_l: (layer(w_l, h), None), x, w)[0] ** 2)

    (a, ga), (b, gb) = (jax.jit(jax.value_and_grad(f))(w, x) for f in (piped, looped))
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=1e-5, atol=1e-6)


def test_checkpoint_round_trip(one, tmp_path):
    plan = sk.Plan(sk.make_mesh("data=1", devices=one), rules=[(r".*", ())], axis_rules={"batch": "data"})
    step = sk.train_step(plan, optax.adam(1e-2))(mlp_loss)
    state, _ = step(step.init(params0()), batch0())
    with sk.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, step=1, extra={"data": 7})
        ckpt.wait()
        back = ckpt.restore(plan, like=state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fast_attention_matches_reference(one):
    """The transformer recipe's attention as "auto" picks it here (cuDNN flash attention on a
    GPU in bf16; XLA's jax.nn.dot_product_attention on CPU, where "auto" itself is the
    reference) against the jnp reference in f32: causal, grouped-query (4 heads on 2 kv
    heads), output and q gradient within 2^-6 of the largest magnitude (bf16 roundings)."""
    from models.transformer.attention import attention_impl, causal_attention

    impl = attention_impl("auto", jnp.bfloat16)
    impl = "xla" if impl == "reference" else impl
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(kk, (2, 64, h, 64)), one[0]) for kk, h in zip(keys, (4, 2, 2)))

    def out_and_dq(impl, dt):
        def f(q):
            o = causal_attention(q.astype(dt), k.astype(dt), v.astype(dt), impl).astype(jnp.float32)
            return jnp.sum(o * jnp.cos(o)), o
        (_, o), dq = jax.value_and_grad(f, has_aux=True)(q)
        return o, dq

    fast = jax.jit(lambda: out_and_dq(impl, jnp.bfloat16))()
    ref = jax.jit(lambda: out_and_dq("reference", jnp.float32))()
    for a, r in zip(fast, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=0, atol=2.0 ** -6 * float(jnp.abs(r).max()))
