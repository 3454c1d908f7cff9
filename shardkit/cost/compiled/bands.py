"""How far the analytic estimate has been from the compiled program, per quantity and target:
the error band ``sk.Report`` prints beside each estimated figure ("peak: 61.2 GiB (band
-8%..+15%, 40 layouts of 6 models, H100)").

A band is the range of ``estimate / compiled - 1`` over the model families and layouts that
``bench/cost_bands.py`` compiled for the target (the house families of ``tests/families.py``
and models installed from pip: ``tests/third_party_families.py``), rows the estimate marks
"not modelled" left out (they print their reason instead of a number). One family is kept out
of the fitting and its band is reported apart (``HELD_OUT``), so the bands can be checked on a
model they were not measured on. The tables below are written by
``python bench/cost_bands.py --write-bands``: re-measure, do not edit by hand.
"""

from __future__ import annotations

# target -> quantity -> (lowest, highest estimate/compiled - 1, layouts, models)
# --- measured: bench/cost_bands.py --write-bands ---
BANDS: dict[str, dict[str, tuple[float, float, int, int]]] = {
    'h100': {
        'collective/expert-all-to-all': (0.000, 0.000, 3, 1),
        'collective/grad-reduce': (-0.000, 0.221, 80, 7),
        'collective/param-gather': (-0.541, 0.053, 72, 7),
        'collective/tensor-gather': (-1.000, -1.000, 5, 1),
        'collective/tensor-reduce': (-0.111, 0.000, 36, 6),
        'flops': (-0.242, 0.171, 82, 7),
        'memory/peak': (-0.311, 0.090, 68, 6),
        'memory/temporaries': (-0.432, 0.143, 68, 6),
    },
    'tpu-v5p': {
        'collective/expert-all-to-all': (0.000, 0.000, 3, 1),
        'collective/grad-reduce': (-0.086, 0.160, 69, 7),
        'collective/param-gather': (-0.303, 2.953, 64, 7),
        'collective/tensor-gather': (-1.000, -1.000, 5, 1),
        'collective/tensor-reduce': (-0.111, 0.012, 34, 6),
        'flops': (-0.036, 0.171, 68, 7),
        'memory/peak': (-0.848, 0.181, 59, 6),
        'memory/temporaries': (-0.856, 0.242, 59, 6),
    },
}
HELD_OUT: dict[str, dict[str, tuple[float, float, int, int]]] = {
    'h100': {
        'collective/grad-reduce': (-0.000, 0.167, 12, 1),
        'collective/param-gather': (-0.253, 0.000, 11, 1),
        'collective/tensor-reduce': (-0.077, 0.000, 6, 1),
        'flops': (0.002, 0.216, 13, 1),
        'memory/peak': (-0.363, -0.017, 13, 1),
        'memory/temporaries': (-0.414, -0.018, 13, 1),
    },
    'tpu-v5p': {
        'collective/grad-reduce': (-0.018, 0.138, 12, 1),
        'collective/param-gather': (-0.241, 0.032, 11, 1),
        'collective/tensor-reduce': (-0.077, 0.000, 6, 1),
        'flops': (0.002, 0.216, 13, 1),
        'memory/peak': (-0.898, -0.431, 13, 1),
        'memory/temporaries': (-0.904, -0.433, 13, 1),
    },
}
HELD_OUT_FAMILY = 'bert'
# --- end ---

_NAMES = {"h100": "H100", "tpu-v5p": "TPU v5p", "cpu": "XLA:CPU"}


def band(target: str, quantity: str) -> tuple[float, float, int, int] | None:
    """``(low, high, layouts, models)`` of ``quantity`` (``sk.Report.comparison()``'s names) on
    ``target`` (``""``: simulated CPU devices), or None where it was not measured: the fitted
    families and the held-out one together — a user's model is one nobody fitted either."""
    fitted = BANDS.get(target or "cpu", {}).get(quantity)
    held = HELD_OUT.get(target or "cpu", {}).get(quantity)
    if fitted is None or held is None:
        return fitted
    return (min(fitted[0], held[0]), max(fitted[1], held[1]), fitted[2] + held[2], fitted[3] + held[3])


# A band whose low end is at or below this lets the estimate be a tenth of the compiled
# figure or less, down to nothing: it bounds nothing a reader could plan with.
UNBOUNDED_BELOW = -0.9


def _pct(x: float) -> str:
    v = round(x * 100)
    return f"{v:+d}%" if v else "0%"  # never "-0%"


def label(target: str, quantity: str) -> str | None:
    """The band as the report prints it: ``"band -8%..+15%, 40 layouts of 6 models, H100"``,
    and the held-out model's own range where one was measured. A band that bounds nothing (its
    low end at or under ``UNBOUNDED_BELOW``: the estimate has read a tenth of the compiled
    figure or less) is not printed as one: the label says so and why."""
    b = band(target, quantity)
    if b is None:
        return None
    low, high, layouts, models = b
    where = _NAMES.get(target or "cpu", target)
    if low <= UNBOUNDED_BELOW:
        return (f"no band: estimate / compiled - 1 measured {_pct(low)}..{_pct(high)} on {layouts} "
                f"layouts of {models} models ({where}), a range that bounds nothing; plan with the "
                "compiled figure")
    held = HELD_OUT.get(target or "cpu", {}).get(quantity)
    apart = f" (held out, {_pct(held[0])}..{_pct(held[1])})" if held and BANDS.get(
        target or "cpu", {}).get(quantity) else ""
    return f"band {_pct(low)}..{_pct(high)}, {layouts} layouts of {models} models{apart}, {where}"


# A peak estimated more than this fraction under the compiled one is always flagged (README).
FLAG_UNDER = 0.10


def underestimate(estimate: float, compiled: float, what: str = "peak") -> str | None:
    """The flag for an estimate more than ``FLAG_UNDER`` under its compiled figure, as every
    place that shows the two side by side prints it (``Report.comparison``, ``SearchResult``'s
    table, the notebooks): ``"under-estimate: 47% under the compiled peak; plan with the
    compiled figure"``; None when it is not (or either figure is missing)."""
    if not compiled or estimate is None or compiled != compiled or estimate != estimate:
        return None
    under = 1 - estimate / compiled
    if under <= FLAG_UNDER:
        return None
    return f"under-estimate: {under:.0%} under the compiled {what}; plan with the compiled figure"
