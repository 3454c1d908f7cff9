"""Checkpoints: reshard on restore, safety (kill -9, non-finite, mismatches), preemption."""

import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from shardkit.checkpoint import Checkpointer, CheckpointError, PreemptionGuard

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
sys.path.insert(0, SCRIPTS)
import tiny  # noqa: E402


def host(tree):
    return jax.tree.map(np.array, tree)


def assert_same(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def train(step, state, start, n):
    losses = []
    for i in range(start, start + n):
        state, m = step(state, tiny.batch(i))
        losses.append(float(m["loss"]))
    return state, losses


@pytest.fixture(scope="module")
def dp():
    """The data=8 ZeRO-0 step and its state after 2 steps (a donated state: copy before reuse)."""
    plan, step = tiny.make_step("data=8", zero=0)
    state, _ = train(step, step.init(tiny.init_params, seed=0), 0, 2)
    return plan, step, state


def test_reshard_dp_to_fsdp_tensor_zero3_and_back(tmp_path):
    plan_a, step_a = tiny.make_step("data=8", zero=0)
    plan_b, step_b = tiny.make_step("fsdp=4,tensor=2", zero=3)
    state, _ = train(step_a, step_a.init(tiny.init_params, seed=0), 0, 3)
    saved = host(state)
    ckpt = Checkpointer(tmp_path / "a", async_save=True)
    assert ckpt.save(state, extra={"data_position": 3})
    # The async save has copied the arrays off the devices: donating them now must be safe.
    state, uninterrupted = train(step_a, state, 3, 3)
    ckpt.wait()

    like = step_b.init(tiny.init_params, seed=1)
    restored = ckpt.restore(plan_b, like=like)
    assert_same(restored, saved)
    assert restored.params["w1"].sharding == like.params["w1"].sharding
    assert restored.opt_state[0].mu["w1"].sharding.spec == like.opt_state[0].mu["w1"].sharding.spec
    assert ckpt.extra()["data_position"] == 3
    restored, resumed = train(step_b, restored, 3, 3)
    # Another layout reduces in another order: equal to float32 rounding, not bit for bit.
    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-5)

    back = Checkpointer(tmp_path / "b", async_save=False)
    saved_b = host(restored)
    back.save(restored)
    again = back.restore(plan_a, like=step_a.init(tiny.init_params, seed=2))
    assert_same(again, saved_b)
    assert int(again.step) == 6


def test_restore_same_layout_continues_bit_identically(tmp_path, dp):
    plan, step, _ = dp
    state, _ = train(step, step.init(tiny.init_params, seed=0), 0, 2)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(state)
    state, reference = train(step, state, 2, 2)
    restored = ckpt.restore(plan, like=step.init(tiny.init_params, seed=0))
    _, resumed = train(step, restored, 2, 2)
    assert resumed == reference


def test_incompatible_model_lists_every_leaf(tmp_path, dp):
    plan, step, state = dp
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(state)
    _, wide = tiny.make_step("data=8")

    def init_wide(key):
        return {**tiny.init_params(key, d_hid=64), "w3": jnp.zeros((4,))}

    with pytest.raises(CheckpointError) as e:
        ckpt.restore(plan, like=wide.init(init_wide))
    msg = str(e.value)
    for line in ("params/w1: saved (16, 32), expected (16, 64)", "params/b1: saved (32,), expected (64,)",
                 "opt_state/0/mu/w2: saved (32, 8), expected (64, 8)",
                 "params/w3: expected (4,) float32, not in the checkpoint"):
        assert line in msg, msg
    assert ckpt.all_steps() == [2]


