"""Checkpoint conversions through ``Checkpointer.restore``: a data-parallel checkpoint resumes as
a DiLoCo run (every replica and θ_outer from it, fragments cut along the layers, the outer
optimizer fresh, the step carried on) and a DiLoCo checkpoint resumes as data parallelism (θ_outer,
the replicas' mean optimizer state); a checkpoint of another model is a clear error."""

import sys
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.checkpoint import Checkpointer, CheckpointError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "scripts"))
import tiny  # noqa: E402


def stacked_loss(p, batch):
    h = batch["x"]
    for i in range(p["layers"].shape[0]):
        h = jnp.tanh(h @ p["layers"][i])
    return jnp.mean((h[:, :tiny.D_OUT] @ p["head"] - batch["y"]) ** 2)


def init(scale=0.3):
    k1, k2 = jax.random.split(jax.random.key(1))
    return {"layers": jax.random.normal(k1, (4, tiny.D_IN, tiny.D_IN)) * scale,
            "head": jax.random.normal(k2, (tiny.D_OUT, tiny.D_OUT)) * scale}


def host(tree):
    return jax.tree.map(np.asarray, tree)


def run(step, state, start, stop):
    for i in range(start, stop):
        state, m = step(state, tiny.batch(i))
    return state, float(m["loss"])


def test_dp_checkpoint_resumes_as_diloco_and_diloco_as_dp(tmp_path):
    """Both ways on replica=2,data=4 with two fragments over a 4-layer stacked leaf (exact:
    the conversions copy, slice, broadcast and average, nothing else)."""
    plan = sk.Plan(sk.make_mesh("replica=2,data=4"), rules=[(r".*", ())])
    dp = sk.train_step(plan, optax.adam(1e-2))(stacked_loss)
    outer = sk.DiLoCo(every=2, fragments=2, layers=r"^layers$")
    dl = sk.train_step(plan, optax.adam(1e-2), outer=outer)(stacked_loss)

    s_dp, _ = run(dp, dp.init(init()), 0, 3)
    Checkpointer(tmp_path / "dp", async_save=False).save(s_dp)
    warm = Checkpointer(tmp_path / "dp").restore(plan, like=dl.init(init(0.0)))
    assert int(warm.step) == 3 and warm.params["layers"].shape == (2, 4, tiny.D_IN, tiny.D_IN)
    assert warm.params["layers"].sharding == dl.state_shardings(warm).params["layers"]
    # Compared on the host: each index of a sharded array would be one more compile on 8 devices.
    h_warm, h_dp = host(warm), host(s_dp)
    for r in range(2):
        np.testing.assert_array_equal(h_warm.params["layers"][r], h_dp.params["layers"])
        np.testing.assert_array_equal(h_warm.opt_state[0].nu["head"][r], h_dp.opt_state[0].nu["head"])
    np.testing.assert_array_equal(h_warm.outer.params[0]["layers"], h_dp.params["layers"][:2])
    np.testing.assert_array_equal(h_warm.outer.params[1]["layers"], h_dp.params["layers"][2:])
    np.testing.assert_array_equal(h_warm.outer.params[0]["head"], h_dp.params["head"])
    assert all(not np.any(x) for x in jax.tree.leaves(h_warm.outer.opt_state))  # fresh momentum

    s_dl, _ = run(dl, warm, 3, 8)  # fragment 1 synced after step 7, fragment 0 after step 8
    Checkpointer(tmp_path / "dl", async_save=False).save(s_dl)
    back = Checkpointer(tmp_path / "dl").restore(plan, like=dp.init(init(0.0)))
    whole = host(dl.diloco.consensus(s_dl).params)
    h_back, h_dl = host(back), host(s_dl)
    np.testing.assert_array_equal(h_back.params["layers"], whole["layers"])
    np.testing.assert_array_equal(h_back.params["head"], whole["head"])
    np.testing.assert_allclose(h_back.opt_state[0].mu["layers"], h_dl.opt_state[0].mu["layers"].mean(axis=0), rtol=1e-6)
    assert int(h_back.step) == 8 and int(h_back.opt_state[0].count) == int(h_dl.opt_state[0].count[0])
    _, l_back = run(dp, back, 8, 9)
    assert np.isfinite(l_back)

    other = sk.train_step(plan, optax.adam(1e-2), outer=outer)(stacked_loss)
    wrong = {"layers": jnp.zeros((4, tiny.D_IN, tiny.D_IN)), "head": jnp.zeros((tiny.D_OUT, 4))}
    with pytest.raises(CheckpointError, match=r"(?s)head: saved \(8, 8\), expected \(8, 4\).*data-parallel checkpoint"
                                              r" restored into a DiLoCo run"):
        Checkpointer(tmp_path / "dp").restore(plan, like=other.init(wrong))


@pytest.mark.parametrize("phases", ["dp-diloco-dp"])
def test_recipe_warm_starts_diloco_from_a_dp_checkpoint(tmp_path, capsys, phases):
    """--stop-after ends a DP phase of a 6-step schedule at step 3 with a checkpoint;
    --init-from continues it as DiLoCo from step 3 (the same data position), then back as DP."""
    import json

    from models.transformer import train

    small = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "8", "--cpu-devices", "0",
             "--quiet", "--eval-batches", "1", "--mesh", "replica=2,data=4", "--steps", "6", "--eval-every", "6"]
    assert train.main([*small, "--stop-after", "3", "--checkpoint-dir", str(tmp_path / "dp")]) == 0
    out = tmp_path / "m.jsonl"
    assert train.main([*small, "--init-from", str(tmp_path / "dp"), "--diloco-every", "2", "--diloco-fragments", "2",
                       "--metrics-out", str(out), "--checkpoint-dir", str(tmp_path / "dl")]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3, 4, 5]
    assert Checkpointer(tmp_path / "dl").latest_step() == 6
    assert train.main([*small, "--steps", "7", "--init-from", str(tmp_path / "dl"), "--metrics-out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [6]
    capsys.readouterr()
    assert train.main([*small, "--stop-after", "9"]) == 2
    assert "--stop-after: must be in 1..--steps (6)" in capsys.readouterr().err
