"""Per-role formulas: one function per collective role and memory kind, shared by both
estimators — ``from_shape.estimate`` feeds them sums derived from a ``ModelShape`` (``sk.search``),
``from_step.step_estimate`` feeds them a real step's leaf sums and traced-program readings
(``step.explain()``). A role's rule lives here once; the callers only count.

Sources: ZeRO memory and traffic (Rajbhandari et al. 2020, arXiv:1910.02054); Megatron tensor
parallelism (Shoeybi et al. 2019, arXiv:1909.08053) and its sequence-parallel form and
activation memory (Korthikanti et al. 2022, arXiv:2205.05198); Ring Attention (Liu et al.
2023); GShard/Switch all-to-alls (Lepikhin et al. 2020; Fedus et al. 2021). Bytes are counted
like ``sk.Report``: per device per step; a reduction counts the bytes reduced (an all-reduce and
a reduce-scatter of V both count V), a gather its gathered result.
"""

from __future__ import annotations

from collections import defaultdict

from ..terms import Layout, ModelShape, RoleTraffic


def zero_state(zero: int, *, model: float, shard: float) -> dict[str, float]:
    """Elements one device keeps of the parameters, gradients and optimizer state (per moment)
    under ZeRO stage ``zero`` (Rajbhandari et al. 2020, sec. 5): stage 1 shards the optimizer
    state over the data axes, 2 the gradients too, 3 the parameters too.

    Args:
        model: elements per device as the model-parallel layout places them (tensor, pipe and
            any explicitly sharded axis; a ``ModelShape``'s Ψ split, or a step's leaf spec sizes).
        shard: elements per device with the data axes' ZeRO shard on top.
    """
    return {"params": shard if zero >= 3 else model, "grads": shard if zero >= 2 else model,
            "opt_state": shard if zero >= 1 else model}


def grads_on_shard(zero: int, microbatches: int, pipelined: bool = False) -> bool:
    """Whether the step reduces gradients into ZeRO's shard (a reduce-scatter over the data
    axes): ZeRO-2/3, and ZeRO-1 with one microbatch and no ``sk.pipeline``, which keeps no
    accumulator and so reduces straight into the optimizer's shard (``sk.train_step``).
    ZeRO-1's accumulator of several microbatches is whole: each microbatch's gradient is
    all-reduced into it."""
    return zero >= 2 or (zero == 1 and microbatches == 1 and not pipelined)


def step_temporaries(*, pass_peak: float, grads: float, update: float, reduced: float = 0.0,
                     throughout: float = 0.0) -> float:
    """Temporary bytes of one training step: the larger of the forward + backward pass's own peak
    (``pass_peak``: its activations, working buffers and, at its end, the gradients) and the
    update's (the unreduced ``grads`` beside their ``reduced`` copy — a collective writes a new
    buffer — and the new parameters, or ZeRO-1/2's new shard, before they are written back:
    ``update``), plus what stays alive throughout (``throughout``: a microbatch gradient
    accumulator, a compute-dtype copy of the parameters)."""
    return max(pass_peak, grads + reduced + update) + throughout


