"""train_step under every layout vs a 1-device run, ZeRO memory, models, precision, errors.

Tolerances: fp32 layouts match the 1-device run to a relative 1e-5 in every step's loss (the
only differences are the order of floating-point reductions); bf16 compute matches the fp32
1-device run to a relative 2e-2 (bf16 has 8 mantissa bits).
"""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk

D, F, B, STEPS = 16, 64, 32, 10
# One table for every mesh of the sweep: axes a mesh lacks are dropped, on purpose.
AXIS_RULES = sk.AxisRules({"batch": ("data", "fsdp"), "embed": "fsdp", "mlp": "tensor"}, drop_missing=True)


def init_params(key=jax.random.key(0)):
    k1, k2, k3 = jax.random.split(key, 3)
    return {"w1": jax.random.normal(k1, (D, F)) / math.sqrt(D), "b1": jnp.zeros((F,)),
            "w2": jax.random.normal(k2, (F, D)) / math.sqrt(F), "b2": 0.01 * jax.random.normal(k3, (D,))}


def rules_for(mesh):
    """Megatron MLP: w1 split by columns, w2 by rows (over 'tensor'), FSDP on the embed dim."""
    ax = lambda a: a if a in mesh.axis_names else None  # noqa: E731
    return [(r"w1", (ax("fsdp"), ax("tensor"))), (r"b1", (ax("tensor"),)),
            (r"w2", (ax("tensor"), ax("fsdp"))), (r".*", ())]


def mlp_loss(p, batch):
    x = sk.constrain(batch["x"], ("batch", None))
    h = jax.nn.gelu(sk.constrain(x @ p["w1"], ("batch", "mlp")) + p["b1"][None, :])
    y = sk.constrain(h @ p["w2"], ("batch", None)) + p["b2"][None, :]
    return jnp.mean((y - batch["y"]) ** 2)


def batches(n=STEPS, b=B):
    rng = np.random.RandomState(0)
    w = rng.randn(D, D).astype(np.float32) / 4
    for _ in range(n):
        x = rng.randn(b, D).astype(np.float32)
        yield {"x": x, "y": np.tanh(x @ w)}


def train(mesh_spec, zero=0, precision="fp32", microbatches=1, devices=None, clip_norm=None, opt=None):
    mesh = sk.make_mesh(mesh_spec, devices=devices)
    plan = sk.Plan(mesh, rules=rules_for(mesh), axis_rules=AXIS_RULES, zero=zero, precision=precision)
    step = sk.train_step(plan, opt or optax.adamw(1e-2), microbatches=microbatches, clip_norm=clip_norm)(mlp_loss)
    state = step.init(init_params)
    losses = []
    for batch in batches():
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return np.array(losses), state, step


@pytest.fixture(scope="module")
def reference():
    """The same training on one device (every mesh axis of size 1)."""
    losses, state, _ = train("data=1,fsdp=1,tensor=1", devices=jax.devices()[:1])
    return losses, jax.tree.map(np.asarray, state.params)


LAYOUTS = [
    ("data=8", 0), ("data=8", 1), ("data=8", 2), ("data=8", 3),
    ("data=2,tensor=4", 0), ("data=4,tensor=2", 1), ("fsdp=4,tensor=2", 3), ("data=2,fsdp=4", 3),
    ("data=2,fsdp=2,tensor=2", 0), ("data=2,fsdp=2,tensor=2", 2), ("data=2,fsdp=2,tensor=2", 3),
    # Issue 36: ZeRO's data axes beside fsdp on one dim, ZeRO-1 reducing into its shard.
    ("data=2,fsdp=2,tensor=2", 1), ("data=4,fsdp=2", 2), ("data=2,tensor=4", 1),
]


