"""Every recipe layout compiled by XLA:TPU (libtpu) for a TPU v5p slice of 8 chips without a
TPU (and the 4D layout on 16 chips, extended), with what each layout promises checked on that
program (``target_sweep.check``)."""
import pytest

import shardkit as sk
from target_sweep import (CASES_TPU, EXTENDED_TPU, check, check_hybrid_mlp, compile_sweep,
                          hybrid_mlp_params, params, require, schedule_memory_ratios, selected, small_step)

pytestmark = [pytest.mark.subprocess, pytest.mark.targets]


@pytest.fixture(scope="module")
def sweep(request):
    """The layouts and the README MLP's hybrid meshes, compiled in one subprocess."""
    require("tpu-v5p")
    return compile_sweep(selected(CASES_TPU, EXTENDED_TPU, request.config), "tpu-v5p", request.config)


@pytest.fixture(scope="module")
def v5p(sweep):
    return sweep[0]


@pytest.mark.parametrize("name", params(CASES_TPU, EXTENDED_TPU))
def test_layout_compiles_for_tpu_v5p_and_keeps_its_promises(name, v5p):
    check(name, CASES_TPU[name], v5p[name], "tpu-v5p")


@pytest.fixture(scope="module")
def v5p_mlp(sweep):
    return sweep[1]


@pytest.mark.parametrize("mesh,zero", hybrid_mlp_params())
def test_hybrid_meshes_reduce_the_gradients_as_the_zero_formulas_say(mesh, zero, v5p_mlp):
    """Issue 36 on XLA:TPU: one reduce-scatter (its all-reduce-scatter fusion) over the batch
    axes, or over the whole slice its all-reduce (``target_sweep.check_hybrid_mlp``)."""
    check_hybrid_mlp(mesh, zero, v5p_mlp[(mesh, zero)], "tpu-v5p")


def test_the_slice_and_the_compilers_own_estimate_are_reported(v5p):
    report = v5p["pp_zero3_zb_tp"]  # data=2,pipe=2,tensor=2: the 8 chips of a 2x2x2 slice
    assert "v5p:2x2x2: mesh axes laid onto the torus" in " ".join(report.notes)
    assert report.fits and report.device_memory == sk.cost.hardware.lookup("tpu-v5p").hbm_bytes
    # XLA:TPU's own time estimate counts a loop body once (or is -2: none): shown, not used.
    for r in v5p.values():
        if "xla_tpu_optimal" in r.seconds:
            assert r.seconds["xla_tpu_optimal"] > 0
            assert any("counts each loop body once" in n for n in r.notes)


def test_chip_counts_no_slice_has_and_unknown_targets_are_clear_errors():
    from shardkit.cost.compiled import targets

    with pytest.raises(sk.cost.TargetError, match="no TPU slice has 12 chips"):
        targets.tpu_topology(targets.get("tpu-v5p"), 12)
    with pytest.raises(sk.cost.TargetError, match="unknown target 'h800'.*h100"):
        targets.get("h800")
    assert targets.tpu_topology(targets.get("tpu-v5p"), 64) == ("v5p:4x4x4", 1)
    assert targets.tpu_topology(targets.get("tpu-v5p"), 16) == ("v5p:2x2x4", 1)
    assert targets.tpu_topology(targets.get("tpu-v5p"), 4) == ("v5p:2x2x1", 1)  # libtpu refuses 1x2x2
    assert targets.tpu_topology(targets.get("tpu-v5e"), 512) == ("v5e:16x16", 2)


@pytest.mark.parametrize("target,topology", [
    ("tpu-v5e", "v5e:4x4"), pytest.param("tpu-v6e", "v6e:4x4", marks=pytest.mark.extended)])  # both 2-D tori
def test_the_other_tpu_targets_compile(target, topology):
    """TPU v5e and v6e slices of 16 chips (2-D tori); v4 is refused with the reason."""
    require(target)
    step, state, batch = small_step()
    (report,) = sk.cost.simulate_many([(step, state, batch, "data=8,tensor=2")], target=target)
    assert report.target == target and report.fits
    assert f"{topology}: mesh axes laid onto the torus" in " ".join(report.notes)
    with pytest.raises(sk.cost.TargetError, match="two devices per chip"):
        sk.cost.targets.get("tpu-v4")


@pytest.mark.extended
def test_gpipe_and_1f1b_hold_their_memory_formula_on_tpu_v5p():
    """Issue 25: ``test_targets_gpu``'s check of each schedule's estimated temporaries against
    the compiler's, on XLA:TPU for GPipe and 1F1B (measured 0.99 and 0.95; ZB-H1 0.94, ZB-V
    1.05, interleaved 1F1B 0.80: BENCHMARKS.md table (c))."""
    require("tpu-v5p")
    ratios = schedule_memory_ratios("tpu-v5p", (("gpipe", 1), ("1f1b", 1)))
    assert all(0.9 <= r <= 1.1 for r in ratios.values()), ratios


@pytest.mark.extended  # ~12 CPU s (one v5p compile); the moved form it keeps is compiled by cp_tp_pp /
# cp_tp_pp_16 here (extended too): no default-lane case compiles context in a TPU pipeline branch
def test_xla_tpu_still_refuses_the_context_ring_nested_in_a_pipeline_branch(monkeypatch):
    """Issue 37: the context ring nested in an explicit schedule's per-stage branch, forced on
    XLA:TPU (``context.py`` picks ``_context_tpu_nested``'s compiler-moved form there), is still
    refused by libtpu's partitioner, so the workaround stays. When this fails, XLA:TPU compiles
    the ring there: drop the ``tpu_branch`` switch in ``context.py`` and rerun the sweep's
    cp_tp_pp / cp_pp cases (BENCHMARKS.md, "Scale")."""
    import shardkit.context
    from models.transformer.layouts import Layout
    from target_sweep import CFG, layout_step

    require("tpu-v5p")
    monkeypatch.setattr(shardkit.context, "branching_axis", lambda: None)  # the ring, not the moved form
    step, state, batch = layout_step(Layout("pipe=2,context=2,data=2", schedule="1f1b"), CFG, global_batch=16,
                                     target="tpu-v5p")
    (got,) = sk.cost.simulate_many([(step, state, batch, "pipe=2,context=2,data=2")], target="tpu-v5p")
    assert isinstance(got, Exception), "XLA:TPU compiled the nested ring: drop the workaround (see this docstring)"
    assert "PartitionId instruction is not supported for SPMD partitioning" in str(got), got
