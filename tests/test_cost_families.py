"""The analytic estimate on model families it was not written against (``families.py``): a
Python-loop MLP with an embedding lookup, a CNN, a scanned GPT written against
``sk.constrain``; on DP, ZeRO-1/2/3, TP and a 3-axis hybrid.

Every figure the estimate prints is held to 10% of the compiled program's, except the gaps
listed in ``KNOWN_GAPS`` (what XLA decides that the model cannot see: when it re-gathers a
ZeRO-3 weight for the backward, where it keeps extra buffers in a tensor-parallel backward),
each held to its own stated bound so that it cannot grow unnoticed.
"""

import pytest

import families as F

TOL = 0.10
# (family, mesh, zero) -> {quantity: (tolerance, why it is not within 10%)}
KNOWN_GAPS = {
    ("mlp", "tensor=8", 0): {
        "memory/temporaries": (0.25, "XLA:CPU keeps more of a tensor-parallel backward alive than the liveness model"),
        "memory/peak": (0.25, "follows the temporaries")},
    ("mlp", "data=2,fsdp=2,tensor=2", 1): {
        "memory/temporaries": (0.15, "as for tensor=8, on a tensor axis of 2: 0.90 measured")},
    ("cnn", "data=8", 3): {
        "collective/param-gather": (0.55, "XLA gathers the kernels again for the backward convolutions (the "
                                          "MLP's it keeps): the estimate counts one gather per use, a lower bound"),
        "collective/other": (1.0, "a 1 KiB permute XLA adds to reorder one bias shard")},
    ("cnn", "tensor=8", 0): {"collective/tensor-reduce": (0.25, "a convolution's partial sums: one reduction more than counted")},
    ("cnn", "data=2,fsdp=2,tensor=2", 1): {"collective/tensor-reduce": (0.25, "as for tensor=8")},
    ("gpt", "data=8", 3): {"collective/param-gather": (0.25, "XLA keeps some gathered layers for the backward scan")},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(F.FAMILIES))
@pytest.mark.parametrize("mesh,zero", F.LAYOUTS)
def test_estimate_holds_on_unseen_families(family, mesh, zero):
    step, state, batch = F.build(family, mesh, zero)
    report = step.explain(state, batch)
    gaps = KNOWN_GAPS.get((family, mesh, zero), {})
    bad = []
    for row in report.comparison():
        q, est, comp = row["quantity"], row["estimate"], row["compiled"]
        if est == 0 and comp == 0:
            continue
        tol = gaps[q][0] if q in gaps else TOL
        ratio = est / comp if comp else float("inf")
        if abs(ratio - 1) > tol:
            bad.append(f"{q}: estimate {est:,.0f} compiled {comp:,.0f} ratio {ratio:.3f}")
    assert not bad, f"{family} on {mesh} ZeRO-{zero}\n" + "\n".join(bad)


def test_flops_come_from_the_program_not_6psi():
    # The MLP's embedding table is 256x128 of its 0.6M parameters: a lookup, no matmul. 6Ψ
    # would count it; the traced program does not.
    step, state, batch = F.build("mlp", "data=8", 0)
    report = step.explain(state, batch)
    row = next(r for r in report.comparison() if r["quantity"] == "flops")
    assert row["estimate"] == pytest.approx(row["compiled"], rel=1e-3)