@pytest.mark.parametrize("mesh_spec,zero", LAYOUTS)
def test_layout_matches_one_device(reference, mesh_spec, zero):
    ref_losses, ref_params = reference
    losses, state, _ = train(mesh_spec, zero=zero)
    assert losses[-1] < 0.6 * losses[0]  # it trains
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, v in state.params.items():
        np.testing.assert_allclose(np.asarray(v), ref_params[k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mesh_spec,zero", [("data=2,fsdp=2,tensor=2", 3), ("data=8", 1)])
def test_bf16_compute_within_bound(reference, mesh_spec, zero):
    losses, state, _ = train(mesh_spec, zero=zero, precision="bf16")
    assert state.params["w1"].dtype == jnp.float32  # f32 masters
    np.testing.assert_allclose(losses, reference[0], rtol=2e-2)


@pytest.mark.parametrize("microbatches", [2, 4])
def test_microbatches_equal_single_batch(microbatches):
    one, _, _ = train("data=2,fsdp=2,tensor=2", zero=2)
    many, _, _ = train("data=2,fsdp=2,tensor=2", zero=2, microbatches=microbatches)
    np.testing.assert_allclose(many, one, rtol=1e-5)


def test_clipping_uses_the_global_norm_across_shards(reference):
    ref, _, _ = train("data=1,fsdp=1,tensor=1", devices=jax.devices()[:1], clip_norm=0.05, opt=optax.sgd(0.5))
    sharded, _, _ = train("fsdp=4,tensor=2", zero=3, clip_norm=0.05, opt=optax.sgd(0.5))
    np.testing.assert_allclose(sharded, ref, rtol=1e-5)
    unclipped, _, _ = train("data=1,fsdp=1,tensor=1", devices=jax.devices()[:1], opt=optax.sgd(0.5))
    assert not np.allclose(ref, unclipped)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_state_bytes_follow_the_formulas(zero, older_emitters_ahead_of_time):
    """Per-device persistent bytes with Adam in f32 (ZeRO paper, shardkit's f32 form):
    DP 4Ψ + 8Ψ, ZeRO-1/2 4Ψ + 8Ψ/N, ZeRO-3 (4Ψ + 8Ψ)/N."""
    n = 8
    plan = sk.Plan(sk.make_mesh(f"data={n}"), rules=[(r".*", ())], zero=zero)
    step = sk.train_step(plan, optax.adam(1e-3))(lambda p, b: jnp.sum(b["x"] @ p["w"]))
    state = step.init(lambda: {"w": jnp.ones((64, 32)), "v": jnp.ones((128,))})
    psi = 64 * 32 + 128
    report = step.explain(state, {"x": np.ones((8, 64), np.float32)})
    expected_params = 4 * psi / (n if zero == 3 else 1)
    expected_opt = 8 * psi / (n if zero >= 1 else 1)
    assert report.memory["params"] == expected_params
    assert report.memory["opt_state"] == expected_opt + 4  # + Adam's int32 step count
    assert report.memory["grads"] == 4 * psi / (n if zero >= 2 else 1)


def test_nnx_linen_and_pytree_models_train_identically():
    mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")
    p0 = init_params()

    class MLP(nnx.Module):
        def __init__(self):
            part = nnx.with_partitioning
            self.w1 = nnx.Param(p0["w1"], out_sharding=("embed", "mlp"))
            self.b1 = nnx.Param(p0["b1"], out_sharding=("mlp",))
            self.w2 = nnx.Param(p0["w2"], out_sharding=("mlp", "embed"))
            self.b2 = nnx.Param(p0["b2"])
            del part

        def __call__(self, x):
            h = jax.nn.gelu(sk.constrain(x @ self.w1[...], ("batch", "mlp")) + self.b1[...][None, :])
            return sk.constrain(h @ self.w2[...], ("batch", None)) + self.b2[...][None, :]

    class LinenMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            w1 = self.param("w1", nn.with_logical_partitioning(lambda *_: p0["w1"], ("embed", "mlp")))
            b1 = self.param("b1", lambda *_: p0["b1"])
            w2 = self.param("w2", nn.with_logical_partitioning(lambda *_: p0["w2"], ("mlp", "embed")))
            b2 = self.param("b2", lambda *_: p0["b2"])
            h = jax.nn.gelu(sk.constrain(x @ w1, ("batch", "mlp")) + b1[None, :])
            return sk.constrain(h @ w2, ("batch", None)) + b2[None, :]

    plan = sk.Plan(mesh, rules=[(r"b[12]", ()), (r"^b2", ())], axis_rules=AXIS_RULES, zero=3)

    def run(loss, init):
        step = sk.train_step(plan, optax.adamw(1e-2))(loss)
        state = step.init(init)
        out = []
        for batch in batches(5):
            state, m = step(state, batch)
            out.append(float(m["loss"]))
        return np.array(out), step, state

    with nnx.use_eager_sharding(False):
        nnx_losses, nnx_step, nnx_state = run(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2), MLP())
    variables = LinenMLP().init(jax.random.key(0), jnp.ones((1, D)))
    linen_losses, _, _ = run(lambda v, b: jnp.mean((LinenMLP().apply(v, b["x"]) - b["y"]) ** 2), variables)
    tree_plan = sk.Plan(mesh, rules=rules_for(mesh), axis_rules=AXIS_RULES, zero=3)
    step = sk.train_step(tree_plan, optax.adamw(1e-2))(mlp_loss)
    state = step.init(init_params)
    tree_losses = []
    for batch in batches(5):
        state, m = step(state, batch)
        tree_losses.append(float(m["loss"]))
    np.testing.assert_allclose(nnx_losses, tree_losses, rtol=1e-5)
    np.testing.assert_allclose(linen_losses, tree_losses, rtol=1e-5)
    # ZeRO-3: the data axes join the dim fsdp already splits, in the batch axes' order (one
    # reduce-scatter / all-gather over data x fsdp)
    assert nnx_state.params["w1"].sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), "tensor")
    assert isinstance(nnx_step.model(nnx_state), MLP)


