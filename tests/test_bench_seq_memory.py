"""``python bench/seq_memory.py --dry-run``: the points the 7B memory-vs-sequence bench compiles
and their ModelShape estimates, at a tiny size (nothing traced or compiled), so the command
cannot rot between the runs that compile (notebooks/08 reads what those wrote)."""


import pytest
import repo_files


def _bench():
    return repo_files.load("bench/seq_memory.py", "seq_memory_bench")


def test_dry_run_points_and_estimates():
    bench = _bench()
    points = bench.main(["--dry-run", "--size", "test", "--seq", "128", "256", "--target", "h100",
                         "--devices", "8", "--context", "2"])
    by = {(p["cp"], p["seq"]): p for p in points}
    assert sorted(by) == [(False, 128), (False, 256), (True, 128), (True, 256)]
    assert by[(False, 128)]["mesh"] == "data=8" and by[(False, 128)]["global_batch"] == 8
    assert by[(True, 128)]["mesh"] == "data=4,context=2" and by[(True, 128)]["global_batch"] == 4
    assert all(p["compiled"] is None for p in points)
    act = {k: p["model_shape"]["activations"] for k, p in by.items()}
    # one sequence a device without CP, one per 2 devices with it: half the tokens a device
    assert act[(False, 128)] == pytest.approx(2 * act[(True, 128)])
    assert act[(False, 256)] == pytest.approx(2 * act[(False, 128)])  # flash: linear in the sequence


def test_context_must_divide_devices(capsys):
    with pytest.raises(SystemExit):
        _bench().parse_args(["--devices", "8", "--context", "3"])
    assert "--context 3 does not divide --devices 8" in capsys.readouterr().err
