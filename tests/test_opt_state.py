"""Optimizer state of any shape under ZeRO: every leaf gets the data axes, factored moments keep
their parameter's axes, and a leaf that cannot be sharded is an error (strict) or a visible
note — literal expected specs, one end-to-end step against a 1-device run (relative 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardkit as sk

S = jax.ShapeDtypeStruct
f32 = jnp.float32


def specs_of(plan, tx, params):
    return plan.opt_state_specs(jax.eval_shape(tx.init, params), params)


def test_adafactor_factored_moments_get_the_data_axes_zero1():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=1)
    p = {"w": S((256, 512), f32), "b": S((512,), f32)}
    state = specs_of(plan, optax.adafactor(), p)[0]
    assert state.count == P()
    assert state.v_row == {"w": P("data"), "b": P()}  # b's v_row/v_col are (1,) placeholders
    assert state.v_col == {"w": P("data"), "b": P()}
    assert state.v == {"w": P(), "b": P("data")}  # w's v is a (1,) placeholder


def test_adafactor_factored_moments_keep_the_tensor_axis():
    mesh = sk.make_mesh("data=4,tensor=2")
    rules = [(r"^w$", (None, "tensor")), (r"sq", (None, "tensor")), (r"stack", (None, None, "tensor")), (r".*", ())]
    plan = sk.Plan(mesh, rules=rules, zero=1)
    p = {"w": S((256, 512), f32), "sq": S((256, 256), f32), "stack": S((4, 256, 512), f32)}
    state = specs_of(plan, optax.adafactor(), p)[0]
    # v_row summarises the columns (dim 1, split over tensor): only the data axes are left for
    # it. v_col keeps the columns' tensor split and adds data after it. A square matrix's
    # moments could have lost either dim, so they keep only what both readings share.
    assert state.v_row == {"w": P("data"), "sq": P("data"), "stack": P(None, "data")}
    assert state.v_col == {"w": P(("tensor", "data")), "sq": P("data"), "stack": P(None, ("tensor", "data"))}
    rows = {r.path: r.source for r in plan.opt_state_layouts(jax.eval_shape(optax.adafactor().init, p), p)}
    assert rows["0/v_col/w"] == "factored moment (dim 0 summarised) of parameter w"
    assert rows["0/v_row/sq"] == "factored moment (dim 0 or 1 summarised) of parameter sq"


@pytest.mark.parametrize("tx,field", [(optax.lion(1e-3), "mu"), (optax.sgd(1e-3, momentum=0.9), "trace")])
def test_lion_and_sgd_momentum(tx, field):
    mesh = sk.make_mesh("data=8")
    p = {"w": S((24, 64), f32), "b": S((64,), f32), "odd": S((33, 33), f32)}
    # strict: the (33, 33) moment no data axis divides is an error, not a silent replica
    with pytest.raises(sk.ShardingError, match=rf"opt_state/.*{field}/odd shape=\(33, 33\)"):
        specs_of(sk.Plan(mesh, rules=[(r".*", ())], zero=1), tx, p)
    state = specs_of(sk.Plan(mesh, rules=[(r".*", ())], zero=1, strict=False), tx, p)[0]
    assert getattr(state, field) == {"w": P(None, "data"), "b": P("data"), "odd": P()}


def test_contrib_galore_low_rank_state_is_sharded():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=1)
    p = {"w": S((256, 512), f32), "b": S((512,), f32)}
    state = specs_of(plan, optax.contrib.galore(1e-3, rank=16), p)[0]
    # low-rank moments (256, 16) and projectors (512, 16): neither is the parameter's shape
    assert state.base_optimizer_state.mu == {"w": P("data"), "b": P("data")}
    assert state.base_optimizer_state.nu == {"w": P("data"), "b": P("data")}
    assert state.projector == {"w": P("data"), "b": P()}  # b's projector is empty, (0, 0)


def test_multisteps_holds_inner_state_and_accumulated_grads():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=1)
    p = {"w": S((256, 512), f32), "b": S((512,), f32)}
    specs = specs_of(plan, optax.MultiSteps(optax.adafactor(), every_k_schedule=4), p)
    assert specs.mini_step == P() and specs.gradient_step == P()
    assert specs.acc_grads == {"w": P(None, "data"), "b": P("data")}
    assert specs.inner_opt_state[0].v_row == {"w": P("data"), "b": P()}
    assert specs.inner_opt_state[0].v_col == {"w": P("data"), "b": P()}


def test_masked_and_multi_transform_keep_masked_nodes():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=1)
    p = {"w": S((256, 512), f32), "b": S((512,), f32)}
    masked = specs_of(plan, optax.masked(optax.adafactor(), {"w": True, "b": False}), p)
    assert masked.inner_state[0].v_row == {"w": P("data"), "b": optax.MaskedNode()}
    assert masked.inner_state[0].v_col == {"w": P("data"), "b": optax.MaskedNode()}
    multi = specs_of(plan, optax.multi_transform({"f": optax.adafactor(), "m": optax.sgd(0.1, momentum=0.9)},
                                                 {"w": "f", "b": "m"}), p)
    assert multi.inner_states["f"].inner_state[0].v_col == {"w": P("data"), "b": optax.MaskedNode()}
    assert multi.inner_states["m"].inner_state[0].trace == {"w": optax.MaskedNode(), "b": P("data")}


def test_strict_error_lists_every_offender_at_once():
    plan = sk.Plan(sk.make_mesh("data=2,fsdp=4"), rules=[(r".*", ())], zero=1)
    p = {"a": S((33, 33), f32), "c": S((1025,), f32), "w": S((64, 8), f32), "small": S((7,), f32)}
    with pytest.raises(sk.ShardingError) as err:
        specs_of(plan, optax.adam(1e-3), p)
    msg = str(err.value)
    assert msg.startswith("4 optimizer-state leaf/leaves cannot be sharded over the data axes data=2 x fsdp=4 (ZeRO-1)")
    for path, shape in [("0/mu/a", "(33, 33)"), ("0/nu/a", "(33, 33)"), ("0/mu/c", "(1025,)"), ("0/nu/c", "(1025,)")]:
        assert f"opt_state/{path} shape={shape} (follows parameter" in msg
    assert "small" not in msg  # 7 elements: fewer than 128 per data device, replicated with a note
    assert "Plan(..., strict=False)" in msg


def test_zero3_parameters_are_checked_too():
    p = {"a": S((33, 33), f32), "w": S((64, 8), f32)}
    with pytest.raises(sk.ShardingError, match=r"1 parameter leaf/leaves .* data=8 \(ZeRO-3\)[\s\S]*parameter a shape=\(33, 33\)"):
        sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=3).param_specs(p)
    loose = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=3, strict=False)
    assert loose.param_specs(p) == {"a": P(), "w": P("data")}


def test_strict_false_keeps_replicas_and_describe_shows_them():
    p = {"a": S((33, 33), f32), "w": S((64, 8), f32)}
    tx = optax.contrib.muon(1e-3)
    opt = jax.eval_shape(tx.init, p)
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=1, strict=False)
    text = str(plan.describe(p, opt_state=opt))
    rows = {r.path: r for r in plan.opt_state_layouts(opt, p)}
    a = rows["inner_states/muon/inner_state/0/mu/a"]
    assert (a.spec, a.note) == (P(), "ZeRO cannot shard it: no dim divisible by data=8; kept replicated over "
                                     "them (Plan(strict=False))")
    # muon's Newton-Schulz coefficients: 3 elements, under no parameter; small, so never an error
    ns = rows["inner_states/muon/inner_state/0/ns_coeffs"]
    assert (ns.spec, ns.source) == (P(), "own shape")
    assert "3 elements, fewer than 128 per data device" in ns.note
    assert "opt_state/inner_states/muon/inner_state/0/mu/a" in text and "kept replicated" in text
    # strict (the default) refuses the same plan, naming the leaf; describe still shows it
    strict = sk.Plan(plan.mesh, rules=plan.rules, zero=1)
    with pytest.raises(sk.ShardingError, match=r"1 optimizer-state leaf.*\n.*opt_state/inner_states/muon/inner_state/0/mu/a"):
        strict.opt_state_specs(opt, p)
    assert "kept replicated" in str(strict.describe(p, opt_state=opt))


def test_zero0_keeps_state_like_params():
    plan = sk.Plan(sk.make_mesh("data=4,tensor=2"), rules=[(r"w", (None, "tensor")), (r".*", ())], zero=0)
    p = {"w": S((256, 512), f32), "odd": S((33, 33), f32)}
    state = specs_of(plan, optax.adafactor(), p)[0]
    assert state.v_row == {"w": P(), "odd": P()}
    assert state.v_col == {"w": P("tensor"), "odd": P()}


D, F = 16, 64


def test_adafactor_zero1_end_to_end_matches_one_device():
    rng = np.random.RandomState(0)
    params = {"w1": jnp.asarray(rng.randn(D, F) / 4, f32), "w2": jnp.asarray(rng.randn(F, D) / 8, f32),
              "b": jnp.zeros((F,), f32)}
    x = rng.randn(32, D).astype(np.float32)
    batch = {"x": x, "y": np.tanh(x[:, ::-1].copy())}

    def loss(p, b):
        h = jax.nn.gelu(b["x"] @ p["w1"] + p["b"][None, :])
        return jnp.mean((h @ p["w2"] - b["y"]) ** 2)

    def run(mesh):
        plan = sk.Plan(mesh, rules=[(r".*", ())], zero=1)
        # factor from 16 on, so these small weights get Adafactor's row/column moments
        step = sk.train_step(plan, optax.adafactor(1e-2, min_dim_size_to_factor=16))(loss)
        state = step.init(params)
        losses = []
        for _ in range(3):
            state, m = step(state, batch)
            losses.append(float(m["loss"]))
        return np.array(losses), state

    one, _ = run(sk.make_mesh("data=1", devices=jax.devices()[:1]))
    eight, state = run(sk.make_mesh("data=8"))
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    shardings = jax.tree.map(lambda x: x.sharding.spec, state.opt_state[0])
    assert shardings.v_row == {"w1": P("data"), "w2": P("data"), "b": P()}  # (16,), (64,), (1,)
    assert shardings.v_col == {"w1": P("data"), "w2": P("data"), "b": P()}  # (64,), (16,), (1,)
    assert shardings.v == {"w1": P(), "w2": P(), "b": P("data")}