def test_missing_directory_and_step_are_clear_errors(tmp_path, dp):
    plan, step, state = dp
    missing = tmp_path / "nope"
    ckpt = Checkpointer(missing)
    assert ckpt.latest_step() is None and ckpt.all_steps() == []
    with pytest.raises(CheckpointError, match="no checkpoint directory"):
        ckpt.restore(plan, like=state)
    assert not missing.exists()
    (tmp_path / "partial" / "5.orbax-checkpoint-tmp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="only interrupted saves: 5.orbax-checkpoint-tmp"):
        Checkpointer(tmp_path / "partial").restore(plan, like=state)
    ok = Checkpointer(tmp_path / "ok", async_save=False)
    ok.save(state)
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7 .*complete steps: \[2\]"):
        ok.restore(plan, like=state, step=7)


def test_like_on_another_mesh_is_refused(tmp_path, dp):
    _, _, state = dp
    other, _ = tiny.make_step("fsdp=4,tensor=2")
    with pytest.raises(CheckpointError, match=r"not on the plan's mesh \{'fsdp': 4, 'tensor': 2\}"):
        Checkpointer(tmp_path).restore(other, like=state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(CheckpointError, match="params/w1"):
        Checkpointer(tmp_path).restore(other, like=abstract)


def test_nonfinite_state_never_replaces_a_good_checkpoint(tmp_path, dp):
    plan, step, state = dp
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(state)
    good = host(state)
    bad = state.replace(step=state.step + 1, params={**state.params, "b1": state.params["b1"] * jnp.nan})
    with pytest.raises(CheckpointError, match=r"(?s)non-finite.*params/b1.*step 2 is left as it was"):
        ckpt.save(bad)
    assert ckpt.all_steps() == [2]
    assert_same(ckpt.restore(plan, like=state), good)
    assert ckpt.save(bad, allow_nonfinite=True)
    assert ckpt.all_steps() == [2, 3]


def test_every_keep_force_and_no_overwrite(tmp_path, dp):
    _, _, state = dp
    ckpt = Checkpointer(tmp_path, keep=2, every=2, async_save=False)
    written = [ckpt.save(state, step=s) for s in range(1, 7)]
    assert written == [False, True, False, True, False, True]
    assert ckpt.all_steps() == [4, 6]
    assert ckpt.save(state, step=7, force=True)
    assert not ckpt.save(state, step=7, force=True)
    assert ckpt.all_steps() == [6, 7] and ckpt.latest_step() == 7
    with pytest.raises(CheckpointError, match="JSON"):
        ckpt.save(state, step=8, extra={"x": object()})
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, dp):
    plan, _, state = dp
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(state, step=1)
    ckpt.save(state, step=2)
    os.remove(tmp_path / "2" / "state" / "_METADATA")
    with pytest.raises(CheckpointError, match=r"step 2 .* unreadable.*restore another step \(step=1"):
        Checkpointer(tmp_path).restore(plan, like=state)
    assert_same(Checkpointer(tmp_path).restore(plan, like=state, step=1), host(state))


def test_readable_with_plain_orbax(tmp_path, dp):
    _, _, state = dp
    Checkpointer(tmp_path, async_save=False).save(state, extra={"data_position": 2})
    # The recipe from docs/checkpoints_and_multihost.md: no shardkit needed to read it back.
    mngr = ocp.CheckpointManager(tmp_path, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()})
    out = mngr.restore(mngr.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore(), extra=ocp.args.JsonRestore()))
    np.testing.assert_array_equal(np.asarray(out.state["params"]["w1"]), np.asarray(state.params["w1"]))
    assert out.extra == {"data_position": 2}


