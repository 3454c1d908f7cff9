"""Step time of a layout: collective times over the links a mesh axis spans, and the
achievable-efficiency model (matmul efficiency below peak, exposed communication, latency,
memory-bound kernels) that turns flops and collective bytes into seconds. ``from_shape.estimate``
and ``from_step`` call ``times``.

Sources: ring collective times and link regimes from the JAX scaling book ("How to Scale Your
Model"); the efficiency constants from published runs (``Efficiency``), checked against other
published runs by ``bench/published.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .. import hardware as hw_lib
from .pipeline_cost import layout_note, pipeline_bubble
from ..terms import STEP_ROLES
from .roles import grads_on_shard

if TYPE_CHECKING:
    from ..terms import Layout, ModelShape

# Link topology the hardware table does not carry: chips per fast-link domain (NVLink node /
# ICI slice) and per-collective-step latencies (intra, inter). Extend with ``register_links``.
LINKS: dict[str, tuple[int, float, float]] = {
    "h100": (8, 5e-6, 1.5e-5), "h200": (8, 5e-6, 1.5e-5), "a100": (8, 5e-6, 1.5e-5), "b200": (8, 5e-6, 1.5e-5),
    "h100-a3": (8, 5e-6, 1.5e-5),
    "tpu-v4": (4096, 2e-6, 5e-5), "tpu-v5e": (256, 2e-6, 5e-5), "tpu-v5p": (8960, 2e-6, 5e-5),
    "tpu-v6e": (256, 2e-6, 5e-5),
}


def register_links(name: str, node_size: int, intra_latency: float, inter_latency: float) -> None:
    """Sets a hardware entry's fast-link domain size and latencies for the cost model."""
    LINKS[name.lower()] = (int(node_size), float(intra_latency), float(inter_latency))


def links(hw) -> tuple[int, float, float]:
    return LINKS.get(hw.name.lower(), (8, 5e-6, 1.5e-5))


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """How far below the roofline a real training step runs on one kind of accelerator.

    A pure roofline (every matmul at dense peak, data-axis traffic fully hidden) predicts
    100% MFU for compute-bound layouts; published runs reach 41-48% (Megatron-LM's H100
    weak-scaling table, 2024), 33-39% (torchtitan, Llama-3.1-8B on 8 H100s, bf16), 52% (Megatron,
    1T parameters on 3072 A100s, Narayanan et al. 2021), 46.2% (PaLM, TPU v4, Chowdhery et al.
    2022) and 64-70% (MaxText, TPU v5p). The gap has these parts, each a number here (and the
    non-matmul kernels' memory traffic: ``memory_bound_time`` for a ``ModelShape``,
    ``roofline_excess`` over the kernels of a traced step or a compiled program — which, with
    ``matmul`` fitted beside the lighter formula, comes out ~10% pessimistic on transformers:
    BENCHMARKS.md, "The step time's roofline"):

    Attributes:
        matmul: fraction of dense peak the step's matmuls reach with no communication at all.
            H100: 0.52, fitted (``python bench/published.py --fit``, least squares in log step
            time) on the unpipelined rows of Megatron-LM's H100 table (1.7B-32B, fully
            specified, with ``memory_bound_time``); its pipelined rows and torchtitan's
            (power-capped H100s of unknown peak) are shown beside it, not fitted. A100: 0.60,
            set from the 1T run's 52% of peak plus a margin; that run is pipelined, and the
            formulas count ``sk.pipeline``'s pipeline traffic, not Megatron's, so it is not
            refitted. TPUs: set from PaLM's and MaxText's MFUs plus a margin, not checked.
            On published runs the constants never saw, unpipelined ones land 9% off on
            average with the memory-bound term (``bench/published.py``, BENCHMARKS.md).
        exposed_data: fraction of data-axis collective time (gradient reduction, ZeRO/FSDP
            gathers) left on the critical path although XLA's latency-hiding scheduler
            overlaps it with compute: the last layer's reduction and the first gather have
            nothing to hide behind, and overlapped collectives slow the kernels they share
            SMs / HBM with. The rest hides only behind compute (a comms-bound layout waits).
        exposed_tensor: same for tensor-parallel all-reduces / gathers: they sit between
            dependent matmuls (Megatron), so most of their time shows; TPUs' collective
            matmuls hide more.
        exposed_pipe: same for pipeline permutes and psums (point-to-point on the critical
            path between stages).
        latency: seconds each collective op pays to launch beyond its ring steps (kernel
            launch, NCCL/ICI setup).
    """

    matmul: float = 0.52
    exposed_data: float = 0.15
    exposed_tensor: float = 0.7
    exposed_pipe: float = 1.0
    latency: float = 2e-5


