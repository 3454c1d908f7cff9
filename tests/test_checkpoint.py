"""Checkpoints: reshard on restore, safety (kill -9, non-finite, mismatches), preemption."""

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding, PartitionSpec as P

from shardkit.checkpoint import (Checkpointer, CheckpointError, CorruptCheckpointError, PreemptionGuard, RestoreInfo,
                                 array_checksums)

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
    assert ckpt.last_restore.verified  # the checksums do not depend on the layout
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


def test_missing_state_metadata_is_a_corrupt_step(tmp_path, dp):
    plan, _, state = dp
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(state, step=1)
    ckpt.save(state, step=2)
    os.remove(tmp_path / "2" / "state" / "_METADATA")
    with pytest.raises(CorruptCheckpointError, match=r"(?s)step 2 .* corrupt.*metadata.*older complete steps: \[1\]"):
        Checkpointer(tmp_path).restore(plan, like=state)
    assert_same(Checkpointer(tmp_path).restore(plan, like=state, step=1), host(state))
    assert_same(Checkpointer(tmp_path).restore(plan, like=state, fallback=True), host(state))


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


def test_a_first_save_compiles_one_checksum_program_per_leaf_layout(tmp_path, caplog):
    """Nothing compiled per device or per leaf: replicated arrays below MIN_REPLICA_SLICE_BYTES
    are written by one replica (Orbax's replica-parallel write compiled a slice program per
    device and shape), and the checksums compile one program per distinct leaf layout, which
    the optimizer's moments share with the parameters (one program per tree compiled every
    leaf again for each new tree)."""
    import re

    _, step = tiny.make_step("data=8", zero=0)
    state = step.init(lambda k: tiny.init_params(k, d_hid=24), seed=0)  # a width no other test uses
    layouts = {(x.sharding.spec, x.shape, x.dtype) for x in jax.tree.leaves(state) if isinstance(x, jax.Array)}
    with caplog.at_level(logging.WARNING), jax.log_compiles(True):
        Checkpointer(tmp_path, async_save=False).save(state)
    compiled = re.findall(r"Compiling jit\((\w+)\)", caplog.text)
    assert "slice" not in compiled, compiled
    assert 1 <= compiled.count("checksum_blocks") <= len(layouts) < len(jax.tree.leaves(state)), compiled


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


KILL_MOMENTS = ("created", "writing", "committing")


@pytest.fixture(scope="module")
def stopped_saves(tmp_path_factory):
    """One interpreter for the three moments: tests/scripts/save_and_die.py forks a process per
    moment (before JAX starts), each stopped mid-save of step 2 in its own directory."""
    dirs = {m: tmp_path_factory.mktemp(f"kill9-{m}") for m in KILL_MOMENTS}
    args = [a for m in KILL_MOMENTS for a in ("--dir", str(dirs[m]), "--moment", m)]
    proc = _spawn(os.path.join(SCRIPTS, "save_and_die.py"), *args, limit=300)
    seen = {}

    def wait_for(word, key):
        """The rest of the line ``<word> <key> ...`` the script printed (read on as needed)."""
        while (word, key) not in seen:
            line = proc.stdout.readline()
            if not line:
                break
            first, _, rest = line.strip().partition(" ")
            seen[(first, rest.split(" ", 1)[0])] = rest
        assert (word, key) in seen, f"the script ended before printing {word} {key}; it printed {seen}"
        return seen[(word, key)]

    yield dirs, wait_for
    proc.kill()  # the children see it go and end
    proc.wait(timeout=30)


