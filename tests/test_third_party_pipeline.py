"""examples/third_party_gpt2_pipeline.py: flaxmodels' GPT-2 blocks (a model written elsewhere,
stacked by the example's documented recipe) train through every pipeline schedule on pipe=2
and equal one device: two SGD steps, same losses and weights (fp32, 1e-5)."""

import jax
import numpy as np
import pytest
import repo_files

pytest.importorskip("flaxmodels")
example = repo_files.load("examples/third_party_gpt2_pipeline.py", "third_party_gpt2_pipeline")


@pytest.fixture(scope="module")
def reference():
    """The problem and its one-device training run (computed once for every schedule)."""
    with jax.numpy_rank_promotion("allow"):
        block, params, head, x, t = example.problem()
        want = example.train(block, lambda *a: example.sequential_loss(block, *a), params, head, x, t)
    return (block, params, head, x, t), want


@pytest.mark.parametrize("schedule,v", [
    # One schedule in the default lane (a GPT-2 pipeline compiles in ~16 s on 2 shared cores):
    # ZB-V, the one that takes every path (split backward, two chunks, both directions).
    pytest.param(s, v, marks=() if s == "zb-v" else pytest.mark.extended) for s, v in example.SCHEDULES])
def test_gpt2_blocks_train_through_the_schedule(devices, reference, schedule, v):
    import shardkit as sk

    (block, params, head, x, t), (want, want_p) = reference
    # conftest makes implicit rank promotion an error for our code; flaxmodels relies on it
    with jax.numpy_rank_promotion("allow"):
        mesh = sk.make_mesh("pipe=2", devices=devices[:2])
        got, got_p = example.train(block, example.pipelined_loss(block, schedule, v, mesh), params, head, x, t)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[1] < got[0]
    for g, w in zip(jax.tree.leaves(got_p), jax.tree.leaves(want_p)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
