"""Both recipes read batches through Grain: per-process rows that add up to the one-process
batch, positions that resume the exact stream, and a run interrupted on one process and
resumed on two that continues with the same batches and losses."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import shardkit_test_compile  # tests/_site, on sys.path through conftest.py

from models.resnet import data as resnet_data
from models.transformer import data as tf_data
from shardkit.distributed import launch_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _streams():
    tokens = np.arange(5000, dtype=np.uint16) % 251
    images = np.random.default_rng(0).standard_normal((40, 8, 8, 1)).astype(np.float32)
    labels = np.arange(40, dtype=np.int32) % 10
    return {
        "tokens": lambda **kw: tf_data.Batches(tokens, 8, 16, seed=5, **kw),
        "images": lambda **kw: resnet_data.Batches(images, labels, 8, seed=5, shift=1, **kw),
        "synthetic": lambda **kw: resnet_data.SyntheticBatches(8, (4, 4, 3), 10, seed=5, **kw),
    }


@pytest.mark.parametrize("name", ["tokens", "images", "synthetic"])
def test_process_rows_add_up_and_positions_resume(name):
    make = _streams()[name]
    one = make()
    whole = [next(one) for _ in range(12)]  # 40 images: three epochs, batches spanning two
    halves = [make(process_index=i, process_count=2) for i in range(2)]
    for step, batch in enumerate(whole[:6]):
        parts = [next(h) for h in halves]
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), batch[key])
    position = json.loads(json.dumps(halves[1].position))  # as a checkpoint stores it
    assert position == {"seed": 5, "grain": {"next_index": 6}}
    # one process's position resumes the stream on two processes, and the other way round
    resumed = [make(process_index=i, process_count=2, position=position) for i in range(2)]
    for batch in whole[6:]:
        parts = [next(r) for r in resumed]
        for key in batch:
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), batch[key])
    key = next(iter(whole[0]))
    np.testing.assert_array_equal(next(make(position=one.position))[key], make().batch_at(12)[key])
    with pytest.raises(tf_data.DataError, match="before the Grain loader"):
        make(position={"seed": 5, "step": 3})  # a position from the NumPy loaders
    with pytest.raises(tf_data.DataError, match="not a positive multiple of the 3 processes"):
        make(process_index=0, process_count=3)


def test_a_shuffled_epoch_visits_every_example_once():
    images = np.arange(24, dtype=np.float32).reshape(24, 1, 1, 1)
    it = resnet_data.Batches(images, np.zeros(24, np.int32), 8, seed=1)
    seen = np.concatenate([next(it)["image"].ravel() for _ in range(3)])
    assert sorted(seen.tolist()) == list(range(24)) and seen.tolist() != list(range(24))
    second = np.concatenate([next(it)["image"].ravel() for _ in range(3)])
    assert sorted(second.tolist()) == list(range(24)) and second.tolist() != seen.tolist()


TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "16",
        "--eval-every", "0", "--quiet"]


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path) if '"loss"' in line]


# flags, checkpoint every, steps, module, float32 tolerance. The transformer's one-process run is
# that of test_checkpoint.py's corrupt-step resume (and test_transformer.py's resume), so one
# compiles for both; the ResNet's (--extended) no longer matches test_resnet.py's resume, which
# now resumes that file's digits accuracy run instead.
RECIPES = {
    "transformer": (TINY, 3, 6, "models.transformer", 1e-6),
    "resnet": (["--depth", "10", "--width", "0.125", "--image-size", "16", "--batch", "32", "--eval-every", "0"],
               4, 8, "models.resnet", 1e-5),
}


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_interrupted_on_one_process_resumes_on_two(recipe, tmp_path, monkeypatch, capsys):
    """A run on one process saving every k steps; drop the last checkpoint (the interruption)
    and resume from the one before as a 2-process job (4 CPU devices each, the same 8-device
    mesh): the resumed steps see the same batches, so their losses match the uninterrupted run
    (to float32 rounding: Gloo sums across processes in another order)."""
    import importlib

    flags, every, steps, module, rtol = RECIPES[recipe]
    main = importlib.import_module(module + ".__main__").main
    ckpt = tmp_path / "ckpt"
    flags = flags + ["--steps", str(steps), "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every)]
    assert main(flags + ["--metrics-out", str(tmp_path / "one.jsonl")]) == 0
    shutil.rmtree(ckpt / str(steps))
    # `shardkit launch` run here: its two processes are the job; a launcher process of its own
    # would only import JAX again (~3 CPU s). --timeout ends a hung job (124), as `timeout` did.
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The two processes compile the recipe's step ahead of time (its memory line, not read
    # here) and train with it: with the emitters the tests run with (tests/_site), in fewer CPU
    # seconds; the one-process run above keeps the programs test_checkpoint.py's resume shares.
    monkeypatch.setenv(shardkit_test_compile.AS_RUN_ENV, "1")
    monkeypatch.chdir(ROOT)
    code = launch_main(["--processes", "2", "--devices-per-process", "4", "--timeout", "240", "--",
                        sys.executable, "-m", module, *flags, "--resume", "--metrics-out", str(tmp_path / "two.jsonl")])
    out = capsys.readouterr()
    assert code == 0, out.out[-2000:] + out.err[-3000:]
    resumed = _losses(tmp_path / "two.jsonl")
    assert len(resumed) == steps - every
    np.testing.assert_allclose(resumed, _losses(tmp_path / "one.jsonl")[every:], rtol=rtol)
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [every, steps]  # saved by both