def test_model_state_is_carried_through_the_step():
    """NNX BatchNorm statistics update inside the compiled step, and match one device."""
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(D, D, rngs=rngs)
            self.bn = nnx.BatchNorm(D, momentum=0.5, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    def loss(model, batch):
        model.train()
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    def run(mesh):
        plan = sk.Plan(mesh, rules=[(r".*", ())], zero=1)
        step = sk.train_step(plan, optax.sgd(0.1))(loss)
        state = step.init(lambda: Net(nnx.Rngs(0)))
        for batch in batches(3):
            state, _ = step(state, batch)
        return state

    one = run(sk.make_mesh("data=1", devices=jax.devices()[:1]))
    eight = run(sk.make_mesh("data=8"))
    mean = np.asarray(eight.model_state["bn"]["mean"])
    assert np.abs(mean).sum() > 0
    np.testing.assert_allclose(mean, np.asarray(one.model_state["bn"]["mean"]), rtol=1e-5, atol=1e-7)


def test_rng_is_passed_per_step():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())])
    seen = []

    def loss(p, batch, rng):
        noise = jax.random.normal(rng, ())
        return jnp.mean(batch["x"] @ p["w"]) * 0 + noise, noise

    step = sk.train_step(plan, optax.sgd(0.0))(loss)
    state = step.init({"w": jnp.ones((D, 1))})
    for batch in batches(3):
        state, m = step(state, batch)
        seen.append(float(m["aux"]))
    assert len(set(seen)) == 3


def test_fp16_loss_scaling_skips_nonfinite_steps():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], precision="fp16")

    def loss(p, batch):
        return jnp.mean((batch["x"] @ p["w"] - batch["y"]) ** 2) * batch["scale"][0]

    step = sk.train_step(plan, optax.sgd(1e-2))(loss)
    state = step.init({"w": jnp.zeros((D, D))})
    good = next(batches(1))
    state, m = step(state, {**good, "scale": np.ones((B,), np.float32)})
    assert bool(m["finite"]) and float(m["loss_scale"]) == 2.0 ** 15
    before = np.asarray(state.params["w"])
    state, m = step(state, {**good, "scale": np.full((B,), np.inf, np.float32)})
    assert not bool(m["finite"]) and int(state.skipped) == 1
    np.testing.assert_array_equal(np.asarray(state.params["w"]), before)
    assert float(state.loss_scale.scale) == 2.0 ** 14  # backed off
    assert state.params["w"].dtype == jnp.float32


