"""Run configs: TOML values under command-line flags, the resolved config written beside the
checkpoints, and a run reproduced from its directory. The one recipe run here also carries the
tokenizer, TensorBoard and profiler flags (one compile for all of them)."""

import gzip
import json
import tomllib

import numpy as np
import pytest

from models.common import runconfig
from models.transformer.train import parser


def test_config_values_and_command_line_precedence(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('mesh = "data=4,tensor=2"\nsteps = 50\nlr = 1\nwarmup-steps = 5\ndecay = "linear"\n'
                   "sequence_parallel = false\nquiet = true\n")
    args = runconfig.parse(parser(), ["--config", str(cfg), "--steps", "7"])
    assert (args.mesh, args.steps, args.lr, args.warmup_steps, args.decay) == ("data=4,tensor=2", 7, 1.0, 5, "linear")
    assert args.sequence_parallel is False and args.quiet is True and args.batch == 16  # a default
    path = runconfig.write(args, str(tmp_path / "run"))
    written = tomllib.loads(open(path).read())
    assert written["steps"] == 7 and written["lr"] == 1.0 and "config" not in written and "data" not in written
    again = runconfig.parse(parser(), ["--config", path])
    assert vars(again) == {**vars(args), "config": path}


@pytest.mark.parametrize("text, message", [
    ("stepz = 5", "unknown key 'stepz'"),
    ('steps = "ten"', "steps = 'ten': must be an integer"),
    ("quiet = 1", "must be true or false"),
    ("lr = [1, 2]", "not a table or list"),
    ("steps = ", "not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, capsys, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text + "\n")
    with pytest.raises(SystemExit):
        runconfig.parse(parser(), ["--config", str(cfg)])
    assert message in capsys.readouterr().err


def test_resnet_config_errors_are_one_line(tmp_path, capsys):
    from models.resnet.__main__ import main

    (tmp_path / "r.toml").write_text('optimizer = "lamb"\n')
    assert main(["--config", str(tmp_path / "r.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optimizer = 'lamb': must be one of sgd, adamw" in err


def _traced_steps(directory) -> set[str]:
    """The step numbers the Perfetto trace under ``directory`` marks as ``train`` steps."""
    perfetto = json.loads(gzip.decompress(next(directory.glob("plugins/profile/*/perfetto_trace.json.gz")).read_bytes()))
    events = perfetto["traceEvents"] if isinstance(perfetto, dict) else perfetto
    return {str(e.get("args", {}).get("step_num")) for e in events if e.get("name") == "train"}


def test_a_window_the_run_ends_inside_is_closed_with_it(tmp_path):
    """--profile-steps 1:9 on a 3-step run: the recipe's ``profiler.close()`` stops the trace
    after the last step, waiting for its outputs, and the trace marks steps 1 and 2."""
    import jax.numpy as jnp

    from models.common.metrics import Profiler

    profiler, x = Profiler("1:9", str(tmp_path)), jnp.zeros(4)
    for i in range(3):
        with profiler.step(i):
            x = x + i
        profiler.after(i, x)
    assert profiler._active  # the window runs past the last step
    profiler.close(x)
    assert _traced_steps(tmp_path) == {"1", "2"}


def test_a_window_ending_with_the_run_stops_after_its_last_step(tmp_path):
    """--profile-steps 1:3 on a 3-step run: the trace stops right after step 2's outputs
    are computed (``Profiler.after``), before the run's final evaluation and checkpoint."""
    import jax.numpy as jnp

    from models.common.metrics import Profiler

    profiler, x = Profiler("1:3", str(tmp_path)), jnp.zeros(4)
    for i in range(3):
        with profiler.step(i):
            x = x + i
        profiler.after(i, x)
    assert not profiler._active  # stopped before anything that follows the loop
    assert _traced_steps(tmp_path) == {"1", "2"}


@pytest.mark.slow
def test_a_run_with_everything_and_its_reproduction(tmp_path):
    """One 4-step run with a SentencePiece tokenizer, TensorBoard, a profiler window and a
    schedule; then `--config <run>/config.toml` with new output paths.

    - tokens: the vocab follows the tokenizer (500 → 512 padded): the first loss is about
      ln 512 ≈ 6.2 nats, not ln 256; the text was tokenised once into two token files;
    - TensorBoard holds every step's loss, equal to the JSON lines, and the validation loss;
      the trace of steps 1-2 marks exactly those steps (a window that closes before the
      run's last step: one ending with the run would also trace the final evaluation's and
      checkpoint's compiles, 25 of the test's CPU seconds; closing at the end is checked by
      test_a_window_the_run_ends_inside_is_closed_with_it);
    - the reproduction gives the same losses bit for bit and the same resolved config but
      for the paths changed.
    """
    from models.common.metrics import read_scalars
    from models.transformer.train import main

    sentencepiece = pytest.importorskip("sentencepiece")
    from models.transformer import data as data_lib

    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(data_lib.stdlib_corpus(max_bytes=1 << 20)[0][:200_000]))
    sentencepiece.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "sp"), vocab_size=500,
                                             model_type="bpe", byte_fallback=True, minloglevel=2)
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["--tokenizer", str(tmp_path / "sp.model"), "--data", str(text), "--token-dir", str(tmp_path / "tok"),
                 "--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "8", "--steps", "4",
                 "--mesh", "data=4,tensor=2", "--lr", "5e-3", "--decay", "linear", "--warmup-steps", "1",
                 "--eval-every", "0", "--quiet", "--checkpoint-dir", str(a), "--metrics-out", str(tmp_path / "a.jsonl"),
                 "--tensorboard", str(tmp_path / "tb"), "--profile-steps", "1:3"]) == 0
    records = [json.loads(line) for line in open(tmp_path / "a.jsonl")]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and abs(losses[0] - np.log(512)) < 0.3
    assert sorted(p.name.split(".", 1)[1] for p in (tmp_path / "tok").iterdir()) == ["train.u16", "val.u16"]

    scalars = read_scalars(str(tmp_path / "tb"))
    assert scalars["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records if "loss" in r]
    assert [s for s, _ in scalars["val_loss"]] == [3] and [s for s, _ in scalars["mfu"]] == [0, 1, 2, 3]
    traces = list((tmp_path / "tb").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert _traced_steps(tmp_path / "tb") == {"1", "2"}

    assert main(["--config", str(a / "config.toml"), "--checkpoint-dir", str(b), "--tensorboard", str(tmp_path / "tb2"),
                 "--metrics-out", str(tmp_path / "b.jsonl")]) == 0
    again = [json.loads(line)["loss"] for line in open(tmp_path / "b.jsonl") if '"loss"' in line]
    assert again == losses
    first, second = (tomllib.loads((d / "config.toml").read_text()) for d in (a, b))
    assert {k for k in first if first[k] != second[k]} == {"checkpoint-dir", "metrics-out", "tensorboard"}
    assert first["tokenizer"] == str(tmp_path / "sp.model") and first["decay"] == "linear"
    assert sorted(p.name for p in b.iterdir()) == ["4", "config.toml"]