ROOFLINE = Efficiency(matmul=1.0, exposed_data=0.0, exposed_tensor=1.0, exposed_pipe=1.0, latency=0.0)
EFFICIENCY: dict[str, Efficiency] = {
    "h100": Efficiency(0.52, 0.15, 0.7, 1.0, 2e-5),  # fitted on Megatron-LM's H100 table
    "h100-a3": Efficiency(0.52, 0.15, 0.7, 1.0, 2e-5),
    "h200": Efficiency(0.52, 0.15, 0.7, 1.0, 2e-5),  # H100's compute; its faster HBM is memory_bound_time's
    "a100": Efficiency(0.60, 0.15, 0.7, 1.0, 2e-5),  # Megatron: 52% of peak, 1T params, 3072 A100s
    # No published B200 training run to fit yet: H100's figures, flagged as borrowed.
    "b200": Efficiency(0.52, 0.15, 0.7, 1.0, 2e-5),
    "tpu-v4": Efficiency(0.65, 0.10, 0.5, 1.0, 1e-5),  # PaLM 46.2% at 6144 chips
    "tpu-v5e": Efficiency(0.65, 0.10, 0.5, 1.0, 1e-5),
    "tpu-v5p": Efficiency(0.75, 0.10, 0.5, 1.0, 1e-5),  # MaxText 64-70% end to end
    "tpu-v6e": Efficiency(0.70, 0.10, 0.5, 1.0, 1e-5),
}


def register_efficiency(name: str, efficiency: Efficiency) -> None:
    """Sets the achievable-efficiency model of a hardware entry (see ``Efficiency``)."""
    EFFICIENCY[name.lower()] = efficiency


def efficiency_for(hw: hw_lib.Hardware) -> Efficiency:
    """The ``Efficiency`` of ``hw`` (a default GPU-like model for unknown names)."""
    return EFFICIENCY.get(hw.name.lower(), Efficiency())


def memory_bound_time(ms: ModelShape, layout: Layout, hw: hw_lib.Hardware, *, global_batch: int,
                      flash: bool = True, gated: bool = True, dropout: bool = False) -> float:
    """Seconds per step per device of a transformer's non-matmul kernels (norms, residual adds,
    the MLP's activation, dropout, an unfused attention's softmax, the loss over the vocabulary),
    which run at the memory's speed, not the tensor cores': the roofline's memory-bound side
    (Williams et al. 2009, "Roofline"), the share of a transformer's runtime Ivanov et al. 2021
    ("Data Movement Is All You Need", MLSys) measure at ~40% for BERT-large although it is
    ~0.2% of the flops. It falls as 1/d_model against the matmuls, which is why per-GPU
    throughput rises with model size (Megatron-LM's weak-scaling tables).

    Bytes per token and layer in one forward pass, 16-bit activations, counted per kernel as
    reads + writes of the tensors Korthikanti et al. 2022 (arXiv:2205.05198, sec. 4) list: two
    norms 8h, two residual adds 12h, two dropout masks 2h (``dropout``); the MLP activation 4·d_ff
    (GELU: read, write) or 6·d_ff (``gated``: SwiGLU reads two inputs); an unfused attention's
    score tensors 13·a·s (QKᵀ written, scale-mask-softmax read + written, dropout read + written
    + mask, read by the AV matmul), none under ``flash`` (FlashAttention keeps them on chip,
    Dao et al. 2022). Tensor parallelism splits the MLP and attention terms by t; the norms,
    residuals and masks are replicated unless ``layout.sequence_parallel``. Backward reads each
    saved input and the incoming gradient and writes the outgoing one (2x forward), recompute
    (``remat`` "full" or "dots") runs the forward kernels again: 3 or 4 forward passes in all.
    The loss reads and writes f32 logits ~4 times (16·V/t bytes per token, vocabulary-parallel),
    spread over the pipeline stages like the head's flops. Pass the result to
    ``times(..., memory_seconds=)``; ``from_shape.estimate`` does so for every transformer
    ``ModelShape`` (its ``gated``, ``flash_attention`` and ``dropout`` say which kernels run).

    Args:
        ms: the model (``d_model``, ``heads``, ``d_ff``, ``vocab``, ``seq``, ``layers``).
        layout: the layout.
        hw: the hardware (needs ``hbm_bandwidth``).
        global_batch: sequences per step.
        flash: attention scores never reach memory (FlashAttention-style kernel).
        gated: the MLP is gated (SwiGLU: two inputs to the activation).
        dropout: dropout on the residual branches and attention probabilities.

    Raises:
        ValueError: ``hw`` has no ``hbm_bandwidth``, or ``ms`` has no ``d_model``.
    """
    if hw.hbm_bandwidth <= 0:
        raise ValueError(f"hardware {hw.name!r} has no hbm_bandwidth; register it with "
                         "Hardware(..., hbm_bandwidth=bytes_per_s)")
    if not ms.d_model or not ms.layers:
        raise ValueError(f"model {ms.name!r} has no d_model/layers: the memory-bound term needs a "
                         "transformer's widths")
    lo = layout
    h, t, s = ms.d_model, lo.tensor, ms.seq
    replicated = (20 + (2 if dropout else 0)) * h
    split = (6 if gated else 4) * ms.d_ff + (0 if flash else 13 * max(ms.heads, 1) * s)
    per_layer = replicated / (t if lo.sequence_parallel else 1) + split / t
    passes = 4 if lo.remat in ("full", "dots") else 3
    # each replica's tokens, seen by every stage; a context axis splits them
    tokens = global_batch * s / (lo.data * lo.fsdp * lo.context)
    per_token = passes * per_layer * ms.layers / lo.pipe + 16 * ms.vocab / t / lo.pipe
    return tokens * per_token / hw.hbm_bandwidth