@pytest.mark.parametrize("moment", KILL_MOMENTS)
def test_kill_9_while_saving_keeps_previous_checkpoint(stopped_saves, moment, dp):
    plan, step, _ = dp
    dirs, wait_for = stopped_saves
    tmp_path = dirs[moment]
    pid = int(wait_for("at", moment).split()[1])
    assert any(".orbax-checkpoint-tmp" in n for n in os.listdir(tmp_path))
    os.kill(pid, signal.SIGKILL)
    assert wait_for("reaped", str(pid)).split()[1] == "SIGKILL"  # dead (and reaped) before we look

    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    reference, _ = train(step, step.init(tiny.init_params, seed=0), 0, 1)
    assert_same(ckpt.restore(plan, like=step.init(tiny.init_params, seed=0)), host(reference))
    assert ckpt.extra() == {"data_position": 1}
    assert ckpt.save(reference, step=2)  # the next save cleans the partial one and commits
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2] and sorted(os.listdir(tmp_path)) == ["1", "2"]


def test_sigterm_checkpoints_exits_0_and_resumes_bit_identically(tmp_path, dp):
    plan, step, _ = dp
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
    ckpt = Checkpointer(tmp_path)
    assert ckpt.all_steps() == [stopped] and ckpt.extra() == {"data_position": stopped}
    # Resumed here, with the script's step (the fixture's: data=8, ZeRO-0), from what the
    # preempted process saved: no second interpreter needed to read a checkpoint back.
    _, resumed = train(step, ckpt.restore(plan, like=step.init(tiny.init_params, seed=0)), stopped, n - stopped)
    losses = [line.split()[2] for line in first if line.startswith("loss")] + [float(x).hex() for x in resumed]
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
    # tensor is there to reshard onto, not to split the work: unused on purpose
    plan3 = sk.Plan(sk.make_mesh("fsdp=4,tensor=2"), rules=[(r".*", ())], zero=3, unused_axes="tensor")
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


# ---- integrity: damaged steps are named, fallback restores the previous one exactly -------------

WIDE = 512  # hidden width: every chunk is > 1 KiB, so OCDBT stores it in a data file (not inline)


def init_wide(key):
    return tiny.init_params(key, d_hid=WIDE)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 1 and 2 of the wide MLP (data=8 ZeRO-0) in one directory, and host copies of both."""
    plan, step = tiny.make_step("data=8", zero=0)
    state = step.init(init_wide, seed=0)
    directory = tmp_path_factory.mktemp("saved")
    states = {}
    with Checkpointer(directory, keep=None, async_save=False) as ckpt:
        for i in (1, 2):
            state, _ = step(state, tiny.batch(i - 1))
            states[i] = host(state)
            ckpt.save(state, extra={"data_position": i})
    return plan, step, directory, states


@pytest.fixture
def copy(saved, tmp_path):
    """A fresh copy of the saved directory (tests damage it) and a target to restore into."""
    plan, step, directory, states = saved
    shutil.copytree(directory, tmp_path / "ckpt")
    return plan, step.abstract_state(init_wide), tmp_path / "ckpt", states


def _chunk(item_dir, key: bytes) -> tuple[str, int, int]:
    """(file, offset, length) of one stored chunk, e.g. ``b"params.w1/0.0"``, from the step's index."""
    from shardkit.checkpoint.damage import _location

    base = ts.KvStore.open({"driver": "file", "path": f"{item_dir}/"}).result()
    todo = [(ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"], b"")]
    while todo:
        loc, prefix = todo.pop()
        for entry in ts.ocdbt.dump(base, loc).result()["entries"]:
            if "location" in entry:
                todo.append((entry["location"], prefix + entry.get("subtree_common_prefix", b"")))
            elif prefix + entry["key"] == key:
                assert "indirect_value" in entry, f"{key} is stored inline; widen the model"
                path, end = _location(str(item_dir), entry["indirect_value"])
                length = int(entry["indirect_value"].rsplit(":", 1)[1])
                return path, end - length, length
    raise AssertionError(f"no chunk {key} in {item_dir}")


def _flip(path, at: int, n: int = 64):
    with open(path, "r+b") as f:
        f.seek(at)
        data = f.read(n)
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data))