def test_max_nonfinite_stops_one_step_late_with_a_good_state():
    """The streak is read a step late (no host sync on the step just queued): with
    max_nonfinite=2 the third call raises, and every skipped step left the params alone."""
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())])
    step = sk.train_step(plan, optax.sgd(0.1), max_nonfinite=2)(
        lambda p, b: jnp.mean(b["x"] @ p["w"]) / b["d"][0])
    state = step.init({"w": jnp.ones((D, 1))})
    bad = {"x": np.ones((8, D), np.float32), "d": np.zeros((8,), np.float32)}
    state, m = step(state, bad)
    state, m = step(state, bad)  # the second skip: seen by the next call
    assert int(m["nonfinite_streak"]) == 2
    with pytest.raises(sk.NonFiniteError, match="2 consecutive steps") as err:
        step(state, bad)
    np.testing.assert_array_equal(np.asarray(err.value.state.params["w"]), np.ones((D, 1)))
    assert int(err.value.state.skipped) == 3
    # A finite step resets the streak, and the next call then sees nothing to raise about.
    state, m = step(err.value.state, {**bad, "d": np.ones((8,), np.float32)})
    state, m = step(state, {**bad, "d": np.ones((8,), np.float32)})
    assert int(m["nonfinite_streak"]) == 0 and not np.allclose(np.asarray(state.params["w"]), 1.0)


def test_max_nonfinite_does_not_wait_for_the_step():
    """A call returns while its step still runs (~0.5 s of matmuls on one CPU device): its
    outputs are not ready yet. A check reading this step's streak would have waited."""
    plan = sk.Plan(sk.make_mesh("data=1", devices=jax.devices()[:1]), rules=[(r".*", ())])

    def loss(p, b):
        busy = jax.lax.fori_loop(0, 12, lambda i, a: jnp.tanh(a @ a), b["m"][0])
        return jnp.mean(b["x"] @ p["w"]) + 0.0 * jnp.sum(jax.lax.stop_gradient(busy))

    step = sk.train_step(plan, optax.sgd(0.1), max_nonfinite=1)(loss)
    state = step.init({"w": jnp.ones((D, 1))})
    batch = {"x": np.ones((1, D), np.float32), "m": np.full((1, 1024, 1024), 1e-3, np.float32)}
    batch = step.place_batch(batch)[0]
    state, m = step(state, batch)  # compiles and runs once
    jax.block_until_ready(m)
    state, m = step(state, batch)
    assert not m["loss"].is_ready()
    jax.block_until_ready(m)

def test_bad_inputs_raise_named_errors():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r"w", ())])
    with pytest.raises(sk.ShardingError, match=r"1 parameter\(s\) have no sharding rule:\n  - b \(4,\)"):
        sk.train_step(plan, optax.sgd(0.1))(lambda p, b: 0.0).init({"w": jnp.ones(4), "b": jnp.ones(4)})
    step = sk.train_step(plan, optax.sgd(0.1), microbatches=2)(lambda p, b: jnp.mean(b["x"] * p["w"]))
    with pytest.raises(RuntimeError, match="call step.init"):
        step(None, {"x": np.ones((16, 4))})
    state = step.init({"w": jnp.ones(4)})
    with pytest.raises(sk.ShardingError, match=r"leading dim 8 is not divisible by 16 \(batch axes data=8 x 2 microbatches\)"):
        step(state, {"x": np.ones((8, 4), np.float32)})
    with pytest.raises(ValueError, match="microbatches must be a positive integer"):
        sk.train_step(plan, optax.sgd(0.1), microbatches=0)
    vector_loss = sk.train_step(plan, optax.sgd(0.1))(lambda p, b: b["x"] @ p["w"])
    with pytest.raises(ValueError, match=r"must return a scalar loss, got shape \(8,\)"):
        vector_loss(vector_loss.init({"w": jnp.ones(4)}), {"x": np.ones((8, 4), np.float32)})


