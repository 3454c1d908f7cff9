"""Every recipe layout compiled by XLA:GPU for H100s without a GPU (one host of 8, and two
hosts of 8 for the layouts whose outer axes cross hosts), with what each layout promises
checked on that program (``target_sweep.check``)."""
import pytest

import shardkit as sk
from target_sweep import (CASES_8, CASES_16, EXTENDED_H100, check, compile_cases, params, require, selected,
                          small_step)

pytestmark = [pytest.mark.subprocess, pytest.mark.targets]
CASES = {**CASES_8, **CASES_16}


@pytest.fixture(scope="module")
def h100(request):
    require("h100")
    return compile_cases(selected(CASES, EXTENDED_H100, request.config), "h100")


@pytest.mark.parametrize("name", params(CASES, EXTENDED_H100))
def test_layout_compiles_for_h100_and_keeps_its_promises(name, h100):
    check(name, CASES[name], h100[name], "h100")


def test_two_hosts_put_the_outer_axes_across_infiniband(h100):
    report = h100["hybrid_16"]
    assert "2 host(s) × 8 NVIDIA H100 80GB HBM3; axes across hosts: data" in " ".join(report.notes)
    assert report.device_memory == 84942979072  # the H100 SXM's memory as its driver reports it
    text = str(report)
    assert "16 × h100: XLA:GPU" in text and "fits" in text


def test_explain_with_a_target_compiles_this_step_for_it():
    """The README's call: ``step.explain(state, batch, mesh=..., target="h100")`` on a step
    planned on this process's 8 CPU devices."""
    require("h100")
    step, state, batch = small_step()
    report = step.explain(state, batch, mesh="data=8,tensor=2", target="h100")
    assert report.target == "h100" and report.fits
    assert report.memory["params"] == (64 * 256 * 2 * 4) // 16  # ZeRO-3: f32 params over 16 devices
    assert report.estimate and report.roles()["param-gather"] > 0
    assert {c.kind for c in report.collectives} >= {"all-gather", "reduce-scatter"}
    # Step time: the step-time model on the compiled flops and collectives, H100 figures.
    assert report.step_time["step"] >= report.step_time["compute"] > 0
    assert "step-time model" in report.step_time_source and "h100" in report.step_time_source


@pytest.mark.parametrize("target,device_memory", [
    pytest.param("h200", 151397597184, marks=pytest.mark.extended),  # sm_90, as the H100 sweep
    ("a100", 85100068864), ("b200", 191514411008)])
def test_the_other_gpu_targets_compile(target, device_memory):
    """H200, A100 (sm_80) and B200 (sm_100) from their shipped target configs, 2 hosts of 8."""
    require(target)
    step, state, batch = small_step()
    (report,) = sk.cost.simulate_many([(step, state, batch, "data=8,tensor=2")], target=target)
    assert report.target == target and report.fits and report.device_memory == device_memory
    assert "2 host(s) × 8" in " ".join(report.notes) and "reduce-scatter" in {c.kind for c in report.collectives}
