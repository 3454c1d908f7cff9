"""Run configs: TOML values under command-line flags, the resolved config written beside the
checkpoints, and a run reproduced from its directory."""

import json
import tomllib

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


def test_run_reproduced_from_its_directory(tmp_path):
    """3 steps; then `--config <run>/config.toml` with a new checkpoint directory: the same
    losses bit for bit, and the same resolved config but for the two paths changed."""
    from models.transformer.train import main

    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "8", "--steps", "3",
                 "--mesh", "data=4,tensor=2", "--lr", "5e-3", "--decay", "linear", "--warmup-steps", "1",
                 "--eval-every", "0", "--quiet", "--checkpoint-dir", str(a), "--metrics-out", str(tmp_path / "a.jsonl")]) == 0
    assert main(["--config", str(a / "config.toml"), "--checkpoint-dir", str(b),
                 "--metrics-out", str(tmp_path / "b.jsonl")]) == 0
    losses = lambda f: [json.loads(line)["loss"] for line in open(tmp_path / f) if '"loss"' in line]  # noqa: E731
    assert losses("b.jsonl") == losses("a.jsonl") and len(losses("a.jsonl")) == 3
    first, second = (tomllib.loads((d / "config.toml").read_text()) for d in (a, b))
    assert {k for k in first if first[k] != second[k]} == {"checkpoint-dir", "metrics-out"}
    assert sorted(p.name for p in b.iterdir()) == ["3", "config.toml"]
