"""The cost model fed by a ``ModelShape``: per-device memory, collective bytes and flops of a
layout (``estimate``), counted from the model's sizes and handed to the per-role formulas in
``roles`` (which ``from_step`` feeds from a real step); ``steptime`` turns them into seconds.
``sk.cost`` is the public face.

Sources: ZeRO memory and traffic (Rajbhandari et al. 2020, arXiv:1910.02054),
Megatron tensor parallelism and activation memory (Shoeybi et al. 2019, arXiv:1909.08053;
Korthikanti et al. 2022, arXiv:2205.05198), pipeline bubbles (Huang et al. 2019; Narayanan et
al. 2021, arXiv:2104.04473), collective times and rooflines (the JAX scaling book, "How to
Scale Your Model"). Collective bytes are counted like ``sk.Report``: per device per step; for
reductions the bytes reduced (an all-reduce and a reduce-scatter of V both count V), for
gathers the gathered result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ...pipeline.keep import KEEP
from ...pipeline.schedules import EXPLICIT
from ...precision import Precision
from .. import hardware as hw_lib
from ..pipeline_note import PipelineNote, is_explicit, schedule_table
from .pipeline_cost import idle_tick_flops, layout_note, pipeline_traffic, recompute_factor
from .roles import (activation_bytes, context_traffic, data_traffic, grads_on_shard, moe_traffic,
                    step_temporaries, tensor_traffic, zero_state)
from ..terms import Estimate, Layout, ModelShape, RoleTraffic, model_shape
from .diloco_cost import diloco_terms
from .steptime import Efficiency, memory_bound_time, times

def estimate(model: Any, layout: Layout, hardware: str | hw_lib.Hardware = "h100", *,
             global_batch: int, seq: int | None = None, precision: str | Precision = "bf16",
             memory_limit: float | None = None, efficiency: float = 1.0,
             flops_per_token: float | None = None, model_efficiency: Efficiency | None = None,
             memory_bound: bool = True) -> Estimate:
    """Estimates one training step of ``model`` on ``layout`` (no devices needed).

    Memory follows ZeRO (Rajbhandari et al. 2020): parameters sharded by tensor × pipe, and by
    the data axes under ZeRO-3/FSDP; Adam's two moments by the data axes from ZeRO-1; gradients
    from ZeRO-2. Activations per layer and microbatch follow Korthikanti et al. (2022):
    sbh(34 + 5as/h) without TP, sbh(10 + 24/t + 5as/(ht)) with TP, (sbh/t)(34 + 5as/h) with
    sequence parallelism, 2sbh under full recompute (+ one layer recomputed); a GPipe pipeline
    keeps m microbatches alive; ``sk.pipeline``'s 1F1B keeps p stage inputs and recomputes each
    stage's forward in its backward op (one microbatch's residuals alive; +2/6 flops, +2 TP
    all-reduces per layer), or with ``Layout.keep`` keeps each in-flight chunk-microbatch's
    residuals (``"all"``) or a policy's saved set (``"dots"``) in ``Schedule.res_ring`` slots
    instead of recomputing; ``Layout.keep_residuals`` runs Megatron's (interleaved) 1F1B instead,
    holding every in-flight chunk-microbatch's residuals (``in_flight``) without recompute. Traffic: DP ≈ Ψ reduced per microbatch, ZeRO-1/2
    + one gather of Ψ, ZeRO-3/FSDP 2 gathers + 1 reduction per microbatch (3Ψ, ZeRO paper);
    Megatron TP 4 all-reduces of b·s·h per layer (2 forward, 2 backward) plus 2 for the
    vocab-parallel embedding/head; pipelines: see ``pipeline.pipeline_traffic`` (one gradient
    reduction over data per step, not per microbatch).
    Step time: ``steptime.times`` with the hardware's ``Efficiency`` (not a pure roofline).

    Args:
        model: see ``model_shape``.
        layout: the ``Layout``.
        hardware: a ``HARDWARE`` name or ``Hardware``.
        global_batch: examples (sequences) per step.
        seq: tokens per example (default: the model's).
        precision: a ``sk.Precision`` or preset name.
        memory_limit: bytes per device (default 90% of the chip's HBM).
        efficiency: a further factor on the matmul efficiency (1.0: the hardware's).
        model_efficiency: the ``Efficiency`` to time with (default: the hardware's entry in
            ``EFFICIENCY``; ``ROOFLINE`` gives the pure roofline).
        flops_per_token: overrides the model's figure.
        memory_bound: add the time of a transformer's non-matmul kernels at HBM speed
            (``steptime.memory_bound_time``; ``time["memory-bound"]``, inside ``compute``).

    Raises:
        ValueError: the batch does not split over the data axes and microbatches.
    """
    ms = model_shape(model, flops_per_token=flops_per_token, seq=seq)
    hw = hardware if isinstance(hardware, hw_lib.Hardware) else hw_lib.lookup(hardware)
    prec = Precision.resolve(precision)
    lo = layout
    if lo.replica > 1:  # DiLoCo: the inner layout on each replica's share, plus its syncs
        if global_batch % lo.replica:
            raise ValueError(f"global batch {global_batch} does not split over replica={lo.replica}; "
                             f"use a multiple of {lo.replica}")
        inner = estimate(ms, dataclasses.replace(lo, replica=1, diloco_every=1), hw,
                         global_batch=global_batch // lo.replica, precision=prec, memory_limit=memory_limit,
                         efficiency=efficiency, model_efficiency=model_efficiency, memory_bound=memory_bound)
        return diloco_terms(inner, ms, lo, hw, prec, global_batch)
    replicas = lo.data * lo.fsdp * lo.expert  # sk.moe splits the batch over ``expert`` too
    if global_batch % (replicas * lo.microbatches):
        raise ValueError(f"global batch {global_batch} does not split over data x fsdp x expert = {replicas} "
                         f"replicas x {lo.microbatches} microbatches; use a multiple of "
                         f"{replicas * lo.microbatches}")
    s = _sizes(ms, lo, prec, global_batch)
    mem = _memory(s, ms, lo, global_batch)
    col, counts = _collectives(s, ms, lo)
    flops, busy, model_flops = _flops(s, ms, lo, global_batch)
    limit = memory_limit if memory_limit is not None else 0.9 * hw.hbm_bytes
    # A transformer's non-matmul kernels run at HBM speed (steptime.memory_bound_time); the
    # matmul efficiencies were fitted with this term on.
    memory_s = (memory_bound_time(ms, lo, hw, global_batch=global_batch, flash=ms.flash_attention,
                                  gated=ms.gated, dropout=ms.dropout)
                if memory_bound and ms.d_model and ms.layers > 1 and hw.hbm_bandwidth > 0 else 0.0)
    t = times(col, counts, busy, hw, lo, efficiency, model_efficiency, memory_seconds=memory_s)
    return Estimate(mem, col, flops, model_flops, t, hw.name, lo, global_batch * ms.seq, limit, lo.devices)


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """Per-device elements and bytes ``estimate``'s parts share."""
    bp: int  # bytes per parameter, compute, gradient and optimizer-state element
    bc: int
    bg: int
    bo: int
    replicas: int  # data x fsdp x expert
    b: int  # examples per microbatch per replica
    p_expert: float  # expert weights per device
    p_layers: float  # layer weights per device
    p_dev: float  # all weights per device (layout split, before ZeRO)
    s_param: int  # ZeRO's split of the parameters
    state: dict  # ``roles.zero_state``
    sharded: bool  # weights are gathered where used (ZeRO-3/FSDP)
    L_dev: int  # layers per device (per pipeline stage)
    layer_dev: float  # one layer's weights per device
    pipe_note: PipelineNote | None
    one_f_one_b: bool  # an explicit schedule as sk.pipeline runs it: 1F1B, interleaved 1F1B, ZB-H1
    keep: bool  # an explicit schedule as Megatron-LM runs it (``Layout.keep_residuals``)
    recompute: str  # the remat policy the backward recomputes under: ``Layout.remat``, or its ``keep`` policy


def _sizes(ms: ModelShape, lo: Layout, prec: Precision, global_batch: int) -> _Sizes:
    bp, bc, bg, bo = (np.dtype(d).itemsize for d in (prec.params, prec.compute, prec.grads, prec.opt_state))
    replicas = lo.data * lo.fsdp * lo.expert
    # Expert weights (inside the layers) are split over ``expert`` too; every other weight is
    # replicated over it, so ZeRO shards those over it as over a data axis.
    p_expert = ms.expert_params / (lo.tensor * lo.pipe * lo.expert)
    p_layers = (ms.layer_params - ms.expert_params) / (lo.tensor * lo.pipe) + p_expert
    p_dev = p_layers + (ms.params - ms.layer_params) / lo.tensor

    def split(s: int, x: int) -> float:  # elements per device under ZeRO's shard
        return ((p_dev - p_expert) / x + p_expert) / s

    state = zero_state(lo.zero, model=split(lo.fsdp, 1), shard=split(lo.fsdp * lo.data, lo.expert))
    L_dev = max(ms.layers // lo.pipe, 1)
    pipe_note = layout_note(lo)
    explicit = lo.pipe > 1 and is_explicit(pipe_note)
    if lo.keep_residuals and (lo.pipe == 1 or lo.schedule not in ("1f1b", "interleaved-1f1b")):
        raise ValueError(f"Layout.keep_residuals describes Megatron's 1F1B and interleaved 1F1B; {lo} has "
                         f"pipe={lo.pipe}, schedule={lo.schedule!r}: use schedule='1f1b' or "
                         "'interleaved-1f1b' with pipe > 1, or keep_residuals=False")
    _check_keep(lo, explicit)
    return _Sizes(bp, bc, bg, bo, replicas, global_batch // replicas // lo.microbatches, p_expert, p_layers, p_dev,
                  lo.fsdp * (lo.data if lo.zero == 3 else 1), state,
                  lo.fsdp > 1 or (lo.zero == 3 and lo.data * lo.expert > 1), L_dev,
                  p_layers / L_dev if ms.layers else 0.0, pipe_note, explicit and not lo.keep_residuals,
                  explicit and lo.keep_residuals, lo.remat if lo.keep in ("input", "all") else lo.keep)


def _check_keep(lo: Layout, explicit: bool) -> None:
    """``Layout.keep`` as ``sk.pipeline`` accepts it: a name it knows, on an explicit schedule,
    with ``remat="none"`` (both say what the backward recomputes)."""
    if lo.keep not in KEEP:
        raise ValueError(f"Layout.keep={lo.keep!r}: use one of {KEEP} (sk.pipeline's keep=)")
    if lo.keep == "input":
        return
    if not explicit or lo.keep_residuals:
        raise ValueError(f"Layout.keep={lo.keep!r} is for sk.pipeline's explicit schedules {EXPLICIT} with "
                         f"pipe > 1 (and without keep_residuals); {lo} has pipe={lo.pipe}, schedule="
                         f"{lo.schedule!r}: leave keep='input' there")
    if lo.remat != "none":
        raise ValueError(f"Layout.keep={lo.keep!r} with remat={lo.remat!r}: both say what the backward "
                         "recomputes; use remat='none' with keep (keep='dots' keeps what remat='dots' saves), "
                         "or keep='input' with remat")


def _memory(s: _Sizes, ms: ModelShape, lo: Layout, global_batch: int) -> dict[str, float]:
    T, b, bc, bg = ms.seq, s.b, s.bc, s.bg
    act = activation_bytes(ms, lo, b, T // lo.context, bc) * s.L_dev  # context: T/c tokens per device
    if s.one_f_one_b:
        # sk.pipeline's explicit schedules keep rings of stage inputs and cotangents (and ZB-H1's
        # output cotangents waiting for their W), one spare slot each, sized by the executed
        # table, beside the pipeline's m input rows and their cotangent's m + 1, accumulated in
        # f32; and rebuild one chunk's residuals (L/(p·v) layers, one microbatch) at a time in a
        # backward op. A stage input is split over ``context``, and over ``tensor`` under
        # sequence parallelism, as on the wire. [issue 37: the cotangent rows counted in the
        # compute dtype and no spare slots: 0.5 / 1.0 GiB under the Llama 3 405B compiles at
        # m = 16 / 32.]
        table = schedule_table(s.pipe_note)
        stage_input = b * T / lo.context * ms.d_model * bc / (lo.tensor if lo.sequence_parallel else 1)
        m = lo.microbatches
        rings = (table.act_ring + table.grad_ring + 2 + m + (m + 1) * 4 / bc) * stage_input
        if lo.keep == "input":
            act = act / lo.repeats + rings
        else:
            # ``sk.pipeline(keep=)``: every in-flight chunk-microbatch's residuals (the policy's
            # saved set) wait in ``res_ring`` slots, the loss's in ``loss_res_ring``; a backward
            # op reads its slot and adds one layer's cotangents at a time. A one-layer chunk's
            # slot does not store its input (``keep.Pullbacks``: the op's own inputs are put
            # back), which "lean" and "dots" count as the layer's input; a layer scan's stacked
            # inputs hold the first layer's too (H100 compiles: 308 MiB a slot of Llama 3 405B's
            # one-layer chunks, two layers' inputs in a two-layer chunk's).
            layer = activation_bytes(ms, dataclasses.replace(lo, remat=s.recompute), b, T // lo.context, bc)
            chunk_layers = max(s.L_dev // lo.repeats, 1)
            own_input = stage_input if s.recompute in ("lean", "dots") and chunk_layers == 1 else 0.0
            kept = layer * chunk_layers - own_input
            act = (table.res_ring * kept + layer + rings
                   + table.loss_res_ring * loss_kept_bytes(ms, lo, b, bc, s.recompute, stage_input))
    elif s.keep:
        # The busiest stage holds ceil(L/p) layers, in v chunks, and the residuals of every
        # chunk-microbatch between its forward and its backward (``in_flight``).
        stage = -(-ms.layers // lo.pipe)
        act *= stage / s.L_dev * in_flight(lo) / lo.repeats
    elif lo.pipe > 1:
        act *= lo.microbatches
    act += loss_bytes(ms, lo, b, bc)
    mem = {"params": s.state["params"] * s.bp, "opt_state": 2 * s.state["opt_state"] * s.bo}  # Adam: 2 moments
    grads = s.state["grads"] * max(bg, 4 if lo.microbatches > 1 else bg)
    mem["grads"] = grads
    mem["activations"] = act
    mem["batch"] = 2 * global_batch * T * 4 / s.replicas
    mem["arguments"] = mem["params"] + mem["opt_state"] + mem["batch"]
    gathered = (2 * s.layer_dev * bc + s.layer_dev * bg) if s.sharded else (
        s.layer_dev * bg
        if lo.fsdp * (lo.data if grads_on_shard(lo.zero, lo.microbatches, lo.pipe > 1) else 1) > 1 else 0.0)
    if s.one_f_one_b:
        # The loop accumulates the stage's gradients in f32, whole, once (the switch's branch
        # hands back its op's gradients in the compute dtype, one chunk's, added in place after
        # it), and reduces them once after it: that buffer is the step's gradient (``grads``)
        # unless ZeRO-2/3 or fsdp shard those, and so is the loss params' (an output head's).
        # The layer scan's loop carries the chunk's weights once more. Sharded weights are
        # gathered whole at the pipeline's entry in the compute dtype; with v > 1 chunks the
        # loop reads them from their stage-major copy (pipe-relayout's result, written over the
        # gathered one: one copy). Against XLA:GPU's compiles of Llama 3 405B at pipe=16 x
        # tensor=8 (x data=64, ZeRO-3), interleaved 1F1B (bench/llama3_compile.py): 3 more
        # stage gradients and one layer gathered at a time had the peak at 1.63x and 0.69x of
        # the compile; [issue 37] the accumulators counted twice (as the executor held them
        # before ``explicit._accumulate``) and two weight copies, 1.24-1.47x.
        chunk = s.p_layers / lo.repeats * bc
        gathered = 2 * chunk + (s.p_layers * bc if s.sharded or lo.repeats > 1 else 0.0)
        if s.state["grads"] < s.p_dev:
            loss_params = (ms.matmul_params - ms.layer_params) / lo.tensor
            gathered += (s.p_layers + loss_params) * 4
    if s.keep:
        # The stage's gradients accumulate over the microbatches in one f32 buffer (Megatron's
        # main_grad), the step's gradient unless ZeRO-2/3 or fsdp shard those, and are reduced
        # once after the last; sharded weights are gathered once per step and kept until its
        # end (FSDP without resharding after the forward).
        gathered = (s.p_dev * 4 if s.state["grads"] < s.p_dev else 0.0) + (s.p_dev * bc if s.sharded else 0.0)
    new_params = s.p_dev * s.bp / (s.s_param if lo.zero == 3 or lo.fsdp > 1 else 1)
    mem["temporaries"] = step_temporaries(pass_peak=grads + act + gathered, grads=grads, update=new_params)
    mem["peak"] = mem["arguments"] + mem["temporaries"]
    return mem


def _collectives(s: _Sizes, ms: ModelShape, lo: Layout) -> tuple[dict, dict]:
    m, T, b, bc, bg, bp = lo.microbatches, ms.seq, s.b, s.bc, s.bg, s.bp
    p_dev, L_dev, replicas = s.p_dev, s.L_dev, s.replicas
    tokens_mb = b * T
    tokens_dev = tokens_mb / lo.context  # a context axis splits every activation's tokens
    parts = []  # the roles' traffic, added up once at the end
    # A pipeline reduces (and, sharded, gathers) the weights once per step: its shard_map is
    # manual over the data axes, so gradients stay local in the loop (``sk.pipeline``).
    per_step = 1 if lo.pipe > 1 else m
    if replicas > 1:
        # ZeRO-3/FSDP gathers each layer for the forward and again for the backward.
        # Expert gradients are reduced over the data axes only (each expert lives on one
        # device of the ``expert`` axis).
        # A pipeline's gradient reduction is its own formula (``pipeline_traffic``, below).
        reduced = p_dev - (0.0 if lo.data * lo.fsdp > 1 else s.p_expert)
        parts.append(data_traffic(reduced=0.0 if lo.pipe > 1 else per_step * reduced,
                                  reduce_ops=0 if lo.pipe > 1 else per_step * max(L_dev, 1),
                                  gathered=(1 if s.keep else 2) * per_step * p_dev if s.sharded else 0.0,
                                  gather_ops=(1 if s.keep else 2) * per_step * max(L_dev, 1),
                                  zero12_gathered=p_dev if lo.zero in (1, 2) else 0.0, bg=bg, wire=bc, bp=bp))
    elif lo.context > 1:
        # Weights are replicated over ``context`` and each shard of the sequence contributes
        # to every gradient: they are reduced over it as over a data axis (with data axes, in
        # the same reduction). A tied table's two gradients (lookup and head) are reduced apart.
        tied = ms.vocab * ms.d_model / lo.tensor if (ms.tie and ms.vocab) else 0.0
        parts.append(data_traffic(reduced=m * (p_dev + tied), reduce_ops=m * max(L_dev, 1), bg=bg, wire=bc,
                                  bp=bp))
    if lo.tensor > 1 and ms.d_model:
        # Each layer's 2 TP regions (attention, MLP) close with a row-parallel weight (reduced in
        # the forward; again in 1F1B's recomputed forward) and open with a column-parallel one
        # (reduced in the backward); the vocab-parallel embedding and head add one each.
        recomputed = 2 * L_dev if s.one_f_one_b and lo.keep == "input" else 0
        # Under sequence parallelism every region gathers its input a third time, as Megatron
        # does (it keeps the sequence shard and gathers it again for the weight gradients): the
        # runs this model is calibrated on. A recipe step that keeps the gathered input gathers
        # twice where its forward is not recomputed (``from_step`` counts what the traced step does).
        parts.append(tensor_traffic(forward=2 * L_dev + recomputed + 1, backward=2 * L_dev + 1, regions=2 * L_dev,
                                    regathered=2 * L_dev, head_gather=True, tokens=tokens_dev, width=ms.d_model,
                                    wire=bc, microbatches=m, sequence_parallel=lo.sequence_parallel))
    if lo.expert > 1 and ms.experts:
        # Every MoE layer of every microbatch sends its tokens to their experts and back,
        # forward and backward (sk.moe; inside a pipeline's stages XLA moves them instead).
        # Dropless, on the GPUs and TPUs this table holds, sk.moe's "auto" dispatch sends only
        # the routed rows (ragged-all-to-all), except nested in a pipeline's shard_map.
        n_moe = max(ms.layers // ms.moe_every // lo.pipe, 1)
        parts.append(RoleTraffic({"expert-all-to-all": m * n_moe * moe_traffic(
            tokens=tokens_mb, d_model=ms.d_model, experts=ms.experts, top_k=ms.top_k,
            capacity_factor=ms.capacity_factor, group_size=T, bytes_per_element=bc, axis_size=lo.expert,
            ragged=ms.capacity_factor is None and lo.pipe == 1)}, {"expert-all-to-all": 4 * m * n_moe}))
    if lo.context > 1 and ms.heads and ms.d_model:
        # Every attention layer of every microbatch runs one ring (sk.context_attention).
        kv_heads = (ms.kv_heads or ms.heads) / lo.tensor
        kv_block = b * (T / lo.context) * kv_heads * (ms.d_model / ms.heads)
        parts.append(RoleTraffic({role: m * L_dev * nbytes for role, nbytes in context_traffic(
            kv_block=kv_block, context=lo.context, bytes_per_element=bc).items()}))
    if lo.pipe > 1:
        # Activations cross the pipe in the compute dtype (the hardware table holds accelerators;
        # only XLA:CPU needs f32 there, which ``from_step`` reads off a real step); sequence
        # parallelism shards them over ``tensor``.
        tied = ms.vocab * ms.d_model / lo.tensor if (ms.tie and ms.vocab) else 0.0
        parts.append(pipeline_traffic(s.pipe_note, stage=s.p_layers, rest=p_dev - s.p_layers, tied=tied,
                                      act_mb=tokens_dev * ms.d_model * bc / (lo.tensor if lo.sequence_parallel else 1),
                                      has_dx=ms.vocab > 0, wire=bc, bg=bg, n_data=replicas))
    total = sum(parts, RoleTraffic.zero())
    col, counts = dict(total.bytes), dict(total.ops)
    if lo.pipe > 1 and s.keep:
        # Megatron sends one activation forward and one gradient backward per chunk and
        # microbatch, only where there is one (no collective on idle ticks); its chunks stay
        # where they are (no relayout); the input's gradient stays on the first stage and only
        # a tied table's two gradients are all-reduced between first and last stage (Narayanan
        # et al. 2021, sec. 2.2 and 4.1): these replace sk.pipeline's pipe roles.
        sends = 2 * lo.repeats * m
        col["pipe-permute"], counts["pipe-permute"] = sends * tokens_dev * ms.d_model * bc / (
            lo.tensor if lo.sequence_parallel else 1), sends
        col["pipe-relayout"] = counts["pipe-relayout"] = 0.0
        col["pipe-reduce"], counts["pipe-reduce"] = tied * bg, 1 if tied else 0
    return col, counts


def _flops(s: _Sizes, ms: ModelShape, lo: Layout, global_batch: int) -> tuple[float, float, float]:
    """(flops executed, flops timed, model flops) per device per step."""
    model_flops = ms.flops_per_token * global_batch * ms.seq / lo.devices
    recompute = {"none": 1.0, "dots": 7.0 / 6.0, "full": 8.0 / 6.0}.get(s.recompute, 1.0)
    if s.one_f_one_b and lo.keep == "input":  # backward ops recompute the chunk's forward from its saved input
        recompute += recompute_factor(s.pipe_note) - 1.0
    flops = busy = model_flops * recompute
    if lo.pipe > 1 and not (s.one_f_one_b or s.keep) and ms.layer_params:
        # GPipe/circular idle ticks compute too: the layers' share of the flops, ticks/(v·m) times.
        head = 6.0 * ms.d_model * ms.vocab if ms.vocab else 6.0 * (ms.params - ms.layer_params)
        flops = idle_tick_flops(s.pipe_note, busy, max(ms.flops_per_token - head, 0.0) / ms.flops_per_token)
    return flops, busy, model_flops


def loss_bytes(ms: ModelShape, lo: Layout, b: int, bc: int) -> float:
    """The loss's working bytes for one microbatch of ``b`` sequences: the plain loss's whole f32
    logits and their softmax, or ``sk.chunked_cross_entropy``'s (``ModelShape.loss_chunk``) one
    chunk's logits cotangent in the compute dtype and the f32 (vocab, d_model) accumulator of the
    output matrix's gradient (its floor). The vocabulary is split over ``tensor``, the tokens over
    ``context``. Against XLA:GPU's H100 compiles of the loss at Llama 3's vocabulary (BENCHMARKS.md,
    "Kernels"): chunks of 256 to 1024 at 0.97 of the compiled temporaries."""
    if not ms.vocab:
        return 0.0
    if not ms.loss_chunk:
        return 2 * b * ms.seq * ms.vocab * 4 / lo.tensor / lo.context
    chunk = min(ms.loss_chunk, ms.seq) / lo.context  # strided chunks: a context split splits each
    return (b * chunk * bc + ms.d_model * 4) * ms.vocab / lo.tensor


def loss_kept_bytes(ms: ModelShape, lo: Layout, b: int, bc: int, recompute: str, stage_input: float) -> float:
    """What an explicit schedule's loss F keeps for its backward (one slot of
    ``Schedule.loss_res_ring``): the policy's saved set or the loss's own residuals, whichever
    is smaller (``keep.Kept.loss_shapes``; "lean" runs the loss under ``dots``: a loss names no
    ``LEAN_RESIDUALS``): ``sk.chunked_cross_entropy``'s own VJP keeps its input (the stage
    output, ``stage_input`` bytes) and each position's f32 log-sum-exp; the plain loss keeps its
    f32 logits (``loss_bytes``). [issue 37: every slot counted the loss's working bytes, 1 GiB
    at Llama 3 405B's vocabulary, x16 slots at m = 16; "lean" counted the input alone, as the
    executor ran it until its loss took ``dots`` too, recomputing the head in the backward.]"""
    if ms.loss_chunk:
        return stage_input + b * ms.seq / lo.context * 4
    return loss_bytes(ms, lo, b, bc)


def in_flight(layout: Layout) -> int:
    """Chunk-microbatches whose residuals the first pipeline stage holds at its peak, under
    Megatron-LM's 1F1B (p − 1 warm-up forwards and one more: p, Narayanan et al. 2021 sec.
    2.2.1) and interleaved 1F1B ((v − 1)·p + 2(p − 1) warm-up chunk forwards and one more,
    Megatron-LM's ``forward_backward_pipelining_with_interleaving``): v·p + p − 1 chunks of
    L/(v·p) layers, L·(1 + (p − 1)/(p·v)) layers' worth (Korthikanti et al. 2022, sec. 4.2,
    pipeline parallelism); never more than the v·m there are."""
    p, m, v = layout.pipe, layout.microbatches, layout.repeats
    return min(p if v == 1 else v * p + p - 1, v * m)


def diloco_speedup(model: Any, layout: Layout, hardware: str | hw_lib.Hardware = "h100", *, global_batch: int,
                   **kw) -> float:
    """Estimated step-time ratio of data parallelism over the same devices (``replica`` folded
    into ``data``, so its gradient all-reduce crosses the slow link every step) to the DiLoCo
    ``layout``: > 1 where DiLoCo is faster per step. Tokens per step are equal; whether the
    loss keeps up is the optimizer's business (``bench/diloco.py``)."""
    if layout.replica < 2:
        raise ValueError(f"diloco_speedup needs a Layout with replica > 1, got {layout}")
    dp = dataclasses.replace(layout, replica=1, diloco_every=1, data=layout.data * layout.replica)
    return (estimate(model, dp, hardware, global_batch=global_batch, **kw).step_time
            / estimate(model, layout, hardware, global_batch=global_batch, **kw).step_time)
