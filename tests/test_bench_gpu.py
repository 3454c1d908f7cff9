"""``python bench/gpu.py --dry-run``: the GPU benchmark's code paths at tiny sizes on one CPU
device, so the command cannot rot between the times a GPU is lent."""

import json
import logging

import jax
import pytest
import repo_files


@pytest.mark.slow
@pytest.mark.subprocess
def test_dry_run_writes_the_json_and_the_table(tmp_path, caplog, older_emitters_ahead_of_time):
    # explain()'s figures are read for being there (> 0), not for XLA:CPU's temporaries: the
    # older emitters ahead of time too (conftest.py), here and in the bench's pytest child
    # The script's main in this process (its __main__ only parses the flags first and calls it;
    # a subprocess would start JAX again for the same code); its dry run takes the first of the
    # 8 CPU devices. `pytest -m gpu` still runs as the bench runs it, in a subprocess: one of the
    # gpu-marked tests, the cheapest (the suite runs them all): the bench's pytest path, not its cost.
    bench = repo_files.load("bench/gpu.py", "gpu_bench")
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        assert bench.main(["--dry-run", "--tests-k", "bf16_precision", "--out-dir", str(tmp_path)]) == 0
    # The hand-written step compiles once: its second call compiled it again when the optimizer
    # state it started from was not on the params' mesh (on a GPU lease, the 125M model twice).
    assert sum(r.getMessage().startswith("Compiling jit(hand_step)") for r in caplog.records) == 1
    result = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    assert result["dry_run"] and result["device"] == "cpu (cpu)"
    assert result["tests"]["passed"] == 1 and result["tests"]["failed"] == 0
    t, r, o = result["transformer"], result["resnet"], result["overhead"]
    assert t["tokens_per_s"] > 0 and 0 < t["mfu_causal"] < t["mfu"] < 1 and t["attention"] == "reference"
    assert t["estimate_step_s"] > 0 and r["estimate_step_s"] > 0
    assert r["images_per_s"] == pytest.approx(r["batch"] / r["step_s"])
    assert o["shardkit_step_s"] > 0 and o["ratio"] == pytest.approx(o["shardkit_step_s"] / o["hand_step_s"])
    table = (tmp_path / "gpu-dry-run.md").read_text()
    assert "DRY RUN" in table and sum(line.startswith("|") for line in table.splitlines()) == 11  # head, rule, 9
    for row in ("transformer MFU", "ResNet-10 images/s", "sk.train_step vs hand-written jax.jit",
                "transformer step vs explain()", "tests -m gpu"):
        assert f"| {row} |" in table
