"""What a step estimate cannot see: the quantities whose figure is approximate or not modelled,
each with the reason (``Estimate.caveats``, shown by ``sk.Report`` beside the figure or instead
of it). Each was found comparing the estimate with the compiled step on a model family the
model was not written against (``tests/test_cost_families.py``, BENCHMARKS.md).
"""

from __future__ import annotations


# estimate / compiled temporaries on the rows that carry the tensor-parallel caveat below, per
# target: bench/cost_bands.py's compiles (bench/results/cost_bands.json; test_cost_bands.py
# holds this table to that file). XLA:TPU's low end: its reported temporaries hold more than
# the HBM buffers XLA:GPU reports for the same program (BENCHMARKS.md, issue 36).
TP_TEMPORARIES: dict[str, tuple[float, float]] = {"H100": (0.57, 0.98), "TPU v5p": (0.15, 1.24)}


def _measured(ranges: dict[str, tuple[float, float]]) -> str:
    return ", ".join(f"{lo:.2f} to {hi:.2f} on {where}" for where, (lo, hi) in ranges.items())


def step_caveats(reading, gathered: list[bool], tensor_split: list[bool], piped: bool, moe: bool,
                 data_axes: tuple[str, ...] = (), sequence_parallel: bool = False) -> dict[str, str]:
    """The quantities whose figure is approximate or not modelled, and why: choices XLA makes per
    program that the model cannot see (each seen on a model family the model was not written
    against). A "not modelled" quantity's figure still times the step, but ``sk.Report`` prints
    the reason instead of the number."""
    out = {"collective/other": "not modelled: permutes XLA adds to move blocks between two shardings"}
    if any(g and c for g, c in zip(gathered, reading.conv)):
        out["collective/param-gather"] = ("approximate: XLA decides how often to gather a convolution kernel "
                                          "(counted: once per convolution that reads it, the backward's "
                                          "input-gradient one reading it reversed; exact on the CNN family "
                                          "on H100, where XLA:TPU gathers each once, cast to bf16: 0.25x)")
    elif not piped and any(g and loop for g, loop in zip(gathered, reading.loop_use)):
        out["collective/param-gather"] = ("approximate: inside a loop XLA decides per weight how often to "
                                          "gather it for the backward (counted: forward + backward, once each; "
                                          "within 3% on the model families tried)")
    if not piped and reading.tensor_reduce and "memory/temporaries" not in out:
        why = ("approximate: XLA's schedule of a tensor-parallel backward is not modelled (it may update a "
               "parameter as soon as its gradient is ready and keep a copy of one still to be read; "
               f"{_measured(TP_TEMPORARIES)} of the compiled temporaries on the model families' layouts)")
        out["memory/temporaries"] = out["memory/peak"] = why
    if (reading.weight_shard_maps or moe) and not piped:
        # A shard_map that takes weights (sk.moe, a user's own layer) is partitioned by hand
        # inside; around it XLA decides where weights are gathered and kept and where
        # tensor-split values meet. An attention kernel's shard_map takes activations only.
        region = "a shard_map's (sk.moe's) weights"
        if any(tensor_split) and not reading.split_followed:
            out["collective/tensor-reduce"] = (f"not modelled: the reductions XLA places around {region} when "
                                               "they are tensor-split (only the matmuls outside are counted)")
        if any(tensor_split):
            why = f"not modelled: how XLA partitions {region} over the tensor axes"
            for q in ("memory/temporaries", "memory/peak", "flops"):
                out[q] = why
        if any(gathered):
            why = f"not modelled: how long XLA keeps {region} gathered (ZeRO-3/FSDP) for the backward"
            for q in ("collective/param-gather", "memory/temporaries", "memory/peak"):
                out[q] = why
    if any(t and c for t, c in zip(tensor_split, reading.conv)):
        out["collective/tensor-reduce"] = ("approximate: one reduction per convolution that contracts "
                                           "tensor-split channels is counted (exact on the CNN family)")
    split_dots = [t and m and not c for t, m, c in zip(tensor_split, reading.matmul, reading.conv)]
    if not piped and not sequence_parallel and any(split_dots) and not reading.tensor_reduce:
        # The reader places a tensor-parallel reduction where a matmul contracts a split
        # feature, by the weights' specs where it can follow them (``program``), else by sizes,
        # which find none when an activation is as wide as a split weight dimension (HF GPT-2's
        # attention projection, d_model = heads x head_dim, read so: 0 vs 1.2 MB on H100).
        why = ("not modelled: tensor-split weights, yet no tensor-parallel reduction could be placed (an "
               "activation as wide as a split weight dimension reads as split)")
        out["collective/tensor-reduce"] = out["flops"] = why
    if not piped and any(g and m for g, m in zip(gathered, reading.moved)):
        # ResNet-18 at 16x16, ZeRO-3 on 8 H100s: grad-reduce and param-gather 0.03x and 0.02x of
        # the estimate, temporaries 0.1x (``gather_or_move``).
        why = ("not modelled: some ZeRO-3/FSDP-sharded weights are larger than the activations they "
               "multiply; XLA may gather those activations instead and keep the weight and its gradient "
               "sharded (the figure assumes the weights are gathered)")
        for q in ("collective/param-gather", "collective/grad-reduce", "memory/temporaries", "memory/peak"):
            out[q] = why
    if not piped and any(t and m for t, m in zip(tensor_split, reading.moved)):
        # The same choice over the tensor axes: flaxmodels' ResNet-18 at 16x16 with its kernels'
        # output channels split, on tensor=8 and the hybrids of 8 H100s and 8 v5p chips: 320 B of
        # tensor reductions placed where XLA moves 0.15-0.62 MB of activations (tensor-reduce and
        # tensor-gather), its flops 0.27-0.99 of the compile, and those kernels' gradients reduced
        # over data in XLA's own layout (grad-reduce 0.69-0.87, exact without tensor).
        why = ("not modelled: some tensor-split weights are larger than the activations they multiply; "
               "XLA may move those activations between the tensor devices instead of reducing partial "
               "sums, and splits their work and their gradients' reduction its own way (the figures "
               "assume the reductions)")
        for q in ("collective/tensor-reduce", "collective/tensor-gather", "flops", "collective/grad-reduce"):
            out[q] = why
    if not piped:
        out.update(unseen_caveats(reading, data_axes, moe))
    if reading.ragged:
        out.setdefault("collective/expert-all-to-all", (
            "a bound: sk.moe's dropless ragged-all-to-alls counted at their routed side's static size "
            "(every assignment sent; how many rows leave the device is data-dependent), as the compiled "
            "figure counts them"))
    return out