@pytest.mark.parametrize("mesh_spec,zero,precision,microbatches", [
    ("data=2,fsdp=2,tensor=2", 3, "bf16", 2),
    ("data=2,fsdp=2,tensor=2", 1, "fp32", 4),
    ("data=2,fsdp=2,tensor=2", 3, "fp32", 4),
    ("data=4,tensor=2", 1, "bf16", 2),
])
def test_hybrid_layouts_have_no_involuntary_rematerialization(capfd, mesh_spec, zero, precision, microbatches,
                                                              older_emitters_ahead_of_time):
    # the SPMD partitioner's warning, before XLA:CPU's emitters
    mesh = sk.make_mesh(mesh_spec)
    plan = sk.Plan(mesh, rules=rules_for(mesh), axis_rules=AXIS_RULES, zero=zero, precision=precision)
    step = sk.train_step(plan, optax.adamw(1e-2), microbatches=microbatches)(mlp_loss)
    state = step.init(init_params)
    capfd.readouterr()
    step.lower(state, next(batches(1))).compile()
    err = capfd.readouterr().err
    assert "Involuntary full rematerialization" not in err, err[-2000:]


def test_sk_jit_infers_shardings_from_the_plan():
    mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")
    plan = sk.Plan(mesh, rules=rules_for(mesh), axis_rules=AXIS_RULES, zero=3)
    tx = optax.sgd(0.1)

    def my_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    f = sk.jit(my_step, plan, args=("params", "opt_state", "batch"), out=("params", "opt_state", "replicated"))
    params = init_params()
    opt_state = tx.init(params)
    batch = next(batches(1))
    new_params, _, loss = f(params, opt_state, {k: jnp.asarray(v) for k, v in batch.items()})
    assert new_params["w1"].sharding.spec == plan.param_specs(params)["w1"]
    ref = mlp_loss(params, batch)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-5)
    with pytest.raises(ValueError, match="unknown sharding role 'weights'"):
        sk.jit(my_step, plan, args=("weights", "opt_state", "batch"))


def test_abstract_state_matches_init_without_allocating():
    mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")
    plan = sk.Plan(mesh, rules=rules_for(mesh), axis_rules=AXIS_RULES, zero=3)
    step = sk.train_step(plan, optax.adamw(1e-2))(mlp_loss)
    abstract = step.abstract_state(init_params)
    real = step.init(init_params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    same = jax.tree.map(lambda a, r: (a.shape, a.dtype, a.sharding.spec) == (r.shape, r.dtype, r.sharding.spec), abstract, real)
    assert all(jax.tree.leaves(same))


def test_fp16_scale_grows_after_growth_interval_finite_steps():
    prec = sk.Precision(compute=jnp.float16, loss_scaling=True, init_scale=8.0, growth_interval=2)
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], precision=prec)
    step = sk.train_step(plan, optax.sgd(1e-2))(lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2))
    state = step.init({"w": jnp.zeros((D, D))})
    scales = []
    for batch in batches(4):
        state, m = step(state, batch)
        scales.append(float(m["loss_scale"]))
    assert scales == [8.0, 8.0, 16.0, 16.0]  # doubled after 2 finite steps, then counting again
    assert float(state.loss_scale.scale) == 32.0


def test_bf16_pure_keeps_params_and_optimizer_state_in_bf16(reference):
    losses, state, _ = train("data=2,fsdp=2,tensor=2", zero=1, precision="bf16-pure")
    assert state.params["w1"].dtype == jnp.bfloat16
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.opt_state) if x.ndim)
    assert losses[-1] < 0.7 * losses[0]
    np.testing.assert_allclose(losses, reference[0], rtol=5e-2)  # bf16 masters drift further


def test_a_compiled_step_is_the_program_that_runs(caplog):
    """``step.compile`` (the recipes' memory line, ``explain``) keeps its executable, and calls
    on batches of those shapes run it: no second compile of the step. Another batch shape
    compiles its own program."""
    import logging
    import os
    import re
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
    import tiny

    _, step = tiny.make_step("data=8", zero=0)
    state = step.init(lambda k: tiny.init_params(k, d_hid=40), seed=0)  # a width no other test uses
    compiled = step.compile(state, tiny.batch(0))
    compiles = lambda: re.findall(r"XLA compilation of jit\((\w+)\)", caplog.text).count("_step")  # noqa: E731
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        state, metrics = step(state, tiny.batch(0))
        state, _ = step(state, tiny.batch(1))
        assert compiles() == 0
        step(state, jax.tree.map(lambda x: x[: len(x) // 2], tiny.batch(2)))
        assert compiles() == 1
    assert np.isfinite(float(metrics["loss"])) and compiled.memory_analysis() is not None