def _fingerprint(directory) -> dict:
    """Every file under ``directory`` and its SHA-256: proof that nothing was changed."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _assert_falls_back_to_step_1(plan, like, directory, states, caplog, leaf):
    """Step 2 is refused naming ``leaf``; fallback gives step 1 bit for bit and touches nothing."""
    before = _fingerprint(directory / "2")
    with pytest.raises(CorruptCheckpointError) as e:
        Checkpointer(directory).restore(plan, like=like)
    assert e.value.step == 2 and f"checkpoint step 2 in {directory} is corrupt" in str(e.value)
    assert leaf in [p for p, _ in e.value.problems], e.value.problems
    ckpt = Checkpointer(directory)
    with caplog.at_level(logging.WARNING, logger="shardkit.checkpoint"):
        state, extra = ckpt.resume(plan, like=like, fallback=True)
    assert_same(state, states[1])
    assert extra == {"data_position": 1}
    assert ckpt.last_restore.step == 1 and ckpt.last_restore.verified
    assert [s for s, _ in ckpt.last_restore.skipped] == [2]
    assert "restored checkpoint step 1" in caplog.text and "[2] skipped" in caplog.text
    assert _fingerprint(directory / "2") == before
    return e.value


@pytest.mark.parametrize("key, where", [
    (b"params.w1/0.0", "start"), (b"params.w1/0.0", "middle"), (b"params.w1/0.0", "end"),
    (b"opt_state.0.mu.w2/0.0", "middle"), (b"opt_state.0.nu.w1/0.0", "end"), (b"params.w2/0.0", "middle")])
def test_bit_flips_name_the_array_and_fallback_restores_exactly(copy, caplog, key, where):
    plan, like, directory, states = copy
    path, offset, length = _chunk(directory / "2" / "state", key)
    _flip(path, {"start": offset, "middle": offset + length // 2 - 32, "end": offset + length - 64}[where])
    leaf = key.split(b"/")[0].decode().replace(".", "/")
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, leaf)
    what = dict(error.problems)[leaf]
    # A broken compressed frame fails to decode; anything else decodes to wrong numbers.
    assert what.startswith(("checksum mismatch", "corrupt data")), what


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax leaves a read coroutine behind
def test_flip_in_the_index_is_caught_and_named(copy, caplog):
    plan, like, directory, states = copy
    base = ts.KvStore.open({"driver": "file", "path": f"{directory}/2/state/"}).result()
    root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    from shardkit.checkpoint.damage import _location

    path, end = _location(str(directory / "2" / "state"), root)
    # 8 bytes in the middle of the root node itself (its file may also hold data and older
    # nodes: a flip at the file's middle once landed outside the index, in a fresh-clone run)
    length = int(root.rsplit(":", 1)[1])
    _flip(path, end - length // 2 - 4, 8)
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, "")
    # TensorStore names the damage as the node's CRC-32C mismatch, or as the node failing to
    # decode where the flipped bytes break its compressed stream first: the index, either way
    what = error.problems[0][1]
    assert "its index" in what and "unreadable" in what and ("CRC" in what or "decoding" in what), error.problems


def test_truncated_chunk_file(copy, caplog):
    plan, like, directory, states = copy
    path, offset, length = _chunk(directory / "2" / "state", b"params.w1/0.0")
    os.truncate(path, offset + length // 2)
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, "params/w1")
    assert dict(error.problems)["params/w1"].startswith("truncated")


def test_deleted_data_file(copy, caplog):
    plan, like, directory, states = copy
    path, _, _ = _chunk(directory / "2" / "state", b"opt_state.0.mu.w1/0.0")
    os.remove(path)
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, "opt_state/0/mu/w1")
    assert dict(error.problems)["opt_state/0/mu/w1"].startswith("missing file")


def test_array_missing_from_metadata(copy, caplog):
    plan, like, directory, states = copy
    meta_path = directory / "2" / "state" / "_METADATA"
    meta = json.loads(meta_path.read_text())
    del meta["tree_metadata"]["('params', 'w2')"]
    meta_path.write_text(json.dumps(meta))
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, "params/w2")
    assert dict(error.problems)["params/w2"].startswith("missing array")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # Orbax leaves a read coroutine behind
def test_array_entries_deleted_from_the_store(copy, caplog):
    plan, like, directory, states = copy
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory}/2/state/"}).result()
    kv.delete_range(ts.KvStore.KeyRange(b"params.b1/", b"params.b10")).result()
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, "params/b1")
    assert dict(error.problems)["params/b1"].startswith("missing array")


def test_missing_checksum_record_and_tampered_extra(copy, caplog):
    plan, like, directory, states = copy
    shutil.rmtree(directory / "2" / "checksums")
    error = _assert_falls_back_to_step_1(plan, like, directory, states, caplog, "")
    assert "checksum record" in error.problems[0][1]
    shutil.copytree(directory / "1" / "checksums", directory / "2" / "checksums")  # a wrong record: every array differs
    with pytest.raises(CorruptCheckpointError, match="params/w1: checksum mismatch"):
        Checkpointer(directory).restore(plan, like=like)
    (directory / "1" / "extra" / "metadata").write_text('{"data_position": 7}')  # valid JSON, wrong value
    with pytest.raises(CorruptCheckpointError, match="step 1 .*\n  extra: checksum mismatch"):
        Checkpointer(directory).extra(step=1)


def test_every_step_corrupt_lists_each(copy):
    plan, like, directory, _ = copy
    for s in (1, 2):
        path, offset, length = _chunk(directory / str(s) / "state", b"params.w2/0.0")
        _flip(path, offset + length // 2)
    with pytest.raises(CheckpointError, match=r"(?s)no intact checkpoint.*step 2: params/w2: .*step 1: params/w2: "):
        Checkpointer(directory).restore(plan, like=like, fallback=True)


def test_keep_never_deletes_a_corrupt_step_nor_counts_it(copy, caplog):
    """keep=2 after falling back over two corrupt steps: the intact step 1 stays until two newer
    intact steps exist (Orbax's newest-2 rule would leave one), the corrupt ones are never touched,
    and a save of a corrupt step's number is refused with a warning instead of overwriting it."""
    plan, like, directory, states = copy
    shutil.copytree(directory / "2", directory / "3")  # a third step, then damage 2 and 3
    for s in (2, 3):
        path, offset, length = _chunk(directory / str(s) / "state", b"params.w1/0.0")
        _flip(path, offset + length // 2)
    evidence = {s: _fingerprint(directory / str(s)) for s in (2, 3)}
    ckpt = Checkpointer(directory, keep=2, async_save=False)
    state, _ = ckpt.resume(plan, like=like, fallback=True)
    assert ckpt.last_restore.step == 1 and [s for s, _ in ckpt.last_restore.skipped] == [3, 2]
    with caplog.at_level(logging.WARNING, logger="shardkit.checkpoint"):
        assert not ckpt.save(state, step=2)
    assert "not saving step 2" in caplog.text
    assert ckpt.save(state, step=4)
    assert ckpt.all_steps() == [1, 2, 3, 4]
    assert ckpt.save(state, step=5)
    assert ckpt.all_steps() == [2, 3, 4, 5]
    assert {s: _fingerprint(directory / str(s)) for s in (2, 3)} == evidence
    assert_same(ckpt.restore(plan, like=like, step=5), states[1])


def test_checkpoint_without_checksums_restores_unverified(saved, tmp_path, caplog):
    """A step written the way shardkit wrote them before checksums (plain Orbax, two items)."""
    plan, step, _, states = saved
    state = jax.device_put(states[2], jax.tree.map(lambda x: x.sharding, step.abstract_state(init_wide)))
    mngr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(create=True), item_handlers={
        "state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()})
    mngr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave({"data_position": 2})),
              custom_metadata={"shardkit": {"mesh": {"data": 8}, "process_count": 1}})
    mngr.wait_until_finished()
    mngr.close()
    ckpt = Checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="shardkit.checkpoint"):
        restored, extra = ckpt.resume(plan, like=step.abstract_state(init_wide), fallback=True)
    assert_same(restored, states[2])
    assert extra == {"data_position": 2} and not ckpt.last_restore.verified
    assert "step 2" in caplog.text and "no checksums" in caplog.text and "restored unverified" in caplog.text