def test_preemption_guard_flag_and_handler_restored():
    before = signal.getsignal(signal.SIGTERM)
    with PreemptionGuard() as guard:
        assert not guard.should_stop(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.should_stop(2)
    assert signal.getsignal(signal.SIGTERM) is before


# ---- subprocesses: kill -9 while saving, SIGTERM while training ----------------------------

def _spawn(*args, limit=120):
    """A Python subprocess (killed by a watchdog after ``limit`` seconds, so nothing hangs)."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(limit, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    return proc


def _wait_for(proc, prefix):
    lines = []
    for line in proc.stdout:
        lines.append(line.strip())
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"process ended before printing {prefix!r}; output: {lines}")


@pytest.mark.parametrize("moment", ["created", "writing", "committing"])
def test_kill_9_while_saving_keeps_previous_checkpoint(tmp_path, moment, dp):
    plan, step, _ = dp
    proc = _spawn(os.path.join(SCRIPTS, "save_and_die.py"), "--dir", str(tmp_path), "--moment", moment)
    _wait_for(proc, f"at {moment}")
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))
    proc.kill()  # SIGKILL
    proc.wait(timeout=30)

    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    reference, _ = train(step, step.init(tiny.init_params, seed=0), 0, 1)
    assert_same(ckpt.restore(plan, like=step.init(tiny.init_params, seed=0)), host(reference))
    assert ckpt.extra() == {"data_position": 1}
    assert ckpt.save(reference, step=2)  # the next save cleans the partial one and commits
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_sigterm_checkpoints_exits_0_and_resumes_bit_identically(tmp_path, dp):
    _, step, _ = dp
    script = os.path.join(SCRIPTS, "train_preempt.py")
    n = 12
    proc = _spawn(script, "--dir", str(tmp_path), "--steps", "40", "--every", "100", "--delay", "0.1")
    first = _wait_for(proc, "loss 3")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    first += out.splitlines()
    assert proc.returncode == 0, first
    stopped = int(next(line for line in out.splitlines() if line.startswith("preempted")).split()[1])
    assert 4 <= stopped < n, out
    assert Checkpointer(tmp_path).all_steps() == [stopped]
    res = subprocess.run(["timeout", "120", sys.executable, script, "--dir", str(tmp_path), "--steps", str(n),
                          "--every", "100", "--resume"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed {stopped}" in res.stdout
    losses = [line.split()[2] for line in (first + res.stdout.splitlines()) if line.startswith("loss")]
    _, reference = train(step, step.init(tiny.init_params, seed=0), 0, n)
    assert losses == [float(x).hex() for x in reference]


def test_restore_into_abstract_state_without_allocating(tmp_path):
    """``step.abstract_state(init_fn)`` (shapes + shardings, nothing allocated) is a restore
    target: a ZeRO-1 data=8 checkpoint lands on fsdp=4,tensor=2 ZeRO-3 and keeps training."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardkit as sk

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"]) ** 2)

    init = lambda: {"w": jnp.ones((16, 8))}  # noqa: E731
    batch = {"x": np.ones((8, 16), np.float32)}
    step = sk.train_step(sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], zero=1), optax.adam(1e-2))(loss)
    state, _ = step(step.init(init), batch)
    saved_w = np.asarray(state.params["w"])
    with sk.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, step=1)
    plan3 = sk.Plan(sk.make_mesh("fsdp=4,tensor=2"), rules=[(r".*", ())], zero=3)
    step3 = sk.train_step(plan3, optax.adam(1e-2))(loss)
    restored = sk.Checkpointer(tmp_path).restore(plan3, like=step3.abstract_state(init))
    assert restored.params["w"].sharding.spec == plan3.param_specs(init())["w"]
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), saved_w)
    _, metrics = step3(restored, batch)
    assert np.isfinite(float(metrics["loss"]))


def test_resume_returns_like_when_empty_and_latest_with_extra(tmp_path):
    import jax.numpy as jnp
    import numpy as np
    import optax

    import shardkit as sk

    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())])
    step = sk.train_step(plan, optax.sgd(0.1))(lambda p, b: jnp.mean(b["x"] @ p["w"]))
    state = step.init({"w": jnp.ones((4, 1))})
    ckpt = sk.Checkpointer(tmp_path)
    same, extra = ckpt.resume(plan, like=state)
    assert same is state and extra is None
    state, _ = step(state, {"x": np.ones((8, 4), np.float32)})
    ckpt.save(state, step=1, extra={"data": {"offset": 8}})
    ckpt.wait()
    restored, extra = ckpt.resume(plan, like=state)
    assert extra == {"data": {"offset": 8}} and int(restored.step) == 1