# What each thing the program reader cannot see leaves unmodelled (``ProgramReading.unseen``).
_UNSEEN = {
    # A custom call or Pallas kernel other than those the reader models (sk.attention's Triton and
    # Mosaic flash kernels: ``program.flash``; sk.moe's grouped matmuls): cuDNN's attention on a
    # real GPU, a user's own kernel.
    "kernel": ("flops", "memory/temporaries", "memory/peak"),
    "while": ("flops",),
    # A recurrence keeps its carries per step for the backward, and XLA decides how to lay
    # out and reuse them: found on a scanned RG-LRU (recurrentgemma), peak 0.5x compiled.
    "recurrence": ("memory/temporaries", "memory/peak"),
    # lax.ragged_dot run densely (XLA:CPU, XLA:GPU; XLA:TPU's weight gradient): its G-fold masked
    # copies are counted where the jaxpr makes them, but XLA decides which it keeps from the
    # forward into the backward (sk.moe's dropless dispatch on 8 H100s, data=2,expert=4: the
    # masked copy of the expert MLP's hidden rows kept, the routed rows' re-made; peak 0.5x).
    "masked": ("memory/temporaries", "memory/peak"),
    # A slice or concatenation along a dim split over part of the tensor axis (rotary embeddings
    # over a head dim split between devices): XLA's all-to-alls and permutes, found on Griffin
    # at tensor=8 with 4 heads (30 ops).
    "relayout": ("collective/other",),
    # Fewer heads than tensor devices: the gathers around the per-head reductions XLA
    # reduce-scatters (Griffin at tensor=8: 7 gathers, 144 KB, none modelled).
    "head-spill": ("collective/tensor-gather",),
}


def unseen_caveats(reading, data_axes: tuple[str, ...], moe: bool = False) -> dict[str, str]:
    """``not modelled`` caveats for what the program holds that the model cannot see: opaque
    kernels, loops without a trip count, recurrences inside layers, and collectives a
    ``shard_map`` writes over axes the formulas do not attribute (only ``context`` rings and
    ``expert`` all-to-alls are read off the program; the rest would go uncounted). ``moe``: the
    program runs ``sk.moe``, whose own reductions over the data axes (its dispatch inside
    ``shard_map``) XLA folds into the gradient reduction (grad-reduce within 0.1% on the MoE
    family): not flagged."""
    out = {}
    for kind, what in reading.unseen.items():
        for q in _UNSEEN[kind]:
            out[q] = f"not modelled: {what}"
    for (kind, axes), (n, nbytes) in reading.explicit.items():
        if not axes or "context" in axes or "expert" in axes or not nbytes or (moe and set(axes) <= set(data_axes)):
            continue
        if set(axes) <= set(data_axes):
            role = "param-gather" if kind == "all-gather" else "grad-reduce"
        elif kind in ("all-reduce", "reduce-scatter", "all-gather"):
            role = "tensor-gather" if kind == "all-gather" else "tensor-reduce"
        else:
            role = "other"
        out[f"collective/{role}"] = (f"not modelled: a shard_map's own {kind} over {', '.join(axes)} "
                                     f"({n:g} per microbatch; the formulas do not count it)")
    return out