def tensor_traffic(*, forward: float = 0.0, backward: float = 0.0, regions: float = 0.0,
                   regathered: float = 0.0, head_gather: bool = False, tokens: float = 0.0, width: float = 0.0,
                   wire: int, microbatches: float = 1, sequence_parallel: bool = False,
                   tables: tuple[float, float] = (0.0, 0.0), param_bytes: int = 4, grad_bytes: int = 4,
                   measured: tuple[float, float] | None = None) -> RoleTraffic:
    """Tensor-parallel collectives per device per step: the one formula both estimators use.

    Megatron (Shoeybi et al. 2019): each use of a tensor-split weight leaves partial sums of one
    (``tokens`` × ``width``) activation to all-reduce — a row-parallel weight's output in the
    forward (again where the forward is recomputed; a vocab-parallel lookup too), a
    column-parallel weight's input gradient in the backward. ``forward``/``backward``: how many
    such uses one microbatch makes. Under sequence parallelism (Korthikanti et al. 2022, sec.
    4.2.2) each becomes a reduce-scatter (the same bytes reduced) and each of the ``regions`` (a
    column-parallel → row-parallel pair) adds two all-gathers: its input in the forward (kept
    whole for the weight gradients) and its output's gradient in the backward (the transpose of
    the forward's reduce-scatter); ``regathered``: regions that gather their input a third
    time — where the backward recomputes the forward, or Megatron's executor, which keeps the
    sequence shard and gathers it again for the weight gradients; ``head_gather``: one more for
    the output head's input. A vocab-parallel lookup there sees tokens split over ``tensor``: it
    gathers its whole table (``param_bytes``) and reduces its gradient at full size
    (``grad_bytes``) instead of reducing its output (``tables``: ``(elements, tables)``, not
    counted in ``forward``).

    ``measured``: ``(elements, reductions)`` per microbatch read off a traced program's
    tensor-split contractions, which replace the per-use count.
    """
    col, counts = defaultdict(float), defaultdict(float)
    m = microbatches
    act = tokens * width * wire
    if measured is not None:
        col["tensor-reduce"] += m * measured[0] * wire
        counts["tensor-reduce"] += m * measured[1]
    else:
        col["tensor-reduce"] += m * (forward + backward) * act
        counts["tensor-reduce"] += m * (forward + backward)
    if tables[1]:
        col["tensor-gather"] += m * tables[0] * param_bytes
        col["tensor-reduce"] += m * tables[0] * grad_bytes
        counts["tensor-gather"] += m * tables[1]
        counts["tensor-reduce"] += m * tables[1]
    if sequence_parallel:
        n_gather = 2 * regions + regathered + (1 if head_gather else 0)
        col["tensor-gather"] += m * n_gather * act
        counts["tensor-gather"] += m * n_gather
    return RoleTraffic(dict(col), dict(counts))


def data_traffic(*, reduced: float, reduce_ops: float, gathered: float = 0.0,
                 gather_ops: float = 0.0, zero12_gathered: float = 0.0, zero12_ops: float = 1.0,
                 regathered: float = 0.0, bg: int, wire: int, bp: int) -> RoleTraffic:
    """Data-axis collectives per device per step (ZeRO, Rajbhandari et al. 2020): the one
    formula both estimators use, fed by a ``ModelShape`` (``estimate``) or by a real step's leaf
    sums (``from_step``).

    * ``grad-reduce``: every gradient element is reduced once per reduction (``reduced``
      elements in all, over ``reduce_ops`` collectives; counted as bytes reduced, so an
      all-reduce and a reduce-scatter of the same gradient count the same);
    * ``param-gather`` under ZeRO-3/FSDP: each use of a sharded weight gathers it (``gathered``
      elements over ``gather_ops`` collectives, in the compute dtype on the wire);
    * ``param-gather`` under ZeRO-1/2: the updated shards are gathered once per step into the
      replicated parameters (``zero12_gathered`` elements, in the parameter dtype; ``zero12_ops``
      collectives), and ``regathered`` elements of gradient reduced into the shard and gathered
      back whole (in the gradient dtype): a tied table's, whose lookup scatter-adds into it.
    """
    col, counts = defaultdict(float), defaultdict(float)
    col["grad-reduce"] += reduced * bg
    counts["grad-reduce"] += reduce_ops
    if gathered:
        col["param-gather"] += gathered * wire
        counts["param-gather"] += gather_ops
    elif zero12_gathered:
        col["param-gather"] += zero12_gathered * bp + regathered * bg
        counts["param-gather"] += zero12_ops
    return RoleTraffic(dict(col), dict(counts))


def activation_bytes(ms: ModelShape, lo: Layout, b: int, s: int, bc: int) -> float:
    """Saved activation bytes of one layer for one microbatch (Korthikanti et al. 2022,
    Table 2; the constants assume 16-bit activations, scaled to ``bc`` bytes), without the
    attention scores' term under ``ModelShape.flash_attention``."""
    if ms.act_bytes_per_token is not None:
        return ms.act_bytes_per_token * b * s / lo.tensor
    h, a, t = ms.d_model, max(ms.heads, 1), lo.tensor
    if not h:
        return 0.0
    sbh = s * b * h
    # The attention scores' 5as/h (scores, softmax, dropout mask: Korthikanti's "5as/h"), which a
    # flash kernel never writes to memory (its log-sum-exp residual, 4 bytes a head and token, is
    # below the formula's grain): sk.attention's on GPU and TPU targets.
    sc = 0 if ms.flash_attention else 5 * a * s / h
    if lo.remat == "lean" or (ms.activations == "xla" and lo.remat in ("none", "dots")):
        return _xla_layer_bytes(ms, lo, s) * b * bc / 2  # "lean" is a named set: counted from the widths
    if ms.activations not in ("korthikanti", "xla"):
        raise ValueError(f"ModelShape.activations={ms.activations!r}: use 'korthikanti' or 'xla'")
    if lo.remat == "full":
        per = 2 * sbh
    elif lo.remat == "dots":  # selective recompute: attention scores are recomputed
        per = sbh * 34 / t
    elif lo.sequence_parallel and t > 1:
        per = sbh / t * (34 + sc)
    elif t > 1:
        per = sbh * (10 + 24 / t + sc / t)
    else:
        per = sbh * (34 + sc)
    return per * bc / 2


