"""TensorBoard scalars beside the JSON lines, and a jax.profiler trace of a window of steps (a
recipe run writing both is in tests/test_recipe_config.py)."""

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


def test_resnet_profile_flag_is_checked(capsys):
    from models.resnet.__main__ import main

    assert main(["--profile-steps", "4:2"]) == 2  # before anything compiles
    assert "--profile-steps '4:2' is not A:B" in capsys.readouterr().err
