"""The recipes' learning-rate schedules, weight-decay masks and clipping flags (Optax)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models.common.schedules import Schedule, decay_mask


def test_schedule_values():
    cos = Schedule(1.0, steps=110, warmup_steps=10, decay="cosine", min_lr_ratio=0.1)()
    lin = Schedule(1.0, steps=110, warmup_steps=10, decay="linear", min_lr_ratio=0.1)()
    const = Schedule(1.0, steps=110, warmup_steps=10, decay="constant")()
    for s in (cos, lin, const):  # linear warmup from 0 to the peak
        assert [float(s(i)) for i in (0, 5, 10)] == pytest.approx([0.0, 0.5, 1.0])
    # halfway through the decay: cosine and linear both at the midpoint of [0.1, 1]
    assert float(cos(60)) == pytest.approx(0.55) and float(lin(60)) == pytest.approx(0.55)
    assert float(cos(35)) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)), rel=1e-6)
    assert float(lin(35)) == pytest.approx(1 - 0.9 * 0.25)
    assert float(cos(110)) == pytest.approx(0.1) and float(lin(110)) == pytest.approx(0.1)
    assert float(const(110)) == 1.0 and float(cos(500)) == pytest.approx(0.1)
    no_warmup = Schedule(2.0, steps=10, warmup_steps=0, decay="linear", min_lr_ratio=0.0)()
    assert [float(no_warmup(i)) for i in (0, 5, 10)] == pytest.approx([2.0, 1.0, 0.0])


@pytest.mark.parametrize("kwargs, flag", [
    ({"lr": 0.0}, "--lr"), ({"warmup_steps": 11}, "--warmup-steps"), ({"decay": "step"}, "--decay"),
    ({"min_lr_ratio": 1.5}, "--min-lr-ratio")])
def test_schedule_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        Schedule(**{"lr": 1.0, "steps": 10, **kwargs})


def test_transformer_mask_spares_norms_and_embeddings():
    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.model import Transformer
    from shardkit.rules import path_str

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(SIZES["test"], rngs=nnx.Rngs(0)))
    params = jax.tree.map(lambda v: np.ones(v.shape, np.float32), nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    flat = {path_str(k): bool(v) for k, v in jax.tree_util.tree_flatten_with_path(decay_mask("norm|embed")(params))[0]}
    assert {p for p, decayed in flat.items() if not decayed} == {
        "embed", "final_norm/scale", "blocks/attn_norm/scale", "blocks/mlp_norm/scale"}
    assert flat["blocks/attn/q"] and flat["blocks/mlp/down"]
    # Masked leaves are untouched by the decay; the others shrink by lr * wd.
    tx = optax.adamw(0.1, weight_decay=0.5, mask=decay_mask("norm|embed"))
    # one compiled update (eagerly, each leaf's ops would be compiles)
    updates = jax.jit(lambda p: tx.update(jax.tree.map(jnp.zeros_like, p), tx.init(p), p)[0])(params)
    got = {path_str(k): float(v.reshape(-1)[0]) for k, v in jax.tree_util.tree_flatten_with_path(updates)[0]}
    assert got["blocks/attn_norm/scale"] == 0.0 and got["embed"] == 0.0
    assert got["blocks/attn/q"] == pytest.approx(-0.05)


def test_rank_mask_and_bad_regex():
    params = {"conv": {"kernel": jnp.ones((3, 3, 4, 8)), "bias": jnp.ones(8)}, "bn": {"scale": jnp.ones(8)}}
    assert decay_mask(None)(params) == {"conv": {"kernel": True, "bias": False}, "bn": {"scale": False}}
    assert decay_mask(r"conv/")(params) == {"conv": {"kernel": False, "bias": False}, "bn": {"scale": True}}
    with pytest.raises(ValueError, match="--no-decay"):
        decay_mask("norm(")


@pytest.mark.parametrize("argv, flag", [
    (["--decay", "step"], "--decay"), (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--grad-clip", "-1"], "--grad-clip"), (["--no-decay", "("], "--no-decay")])
def test_transformer_schedule_flags_fail_with_one_line(argv, flag, capsys):
    from models.transformer.train import main

    assert main(argv + ["--quiet", "--steps", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err


def test_recipe_optimizers_follow_the_flags():
    from models.resnet.train import make_optimizer

    params = {"conv": {"kernel": jnp.ones((3, 3, 1, 8))}, "bn": {"scale": jnp.ones(8)}}
    tx = make_optimizer("sgd", 1.0, steps=20, weight_decay=0.0, warmup=0, decay="linear", min_lr_ratio=0.5)
    grads = jax.tree.map(jnp.ones_like, params)
    state, seen = tx.init(params), []
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        seen.append(float(updates["bn"]["scale"][0]))
    # Nesterov SGD: step k's update is -lr_k (1 + 0.9 m_k), m_k = 1 + 0.9 m_{k-1}; lr 1, 0.975, 0.95
    m = [1.0, 1.9, 2.71]
    np.testing.assert_allclose(seen, [-lr * (1 + 0.9 * mk) for lr, mk in zip([1.0, 0.975, 0.95], m)], rtol=1e-6)
