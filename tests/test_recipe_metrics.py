"""TensorBoard scalars beside the JSON lines, and a jax.profiler trace of a window of steps."""

import gzip
import json

import pytest

from models.common.metrics import MetricsWriter, Profiler, read_scalars


def test_writer_and_reader_round_trip(tmp_path):
    w = MetricsWriter(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"))
    w.write({"replica_bytes_per_step": 3})  # no step: JSON lines only
    for i in range(3):
        w.write({"step": i, "loss": 2.0 - i, "per_expert": [1, 2], "final": True})
    w.close()
    assert read_scalars(str(tmp_path / "tb")) == {"loss": [(0, 2.0), (1, 1.0), (2, 0.0)]}
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 4
    off = MetricsWriter(str(tmp_path / "x.jsonl"), str(tmp_path / "tb2"), enabled=False)
    assert not off.active and not (tmp_path / "x.jsonl").exists()


@pytest.mark.parametrize("window", ["3", "5:5", "a:b", "-1:2"])
def test_bad_profile_window(window):
    with pytest.raises(ValueError, match="--profile-steps"):
        Profiler(window, "unused")


def test_recipe_run_writes_scalars_and_a_trace(tmp_path):
    """4 steps of a 1-layer transformer: TensorBoard holds every step's loss (equal to the JSON
    lines) and the validation loss, and the trace of steps 2-3 marks exactly those steps."""
    from models.transformer.train import main

    tb, metrics = tmp_path / "tb", tmp_path / "m.jsonl"
    assert main(["--layers", "1", "--d-model", "32", "--heads", "2", "--seq", "16", "--batch", "16",
                 "--steps", "4", "--eval-every", "0", "--quiet", "--mesh", "data=8", "--metrics-out", str(metrics),
                 "--tensorboard", str(tb), "--profile-steps", "2:4"]) == 0
    scalars = read_scalars(str(tb))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert scalars["loss"] == [(r["step"], pytest.approx(r["loss"])) for r in records if "loss" in r]
    assert [s for s, _ in scalars["val_loss"]] == [3] and [s for s, _ in scalars["mfu"]] == [0, 1, 2, 3]
    traces = list(tb.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    perfetto = json.loads(gzip.decompress(next(tb.glob("plugins/profile/*/perfetto_trace.json.gz")).read_bytes()))
    events = perfetto["traceEvents"] if isinstance(perfetto, dict) else perfetto
    steps = {str(e.get("args", {}).get("step_num")) for e in events if e.get("name") == "train"}
    assert steps == {"2", "3"}, steps


def test_resnet_profile_flag_is_checked(capsys):
    from models.resnet.__main__ import main

    assert main(["--profile-steps", "4:2"]) == 2  # before anything compiles
    assert "--profile-steps '4:2' is not A:B" in capsys.readouterr().err