def roofline_excess(kernels, hw: hw_lib.Hardware, model: Efficiency | None = None) -> float:
    """Seconds the memory side of the roofline adds to a step's matmul time: over its
    kernels, ``Σ n · max(flops / (peak · matmul), bytes / hbm_bandwidth)`` less
    ``Σ n · flops / (peak · matmul)`` — each kernel takes the longer of its arithmetic at the
    achievable matmul rate and its device-memory traffic at the HBM bandwidth (Williams et
    al. 2009, "Roofline"). A memory-bound pass (a BatchNorm's statistics and normalisation, a
    ReLU, a residual add, an optimizer update) costs its bytes; a matmul or convolution that
    moves more bytes than it computes (a 1×1 convolution over few channels) costs its bytes
    too; a large matmul costs its flops, as before. ``times(..., memory_seconds=)`` adds it to
    the flops' time, so flops ``Σ n · flops`` and this give the roofline sum.

    Args:
        kernels: ``(flops, bytes, executions)`` per kernel, per device (``compiled.kernels``
            of a compiled program, ``ProgramReading.kernels`` of a traced one).
        hw: the hardware (its ``peak_flops`` and ``hbm_bandwidth``).
        model: the efficiency model (``efficiency_for(hw)`` by default).

    Raises:
        ValueError: ``hw`` has no ``hbm_bandwidth``.
    """
    if hw.hbm_bandwidth <= 0:
        raise ValueError(f"hardware {hw.name!r} has no hbm_bandwidth; register it with "
                         "Hardware(..., hbm_bandwidth=bytes_per_s)")
    rate = hw.peak_flops * (model or efficiency_for(hw)).matmul
    return sum(n * max(0.0, b / hw.hbm_bandwidth - f / rate) for f, b, n in kernels)


def collective_time(kind: str, nbytes: float, group: int, bandwidth: float, latency: float) -> float:
    """Seconds for one device's share of a ring collective (scaling book, "Sharded Matrices").

    ``nbytes`` is counted as ``sk.Report`` counts it: the gathered result for an all-gather,
    the bytes reduced for a reduce-scatter / all-reduce, the message for a permute. A ring
    all-gather or reduce-scatter moves (N−1)/N of V over each link: ≈ V/W; an all-reduce is a
    reduce-scatter plus an all-gather, 2V/W; each of the N−1 ring steps pays the latency.
    """
    if group <= 1 or nbytes <= 0:
        return 0.0
    if kind == "permute":
        return nbytes / bandwidth + latency
    frac = (group - 1) / group
    steps = group - 1
    if kind == "all-reduce":
        return 2 * (frac * nbytes / bandwidth + steps * latency)
    return frac * nbytes / bandwidth + steps * latency


def link(hw: hw_lib.Hardware, layout: Layout, axes: tuple[str, ...]) -> tuple[float, float, int]:
    """(bandwidth, latency, group) of a collective over ``axes`` of ``layout`` (see ``_link``)."""
    return _link(hw, layout, axes)