def _xla_layer_bytes(ms: ModelShape, lo: Layout, s: int) -> float:
    """Bytes one sequence of ``s`` tokens leaves saved in one layer, 16-bit activations
    (``ModelShape.activations="xla"``), remat ``"none"``, ``"dots"`` or ``"lean"``: the residuals JAX's
    autodiff saves for a pre-norm decoder layer (RMSNorm in f32, SwiGLU or GELU MLP, grouped K/V)
    counted from the model's own widths — the tensors of Korthikanti et al. 2022 (sec. 4.1), not
    their GPT constants. Per token, h = d_model, hq = heads x head_dim, kv = K/V heads x
    head_dim, f = d_ff, split over ``tensor`` (t) where Megatron splits them:

    - no recompute: each of the two RMS norms its f32 input and f32 normalised value (2 x 4h,
      split over ``tensor`` under sequence parallelism) and its 16-bit output, the input of the
      column-parallel matmuls, whole even under sequence parallelism (the all-gather's result is
      what the weight gradient reads; Megatron gathers it again in the backward instead,
      Korthikanti sec. 4.2.2); with a flash kernel five hq-wide tensors (the query; K and V
      repeated to the query heads, as the Pallas kernels take them; the output in the kernel's
      layout and in the model's), without one the query, grouped K and V, the output and the
      scores (2·a·s, 5·a·s with dropout); the gated MLP's six f-wide tensors (gate, up, the
      SiLU's pieces and the product the down projection reads), a GELU MLP's two; two dropout
      masks with ``dropout``.
    - remat "dots" (JAX's ``checkpoint_dots``: every matmul output saved, the rest recomputed):
      the layer input and the attention projection's output (h each, split under sequence
      parallelism), the query, K and V (and the scores without a flash kernel), and the MLP's
      gate and up (f each; one f for a GELU MLP).
    - remat / keep "lean" (``sk.LEAN_RESIDUALS``, the values the recipe's layer names): the
      layer input and the residual stream between attention and MLP (h each, split under
      sequence parallelism), the query and the attention output (hq each), K and V, the MLP's
      gate and up: "dots"' set and the attention output, no matmul recomputed. At Llama 3
      405B's widths, TP8 + SP, 8K tokens: 340 MiB per layer counted, 308 without the layer
      input (a one-layer chunk's stage-input ring holds it), 306.6 compiled per kept slot
      (``bench/llama3_compile.py``).

    Checked against XLA:GPU's compile of the recipe at Llama 2 7B's widths on H100s (the mixed
    difference of 2/4 layers x 1/2 sequences of 2,048, ``data=8``): 60.8 bytes per token and h
    compiled vs 62.3 counted without recompute, 21.6 vs 20.8 under "dots"."""
    h, a, t = ms.d_model, max(ms.heads, 1), lo.tensor
    hq = h  # heads x head_dim: the recipe's and every config ModelShape reads have head_dim = h / heads
    kv = (ms.kv_heads or a) * (h // a)
    sp = t if lo.sequence_parallel else 1
    if lo.remat == "lean":
        mlp = (4 if ms.gated else 2) * ms.d_ff
        return s * (4 * h / sp + (4 * hq + 4 * kv + mlp) / t)
    if lo.remat == "dots":
        scores = 0 if ms.flash_attention else 2 * a * s
        mlp = (4 if ms.gated else 2) * ms.d_ff
        return s * (4 * h / sp + (2 * hq + 4 * kv + mlp + scores) / t)
    replicated = 16 * h / sp + 4 * h + (2 * h / sp if ms.dropout else 0)
    mlp = (12 if ms.gated else 4) * ms.d_ff
    if ms.flash_attention:
        attention = 5 * 2 * hq
    else:
        attention = 2 * hq + 4 * kv + 2 * hq + (5 if ms.dropout else 2) * a * s
    return s * (replicated + (attention + mlp) / t)


def moe_traffic(*, tokens: int, d_model: int, experts: int, top_k: int, capacity_factor: float | None,
                group_size: int | None, bytes_per_element: float, axis_size: int, ragged: bool = False) -> float:
    """All-to-all bytes per device per step of one ``sk.moe`` layer, counted as ``sk.Report``
    counts them (the buffers each device hands to the all-to-all; ``steptime.collective_time``
    applies the (n−1)/n that leaves the device).

    A device's ``tokens`` go out as an ``(E, S, D)`` buffer: ``S = (tokens / group) · C`` slots
    per expert, ``C = ceil(c · k · group / E)`` (``moe.expert_capacity``), so ≈ ``c · k · tokens``
    rows; dropless pads each expert to all of the device's tokens (``S = tokens``: ``E/k`` times
    the capacity-1 buffer). Dispatch and combine, forward and backward: four such buffers (the
    GShard/Switch accounting, Lepikhin et al. 2020; Fedus et al. 2021). Zero without an expert
    axis.

    ``ragged``: the dropless dispatch of GPU and TPU targets (``sk.moe(dispatch="auto")``,
    ``_moe_ragged``): ragged-all-to-alls carry the ``k · tokens`` routed rows, not the padded
    ``E · tokens``, four times (``4 · tokens · k · D`` elements; how many rows leave the device
    is data-dependent, this is the bound ``sk.Report`` counts too).
    """
    from ...moe import expert_capacity

    if axis_size <= 1:
        return 0.0
    if ragged:
        if capacity_factor is not None:
            raise ValueError(f"moe_traffic: ragged=True is the dropless dispatch; capacity_factor="
                             f"{capacity_factor!r} must be None")
        return 4.0 * tokens * top_k * d_model * bytes_per_element
    group = tokens if capacity_factor is None else group_size
    slots = tokens // group * expert_capacity(group, top_k, experts, capacity_factor)
    return 4.0 * experts * slots * d_model * bytes_per_element


def context_traffic(*, kv_block: float, context: int, strategy: str = "ring", bytes_per_element: int,
                    segment_block: float = 0.0, backward: bool = True) -> dict[str, float]:
    """Per-device collective bytes of one ``sk.context_attention`` call (Liu et al. 2023, Ring
    Attention), counted as ``sk.Report`` counts them.

    ``kv_block``: elements of one device's K block (= its V block): local batch × T/c × kv
    heads per device × head_dim. ``segment_block``: bytes of its segment ids (int32), which
    travel with K/V. Gradient accumulators travel in float32.

    * ``"ring"``, ``context-permute``: forward ``(c-1)`` K/V blocks; backward ``(c-1)`` K/V
      blocks again plus ``c`` dK/dV blocks (each block's gradient rides the ring with it and
      takes one more hop home), so about twice the forward.
    * ``"allgather"``: ``context-gather`` the gathered K/V (``c`` blocks each) once: the
      backward gathers the same K/V and XLA merges that gather with the forward's (measured
      on the compiled step); ``context-reduce`` the bytes of dK/dV reduced (``c`` f32 blocks
      each, reduce-scattered).

    Zero for ``context == 1``.
    """
    c = context
    out = {"context-permute": 0.0, "context-gather": 0.0, "context-reduce": 0.0}
    if c <= 1:
        return out
    kv = 2 * kv_block * bytes_per_element + segment_block
    passes = 2 if backward else 1
    if strategy == "ring":
        out["context-permute"] = passes * (c - 1) * kv + (c * 2 * kv_block * 4 if backward else 0.0)
    elif strategy == "allgather":
        out["context-gather"] = c * kv
        out["context-reduce"] = c * 2 * kv_block * 4 if backward else 0.0
    else:
        raise ValueError(f"unknown context strategy {strategy!r}; choose 'ring' or 'allgather'")
    return out
