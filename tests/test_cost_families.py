"""The analytic estimate on model families it was not written against (``families.py``): a
Python-loop MLP with an embedding lookup, a CNN, a scanned GPT written against
``sk.constrain``; on DP, ZeRO-1/2/3, TP and a 3-axis hybrid.

Every figure the estimate prints is within 10% of the compiled program's, or its row carries
the estimate's own caveat (``Report.comparison()[i]["caveat"]``: what XLA decides that the model
cannot see) — a "not modelled" row, which the report prints as the reason instead of a number —
and then it stays within the bound stated below for that layout, so that a gap cannot grow
unnoticed, and on the side its caveat names ("a lower bound" never over-estimates).
"""

import pytest

import families as F

TOL = 0.10
# (family, mesh, zero) -> {quantity: tolerance} for rows the estimate marks with a caveat
# (the measured ratio in the comment).
CAVEAT_BOUNDS = {
    ("cnn", "data=8", 3): {"collective/other": 1.0},  # 1 KiB vs 0
    ("moe", "data=8", 3): {"memory/temporaries": 0.25, "memory/peak": 0.25},  # 0.77, 0.80
    ("moe", "tensor=8", 0): {"memory/temporaries": 0.25, "memory/peak": 0.25, "flops": 0.2},  # 0.78, 0.79, 0.90
    ("moe", "fsdp=2,expert=4", 3): {"memory/temporaries": 0.2, "memory/peak": 0.2},  # 0.83, 0.85
}


CASES = [(f, mesh, zero, None) for f in F.FAMILIES for mesh, zero in F.LAYOUTS] + [
    ("moe", mesh, zero, None) for mesh, zero in F.EXPERT_LAYOUTS] + [
    # The program reader's rule for what XLA:CPU materialises for a reduction was found
    # on the MLP's tensor=8 step at 32 rows (0.77 -> 0.93); held here at 8x the batch too
    # (0.88 -> 1.07, the hybrid 0.87 -> 0.97).
    ("mlp", "tensor=8", 0, 256), ("mlp", "data=2,fsdp=2,tensor=2", 1, 256)]


@pytest.mark.slow
@pytest.mark.parametrize("family,mesh,zero,rows", CASES)
def test_estimate_holds_on_unseen_families(family, mesh, zero, rows):
    step, state, batch = F.build(family, mesh, zero, rows=rows)
    report = step.explain(state, batch)
    bounds = CAVEAT_BOUNDS.get((family, mesh, zero), {})
    bad = []
    text = None
    for row in report.comparison():
        q, est, comp, caveat = row["quantity"], row["estimate"], row["compiled"], row["caveat"]
        if est == 0 and comp == 0:
            continue
        ratio = est / comp if comp else float("inf")
        if abs(ratio - 1) <= TOL:
            continue
        where = f"{q}: estimate {est:,.0f} compiled {comp:,.0f} ratio {ratio:.3f}"
        if caveat is not None and caveat.startswith("not modelled"):
            # Beyond 10%, the report must print the reason, not the number.
            text = text or report.render(width=250)
            if not _footnoted(text, q, caveat):
                bad.append(f"{where}: not modelled, yet the report does not say so")
        if caveat is None:
            bad.append(f"{where}, not within {TOL:.0%} and not marked as a bound")
        elif abs(ratio - 1) > bounds.get(q, TOL):
            bad.append(f"{where}, beyond its stated bound {bounds.get(q, TOL):.0%} ({caveat})")
        elif caveat.startswith("a lower bound") and ratio > 1 + TOL:
            bad.append(f"{where}: marked a lower bound, yet over-estimates")
        elif caveat.startswith("an upper bound") and ratio < 1 - TOL:
            bad.append(f"{where}: marked an upper bound, yet under-estimates")
    assert not bad, f"{family} on {mesh} ZeRO-{zero}\n" + "\n".join(bad)


def _footnoted(text: str, quantity: str, caveat: str) -> bool:
    """Whether the rendered report prints ``caveat`` under ``quantity``: a caveat shared by rows
    prints once, after their names ("memory/temporaries, memory/peak: <caveat>")."""
    return any(quantity in line[:line.index(f": {caveat}")].split(", ")
               for line in text.splitlines() if f": {caveat}" in line)


def test_a_gradient_reduced_split_over_tensor_then_permuted_counts_as_the_reduction(older_emitters_ahead_of_time):
    # Issue 36: on data=2,tensor=4 the embedding's scatter-add gradient and the head's weight
    # gradient are computed split over tensor, all-reduced over data, then carried to their ZeRO
    # shard by a collective-permute (pairs crossing data and tensor). The permute is part of the
    # gradient reduction (compiled grad-reduce = the estimate's bytes reduced), not "other".
    # (The H100/v5p compiles of the families hold the same: bench/cost_bands.py.)
    step, state, batch = F.build("mlp", "data=2,tensor=4", 1, rows=8, d=16, h=64, vocab=32, blocks=1)
    report = step.explain(state, batch)
    carried = [t for t in report.traffic if t.kind == "collective-permute"]
    assert carried and report.roles()["other"] == 0, report.traffic
    row = next(r for r in report.comparison() if r["quantity"] == "collective/grad-reduce")
    assert row["compiled"] == pytest.approx(row["estimate"], rel=0.01)
    assert all((t.after, t.after_axes) == ("all-reduce", ("data",)) for t in carried), report.traffic


def test_report_marks_bounded_rows():
    # The MLP on tensor=8: the temporaries are approximate (XLA's buffer reuse in a
    # tensor-parallel backward); the report says so beside the number, not just in a test.
    step, state, batch = F.build("mlp", "tensor=8", 0)
    report = step.explain(state, batch)
    rows = {r["quantity"]: r for r in report.comparison()}
    assert rows["memory/temporaries"]["caveat"].startswith("approximate")
    assert rows["memory/params"]["caveat"] is None
    for q in ("memory/temporaries", "memory/peak"):  # 0.77 and 0.81 before XLA:CPU's reductions were modelled
        assert rows[q]["estimate"] == pytest.approx(rows[q]["compiled"], rel=TOL)
    text = report.render(width=200)
    # Both rows share the caveat: the report prints it once, naming both (the shared footnote).
    caveat = rows["memory/temporaries"]["caveat"]
    assert rows["memory/peak"]["caveat"] == caveat
    assert "memory/temporaries, memory/peak: approximate" in text and "modelled?" in text


def test_flops_come_from_the_program_not_6psi(older_emitters_ahead_of_time):
    # The MLP's embedding table is 256x128 of its 0.6M parameters: a lookup, no matmul. 6Ψ
    # would count it; the traced program does not.
    step, state, batch = F.build("mlp", "data=8", 0)
    report = step.explain(state, batch)
    row = next(r for r in report.comparison() if r["quantity"] == "flops")
    assert row["estimate"] == pytest.approx(row["compiled"], rel=1e-3)