def _link(hw: hw_lib.Hardware, layout: Layout, axes: tuple[str, ...]) -> tuple[float, float, int]:
    """(bandwidth, latency, group) for a collective over ``axes``.

    Inside one node (NVLink domain / ICI slice) the fast link; across nodes the slow one, but
    hierarchical collectives (NCCL rings over every NIC, or reduce in-node first) let the k
    group members that share a node pool their NICs: k × the per-chip inter-node bandwidth,
    which is the scaling book's per-node figure when a whole node is in the group.
    """
    sizes = tuple((a, getattr(layout, a)) for a in _MESH_ORDER)
    return _link_of(hw, sizes, tuple(axes))


# The mesh order of ``Layout`` (outermost first): a collective's link depends on these sizes
# only, so ``_link_of`` is cached on them (``search`` times thousands of layouts).
_MESH_ORDER = ("replica", "pipe", "data", "fsdp", "expert", "context", "tensor")


@functools.lru_cache(maxsize=4096)
def _link_of(hw: hw_lib.Hardware, sizes: tuple[tuple[str, int], ...], axes: tuple[str, ...]) -> tuple[float, float, int]:
    size = dict(sizes)
    stride = {a: math.prod(s for _, s in sizes[i + 1:]) for i, (a, _) in enumerate(sizes)}
    group = math.prod(size[a] for a in axes)
    node, intra_lat, inter_lat = links(hw)
    live = [a for a in axes if size[a] > 1]
    span = max((size[a] * stride[a] for a in live), default=1)
    if span <= node:
        return hw.intra_node_bw, intra_lat, group
    stride = min((stride[a] for a in live), default=1)
    k = max(1, min(group, node // max(stride, 1)))
    return min(hw.intra_node_bw, k * hw.inter_node_bw), inter_lat, group


def _collective_stages(layout: Layout) -> dict[str, tuple[tuple[str, tuple[str, ...], float], ...]]:
    """Per role, the collectives it runs: (kind, mesh axes, share of the role's bytes).

    Data axes follow what each one shards. ``fsdp`` always shards weights (and so gradients and
    optimizer state); ``data`` joins it from ZeRO-1 (optimizer state), ZeRO-2 (gradients) and
    ZeRO-3 (weights). Weights are gathered over the axes that shard them: both under ZeRO-3,
    ``fsdp`` alone below it (``data`` replicas hold whole fsdp shards), ``data`` for ZeRO-1/2's
    one gather of the updated weights. Gradients are reduce-scattered over the axes that shard
    them and all-reduced over the rest: with ``fsdp`` > 1, ``data`` > 1 and ZeRO < 3 that is a
    reduce-scatter over ``fsdp`` of the whole gradient, then a reduction over ``data`` of the
    1/fsdp shard (all-reduce where ZeRO keeps it whole: ``roles.grads_on_shard``; the
    compiled program reduce-scatters over data × fsdp at once, the same ring volume), as
    hybrid sharding runs it (Zhao et al. 2023,
    "PyTorch FSDP", arXiv:2304.11277; Rajbhandari et al. 2020). Tensor-parallel reductions are
    all-reduces, or reduce-scatters under sequence parallelism, whose all-gathers are
    ``tensor-gather`` (Korthikanti et al. 2022, sec. 4.2.2).
    """
    lo = layout
    both = tuple(a for a in ("data", "fsdp") if getattr(lo, a) > 1)
    if lo.fsdp > 1 and lo.data > 1 and lo.zero < 3:
        grad = (("reduce-scatter", ("fsdp",), 1.0),
                ("reduce-scatter" if grads_on_shard(lo.zero, lo.microbatches, lo.pipe > 1) else "all-reduce",
                 ("data",), 1.0 / lo.fsdp))
    else:
        on_shard = grads_on_shard(lo.zero, lo.microbatches, lo.pipe > 1) or lo.fsdp > 1
        grad = (("reduce-scatter" if on_shard else "all-reduce", both, 1.0),)
    gather_axes = both if lo.zero == 3 else ("fsdp",) if lo.fsdp > 1 else ("data",)
    stages = {"grad-reduce": grad, "param-gather": (("all-gather", gather_axes, 1.0),),
              "tensor-reduce": (("reduce-scatter" if lo.sequence_parallel else "all-reduce", ("tensor",), 1.0),),
              "tensor-gather": (("all-gather", ("tensor",), 1.0),),
              "pipe-permute": (("permute", ("pipe",), 1.0),),
              "pipe-reduce": (("all-reduce", ("pipe",), 1.0),),
              "pipe-relayout": (("all-to-all", ("pipe",), 1.0),),
              "expert-all-to-all": (("all-to-all", ("expert",), 1.0),),
              "context-permute": (("permute", ("context",), 1.0),),
              "context-gather": (("all-gather", ("context",), 1.0),),
              "context-reduce": (("reduce-scatter", ("context",), 1.0),)}
    return {role: stages[role] for role in STEP_ROLES}


def times(collectives: Mapping[str, float], counts: Mapping[str, float], flops: float,
          hw: hw_lib.Hardware, layout: Layout, efficiency: float = 1.0,
          model: Efficiency | None = None, memory_seconds: float = 0.0,
          all_reduced: Mapping[str, float] | None = None) -> dict[str, float]:
    """Step time: compute at the achievable matmul efficiency, plus what communication and the
    pipeline bubble add on top (``Efficiency``).

    Every role's collective time is the ring model's bandwidth term plus (N−1) link latencies
    plus ``model.latency`` per op. Data-axis traffic (gradient reduction, ZeRO gathers) shows
    for ``exposed_data`` of its time; the rest hides behind compute, and only as far as
    compute lasts. Tensor-parallel collectives show for ``exposed_tensor`` and sit inside each
    pipeline stage, so the bubble stretches them with the compute: the bubble adds (p − 1)/(v·m)
    of the stage time (Narayanan et al. 2021, the bubble/ideal form). Pipeline permutes and
    psums show for ``exposed_pipe``; ``sk.moe``'s all-to-alls and a context axis's K/V gathers
    show whole, its ring hides behind compute like the data traffic. ``efficiency`` scales the matmul efficiency further;
    ``memory_seconds`` (``memory_bound_time``) adds the non-matmul kernels' time to compute.
    Which collective each role is, over which axes, follows ``_collective_stages``, except
    ``all_reduced``: per role, the share of its bytes a compiled program reduced with
    all-reduces where the model reduce-scatters (XLA:TPU over every chip of a 3-D slice:
    ``Report.all_reduced``, BENCHMARKS.md), timed as the all-reduces they are, over the same axes.
    Time parts: ``compute``, one per role (full collective time), ``bubble``, ``exposed``
    (communication time on the critical path), ``step``.
    """
    eff = model or efficiency_for(hw)
    t = {"compute": flops / (hw.peak_flops * eff.matmul * efficiency) + memory_seconds,
         "memory-bound": memory_seconds}
    for role, stages in _collective_stages(layout).items():
        nbytes, n = collectives.get(role, 0.0), max(counts.get(role, 1.0), 1.0)
        # Only where every stage is a reduce-scatter is it clear which of them the all-reduces are.
        ar = (all_reduced or {}).get(role, 0.0) if all(k == "reduce-scatter" for k, _, _ in stages) else 0.0
        t[role] = 0.0
        for kind, axes, share in stages:
            if nbytes <= 0 or math.prod(getattr(layout, a) for a in axes) <= 1:
                continue
            bw, lat, group = _link(hw, layout, axes)
            if kind == "permute":
                group = 2
            seconds = collective_time(kind, nbytes * share / n, group, bw, lat)
            if ar:
                seconds += ar * (collective_time("all-reduce", nbytes * share / n, group, bw, lat) - seconds)
            t[role] += n * (seconds + eff.latency)
    p = layout.pipe
    # Idle over busy cells of the table sk.pipeline executes: (p-1)/(v·m) for GPipe, circular,
    # 1F1B and interleaved 1F1B, (p-1)/(3m) for ZB-H1.
    bubble = pipeline_bubble(layout_note(layout)) if p > 1 else 0.0
    tensor = eff.exposed_tensor * (t["tensor-reduce"] + t["tensor-gather"])
    critical = (t["compute"] + tensor) * (1 + bubble)
    t["bubble"] = critical * bubble / (1 + bubble)
    data = t["grad-reduce"] + t["param-gather"]
    pipe = eff.exposed_pipe * (t["pipe-permute"] + t["pipe-reduce"] + t["pipe-relayout"])
    # sk.moe's experts wait for their tokens and the combine for the experts: nothing hides it.
    pipe += t.get("expert-all-to-all", 0.0)
    # sk.context_attention's ring sends the next K/V block while the current one is computed
    # (Liu et al. 2023): hidden behind compute as far as compute lasts; its all-gather
    # strategy gathers before computing and reduces after: exposed.
    pipe += t.get("context-gather", 0.0) + t.get("context-reduce", 0.0)
    hidden = (1 - eff.exposed_data) * data + t.get("context-permute", 0.0)
    t["exposed"] = tensor + eff.exposed_data * data + max(0.0, hidden - t["compute"]) + pipe
    t["step"] = critical + eff.exposed_data * data + max(0.0, hidden - t["compute"]) + pipe
    return t