def test_checksums_are_layout_independent_and_precision_change_is_verified_first(saved):
    plan, step, directory, states = saved
    plan3, step3 = tiny.make_step("fsdp=4,tensor=2", zero=3)
    like = step3.abstract_state(init_wide)
    ckpt = Checkpointer(directory)
    restored = ckpt.restore(plan3, like=like)
    assert ckpt.last_restore == RestoreInfo(step=2, verified=True)
    assert array_checksums(restored) == array_checksums(ckpt.restore(plan, like=step.abstract_state(init_wide)))
    half = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16 if x.dtype == jnp.float32 else x.dtype,
                                                       sharding=x.sharding), like)
    low = ckpt.restore(plan3, like=half)
    assert low.params["w1"].dtype == jnp.bfloat16 and ckpt.last_restore.verified
    np.testing.assert_array_equal(np.asarray(low.params["w1"]), states[2].params["w1"].astype(jnp.bfloat16))


def test_array_checksum_sees_one_word_and_ignores_layout():
    import shardkit as sk

    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    sums = set()
    for spec in ("data=8", "fsdp=4,tensor=2"):
        mesh = sk.make_mesh(spec)
        for pspec in (P(), P(mesh.axis_names[0]), P(None, mesh.axis_names[-1])):
            sums.add(array_checksums({"x": jax.device_put(x, NamedSharding(mesh, pspec))})["x"])
    assert len(sums) == 1
    y = x.copy()
    y.view(np.uint32)[17, 3] ^= 1  # one bit
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # same values, other places
    for other in (y, swapped, x.astype(jnp.bfloat16)):
        assert array_checksums({"x": jnp.asarray(other)})["x"] not in sums


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_processes_checksum_their_shards_and_fall_back_together(tmp_path):
    """2 processes x 4 devices save (each hashes only its shards), 1 process verifies on another
    layout; after a flip in a chunk process 1 wrote, both processes fall back to step 1."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ckpt, go, err = tmp_path / "ckpt", tmp_path / "restore-now", tmp_path / "stderr.txt"
    # One job for both halves (one start-up of three interpreters): it saves, waits for `go`
    # while this test verifies and damages the steps, then restores on both processes.
    with open(err, "w") as stderr:
        proc = subprocess.Popen(["timeout", "-s", "KILL", "240", sys.executable, "-m", "shardkit.cli", "launch",
                                 "--processes", "2", "--devices-per-process", "4", "--", sys.executable,
                                 os.path.join(SCRIPTS, "ckpt_mp.py"), "--save", str(ckpt), "--wait-for", str(go),
                                 "--restore", str(ckpt)],
                                stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=root, env=env)
    try:
        saved = set()
        for line in proc.stdout:
            saved |= {p for p in (0, 1) if line.startswith(f"[{p}] saved process {p}")}
            if saved == {0, 1}:
                break
        assert saved == {0, 1}, err.read_text()[-3000:]
        _verify_and_damage(ckpt)
    finally:
        go.touch()
        out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, err.read_text()[-3000:]
    for p in (0, 1):
        assert f"restored 1 skipped [2] verified True position 1 process {p}" in out, out


def _verify_and_damage(tmp_path):
    """The two-process save restored here on another layout, verified; then a flip in a chunk
    process 1 wrote, named by its block on the saved layout."""
    plan, step = tiny.make_step("data=8", zero=0)
    ckpt = Checkpointer(tmp_path)
    ckpt.restore(plan, like=step.abstract_state(init_wide))
    assert ckpt.all_steps() == [1, 2] and ckpt.last_restore.verified
    path, offset, length = _chunk(tmp_path / "2" / "state", b"params.w1/7.0")  # rows 14-15: process 1's
    assert "ocdbt.process_1" in path
    _flip(path, offset + length // 2)
    with pytest.raises(CorruptCheckpointError, match="params/w1: checksum mismatch"):
        Checkpointer(tmp_path).restore(plan, like=step.abstract_state(init_wide))
    plan8, step8 = tiny.make_step("fsdp=8", zero=3)  # the saved layout: the damaged block is named
    with pytest.raises(CorruptCheckpointError, match=r"params/w1: checksum mismatch in block \[14:16,0:512\]"):
        Checkpointer(tmp_path).restore(plan8, like=step8.abstract_state(init_wide))


@pytest.mark.slow
def test_recipe_resume_skips_a_corrupt_step_and_continues_bit_identically(tmp_path, caplog,
                                                                           older_emitters_ahead_of_time):
    """The user's report: 64 bytes flipped in the middle of step 6's largest data file. --resume
    restores step 3 instead, says so, and the resumed losses equal the uninterrupted run's.
    The flips go at a quarter, half and three quarters of the file: in one fresh-clone suite
    run (2026-11-28, both workers busy) a single flip in the middle went unnoticed and step 6
    restored - most likely bytes no restore reads (OCDBT appends b-tree nodes to its data files
    and supersedes earlier ones); a flip in data that is read is always reported (the resumed
    losses below would also differ)."""
    from models.transformer.train import main

    ckpt = tmp_path / "ckpt"
    flags = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "16", "--eval-every", "0",
             "--quiet", "--steps", "6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"]
    assert main(flags + ["--metrics-out", str(tmp_path / "a.jsonl")]) == 0
    data = ckpt / "6" / "state" / "ocdbt.process_0" / "d"
    largest = max(data.iterdir(), key=lambda f: f.stat().st_size)
    for quarter in (1, 2, 3):
        _flip(largest, largest.stat().st_size * quarter // 4)
    evidence = _fingerprint(ckpt / "6")
    with caplog.at_level(logging.WARNING, logger="shardkit.checkpoint"):
        assert main(flags + ["--resume", "--metrics-out", str(tmp_path / "b.jsonl")]) == 0
    assert "checkpoint step 6" in caplog.text and "is corrupt" in caplog.text
    assert "restored checkpoint step 3" in caplog.text and "not saving step 6" in caplog.text
    assert _fingerprint(ckpt / "6") == evidence

    def losses(name):
        return [json.loads(line)["loss"] for line in open(tmp_path / name) if '"loss"' in line]

    assert losses("b.jsonl") == losses("a.jsonl")[3:]


def test_combine_names_a_block_one_host_read_differently():
    """Each host hashes its own copy of a replicated block; a copy that differs from the first
    is reported even when the first copy (the one summed into the total) is right."""
    from shardkit.checkpoint.checksums import _combine

    # 4 devices on 2 processes holding 2 blocks, each block on both processes.
    layout = (("0:2", True, True, 0), ("2:4", True, True, 0), ("0:2", False, True, 1), ("2:4", False, True, 1))
    rows = np.array([[1, 2], [3, 4], [1, 2], [3, 4]], np.uint32)
    same = _combine(layout, rows)
    assert same.total == f"{4:08x}{6:08x}" and same.blocks == {"0:2": f"{1:08x}{2:08x}", "2:4": f"{3:08x}{4:08x}"}
    assert same.disagreements == ()
    rows[3] = [3, 5]
    assert _combine(layout, rows).disagreements == ("block [2:4] as read by process 1",)
    assert _combine(layout, rows).total == same.total
