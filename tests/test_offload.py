"""Host offload: the optimizer state in pinned host memory (numerics equal the on-device step;
the compiled program's host bytes are the state's; checkpoints round-trip), activation offload
through a remat policy.

Tolerance: offloading moves bytes, not arithmetic, so the losses and parameters equal the
on-device step's to a relative 1e-6 in fp32.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_step import AXIS_RULES, batches, init_params, mlp_loss, rules_for

import shardkit as sk


def _train(mesh_spec, zero, offload, steps=4, clip_norm=None, devices=None):
    mesh = sk.make_mesh(mesh_spec, devices=devices)
    plan = sk.Plan(mesh, rules=rules_for(mesh), axis_rules=AXIS_RULES, zero=zero, offload=offload)
    step = sk.train_step(plan, optax.adamw(1e-2), clip_norm=clip_norm, skip_nonfinite=True)(mlp_loss)
    state = step.init(init_params)
    losses = []
    for batch in batches(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return np.array(losses), state, step


def test_offloaded_opt_state_trains_like_the_on_device_step_lives_on_the_host_and_checkpoints(tmp_path):
    losses, state, step = _train("data=4,fsdp=2", 1, ("opt_state",), clip_norm=1.0)
    np.testing.assert_allclose(losses, _train("data=1", 0, (), clip_norm=1.0, devices=jax.devices()[:1])[0], rtol=1e-6)
    mu = state.opt_state[0].mu["w1"]
    assert mu.sharding.memory_kind == "pinned_host" and state.params["w1"].sharding.memory_kind == "device"
    assert mu.sharding.spec == step.plan.opt_state_specs(jax.eval_shape(step.tx.init, state.params), state.params)[0].mu["w1"]
    report = step.explain(state, next(batches(1)))
    opt_bytes = report.memory["opt_state"]
    assert report.memory["host_arguments"] == report.memory["host_outputs"] == opt_bytes
    assert report.offloaded == ("opt_state",)
    assert "pinned host" in str(report)
    # Saved and restored like any other state, back into host memory.
    ckpt = sk.Checkpointer(tmp_path, async_save=False)
    ckpt.save(state)
    restored = ckpt.restore(step.plan, like=step.init(init_params, seed=1))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert restored.opt_state[0].nu["w2"].sharding.memory_kind == "pinned_host"
    batch = next(batches(1))
    np.testing.assert_allclose(float(step(restored, batch)[1]["loss"]), float(step(state, batch)[1]["loss"]), rtol=1e-6)


def test_offload_errors_name_the_choices():
    mesh = sk.make_mesh("data=8")
    with pytest.raises(ValueError, match=r"offload=.*\['activations'\].*\['opt_state'\]"):
        sk.Plan(mesh, offload=("activations",))


@pytest.mark.extended  # a deviceless compile per target (~12 s on 2 cores)
@pytest.mark.parametrize("target", ["h100", "tpu-v5p"])
def test_offload_moves_the_state_bytes_from_device_to_host_on_the_target_compiler(target):
    """Compiled deviceless for 8 devices of the target: the device arguments drop by the
    optimizer state's bytes and the host arguments are exactly them (XLA:TPU pads each small
    array to its tiles, so there they are the padded state: at least the state's bytes)."""
    from target_sweep import require

    require(target)
    _, state, step = _train("data=8", 1, (), steps=1)
    _, off_state, off_step = _train("data=8", 1, ("opt_state",), steps=1)
    batch = next(batches(1))
    on, off = sk.cost.simulate_many([(step, state, batch, "data=8"), (off_step, off_state, batch, "data=8")],
                                    target=target)
    opt = on.memory["opt_state"]
    assert "host_peak" not in on.memory and off.offloaded == ("opt_state",)
    host = off.memory["host_arguments"]
    assert host == opt if target == "h100" else host >= opt
    assert on.memory["arguments"] - off.memory["arguments"] == host == off.memory["host_outputs"]


def test_offload_remat_policy_keeps_gradients():
    """``sk.offload.remat_policy()`` changes where saved activations live, not what is computed."""
    w = jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def loss(w, policy):
        layer = lambda h, w_l: (jnp.tanh(h @ w_l), None)
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy)
        return jnp.sum(jax.lax.scan(layer, x, w)[0] ** 2)

    ref = jax.grad(loss)(w, None)
    for policy in (sk.offload.remat_policy(), sk.offload.remat_policy(["h"])):
        np.testing.assert_allclose(jax.grad(loss)(w, policy), ref, rtol=1e-6, atol=1e-6)  # recomputed: fused anew
    with pytest.raises(ValueError, match="checkpoint_name"):
        sk.offload.remat_policy([])


@pytest.mark.extended  # the recipe's gradients twice (~8 s on 2 cores)
def test_remat_offload_keeps_the_recipe_gradients_and_puts_activations_on_the_host():
    """The recipe's ``--remat offload``: the same loss and gradients as no remat (fp32, 1e-6
    relative) on CPU (XLA:CPU has no host offloader: the saved activations stay in its memory;
    the next test reads them in host memory on H100)."""
    from flax import nnx
    from test_transformer import CFG, build, tokens

    from models.transformer.model import loss_fn

    batch = {"inputs": tokens(4, CFG.seq), "targets": tokens(4, CFG.seq, seed=1)}

    def grads(remat):
        graphdef, params = nnx.split(build(CFG.replace(remat=remat)))
        return jax.jit(jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), batch)))(params)

    ref_loss, ref = grads("none")
    loss, got = grads("offload")
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


@pytest.mark.extended  # two deviceless H100 compiles of the recipe (~35 s on 2 cores)
def test_remat_offload_puts_the_saved_activations_in_host_memory_on_h100():
    from target_sweep import require

    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    require("h100")
    cfg = SIZES["test"].replace(seq=64)
    jobs = [(*abstract_step(cfg.replace(remat=r), "data=8", global_batch=16, zero=1, target="h100"), "data=8")
            for r in ("dots_no_batch", "offload")]
    device, host = sk.cost.simulate_many(jobs, target="h100")
    # The saved matmul outputs are host temporaries, and the device's temporaries drop by about
    # as much against dots_no_batch (the same policy saving them on the device).
    saved = host.memory["host_temporaries"]
    assert saved > 0 and "host_temporaries" not in device.memory
    assert 0.8 * saved < device.memory["temporaries"] - host.memory["temporaries"] < 1.2 * saved
