"""What ``sk.pipeline`` costs per device, for the step estimate (``from_step``) and the
analytic model (``from_shape``): its schedule's ticks and bubble, the buffers it holds beside the
saved residuals, the explicit-backward loop's working set and recompute, and the collectives it
issues. Everything is read off its trace note (``plan.note("pipeline", ...)``), the schedule
table the executor scans (``sk.pipeline_schedule``) and the leaves' specs; nothing is compiled.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from ...pipeline import schedules as sched
from ..pipeline_note import PipelineNote, is_explicit, schedule_table
from ..terms import RoleTraffic


def layout_note(layout) -> PipelineNote:
    """The trace note a ``cost.Layout``'s pipeline would leave (what the analytic model and the
    step time feed the functions here)."""
    return PipelineNote(stages=layout.pipe, microbatches=layout.microbatches, repeats=layout.repeats,
                        schedule=layout.schedule)


def pipeline_ticks(note: PipelineNote | Mapping) -> int:
    """Ticks of the table ``sk.pipeline`` scans: the explicit schedules' whole table, the
    GPipe/circular forward table (autodiff mirrors it)."""
    note = PipelineNote.of(note)
    if is_explicit(note):
        return schedule_table(note).ticks
    return int(sched.forward_table(note.stages, note.microbatches, note.repeats).item.shape[0])


def pipeline_bubble(note: PipelineNote | Mapping) -> float:
    """Idle over busy (tick, stage) cells of the executed table: the bubble as a fraction of
    the ideal time, (p-1)/m for GPipe and 1F1B, (p-1)/(v·m) interleaved (Narayanan et al.
    2021), (p-1)/(3m) for ZB-H1 (Qi et al. 2024, unit F = B = W slots)."""
    f = schedule_table(PipelineNote.of(note)).bubble_fraction
    return f / (1.0 - f)


def recompute_factor(note: PipelineNote | Mapping) -> float:
    """Flops of the layers per step over the un-pipelined model's (forward F, backward 2F,
    split B = W = F; Qi et al. 2024). Every explicit schedule recomputes the chunk's forward
    once per microbatch: 1F1B and interleaved 1F1B in the fused backward op; ZB-H1 and ZB-V in
    B, which keeps for W what W reads (``pipeline.split``: W runs only the weight-gradient
    matmuls): 4F/3F. GPipe/circular: 1 (their idle-tick compute is counted apart, from the
    ticks). [issue 25: ZB-H1 was 2.0 when B and W each recomputed the forward.]"""
    return 4.0 / 3.0 if is_explicit(PipelineNote.of(note)) else 1.0


def pipeline_note(step, state, batch, pipeline, sizes) -> PipelineNote | None:
    """What ``sk.pipeline`` did inside the loss: the explicit ``pipeline=`` override
    (``(microbatches, schedule, repeats)``, a ``PipelineNote`` or a dict of its fields), else the
    step's trace note (the step is lowered once here if it has not been traced yet); ``None``
    without a pipe axis."""
    if isinstance(pipeline, PipelineNote):
        return pipeline if pipeline.stages > 1 else None
    if pipeline is not None:
        if isinstance(pipeline, Mapping):
            note = dict(pipeline)
        else:
            pm, schedule, v = (tuple(pipeline) + ("gpipe", 1))[:3]
            note = {"microbatches": pm, "schedule": schedule, "repeats": v}
        note.setdefault("stages", sizes.get(note.get("axis", "pipe"), 1))
        return PipelineNote.of(note) if note["stages"] > 1 else None
    if sizes.get("pipe", 1) <= 1 and not step.trace_notes.get("pipeline"):
        return None
    if "pipeline" not in step.trace_notes:
        try:
            step.lower(state, batch)
        except Exception:  # noqa: BLE001 - an estimate without the pipeline beats none
            return None
    note = step.trace_notes.get("pipeline")
    return PipelineNote.of(note) if note and note.get("stages", 1) > 1 else None


def pipeline_buffers(pipe: PipelineNote, act_elems_x4: float, grad_bytes: float) -> float:
    """Bytes ``sk.pipeline`` holds beside the saved residuals: GPipe/circular the (m + 1)
    output slots and their cotangent; 1F1B the rings of stage inputs and cotangents, and a
    second copy of the gradients (its custom_vjp returns them as residuals, then scales).
    The explicit schedules' ring sizes come from their table."""
    pm = pipe.microbatches
    act_mb = act_elems_x4 / pm
    if is_explicit(pipe):
        tab = schedule_table(pipe)
        return grad_bytes + (tab.act_ring + tab.grad_ring) * act_mb
    return 2 * (pm + 1) * act_mb


def one_f_one_b_loop(pipe: PipelineNote, act_elems_x4: float, stage_grads: float, rest_grads: float,
                      stage_residuals: float, stage_layers: int, w_saved: float = 0.0,
                      op_peak: float | None = None, acc_ratio: float = 1.0, chunk_weights: float = 0.0,
                      kept: float = 0.0, loss_kept: float = 0.0, w_forwarded: float = 0.0,
                      loss_out: float = 0.0, whole_recompute: bool = False) -> float:
    """Temporaries of ``sk.pipeline``'s explicit-backward loop (1F1B, interleaved 1F1B, ZB-H1,
    ZB-V; rings sized from the table) at its peak, a backward op, per device.

    What the scan carries from tick to tick: the f32 gradient accumulators (the stage's, the
    loss params', the input's ``(m + 1)`` microbatch rows — f32 too, ``acc_ratio`` times a
    microbatch's activation bytes) and ZB's ring of pending W's (``w_ring`` slots of
    ``w_saved`` bytes, ``pipeline.split``). The accumulators are held once: a branch of the
    ``lax.switch`` hands back only its op's gradients (compute dtype), added in place after it;
    the W ring is only read there and written after it, in place (the branch hands back one
    slot). Alive throughout: the W ring, the rings of stage inputs
    and cotangents (one spare slot each) and the pipeline's input (all microbatches of a
    device's rows).

    At its peak, inside a backward op, the tick holds ``op_peak`` beside them: the liveness peak of the chunk's recomputed forward and its
    VJP for one microbatch (``pipeline_memory`` reads it off the jaxpr the trace note keeps: the
    layers' saved inputs, one layer's recomputed intermediates with their cotangents, the
    chunk's weight gradients), the branch's new loss-params accumulator and ``chunk_weights``:
    the chunk's compute-dtype weights once more, as the layer scan's loop carries them (XLA
    gives a loop's carry buffers of its own, and the weights stay alive after the loop for
    the next op: they are copied in). [issue 37: when every branch handed back the
    accumulators whole, XLA held them twice (the conditional's operand and its result): Llama 3
    405B keep="lean" on 16,384 H100s 79.42 GiB, 67.53 with them once. issue 25: when the branches returned the W ring whole, XLA held
    it twice — ZB-H1 at d=512 on H100 659.5 MiB, ZB-V 639.2; read-only in the switch, 546.6 and
    438.2.]

    With residuals kept (``kept``) the op reads them instead of recomputing, and ``op_peak``
    (the recomputing op's jaxpr, whose forward's saved values stand for the slot's copy the op
    reads) is corrected where the kept op differs from it. ZB's B runs each layer's VJP on its
    own (``pipeline.split``), with residuals kept or not: of what ``op_peak`` counts beyond the
    forward's saved values (the kept slot, or ``stage_residuals`` where B runs the forward
    itself) — the checkpoint's recompute for all ``stage_layers`` layers at once (1F1B's fused
    op checkpoints its layer scan whole: XLA materialises every layer's recomputed values
    before the first layer's backward) and the backward's working set — B holds one layer's
    where the op checkpoints the chunk whole (``whole_recompute``: a keep policy, or
    ``keep="input"`` on layers that do not checkpoint themselves; a layer that does recomputes
    itself one at a time in ``op_peak`` already) [issue 37, H100: ZB-H1 keep="input"
    1.12-1.13x the compiled temporaries with the whole op, 0.98-1.00 with one layer's share]. On the loss's chunk the loss's backward runs first, from
    its kept values, and XLA runs the loss params' weight-gradient matmul after the chunk's
    backward (off the critical path, as in GPipe's backward): its operand, the loss's matmul
    output cotangent in f32 (``loss_out`` bytes, a microbatch's logits), stays alive through
    the chunk's backward. [issue 37, H100 shape (c): 1F1B keep="dots" 0.89 of the compiled
    temporaries without it (the op on the loss chunk held the f32 logits' cotangent), ZB-H1
    keep="dots" 1.10 (the whole-chunk recompute counted for B).]

    Without ``op_peak`` (no jaxpr in the note): the stage's residuals for the microbatch and
    one layer's share of them again in cotangents and a fresh stage gradient [issue 24's form, which missed the layer's recomputed intermediates: 0.52
    to 0.79 of the compiled temporaries on H100]."""
    pm = pipe.microbatches
    act_mb = act_elems_x4 / pm
    tab = schedule_table(pipe)
    if op_peak is not None:
        operands = stage_grads + rest_grads + (pm + 1) * act_mb * acc_ratio
        # ZB's W ring is read in the switch and written after it, in place: held once, and
        # every branch hands back one slot (B its new entry, built up through the chunk's
        # layers beside the op's own peak; the others the slot they read).
        # B's new slot: less, where B runs the forward itself (``keep="input"``), the forward's
        # residuals in it (``w_forwarded`` bytes), which ``op_peak`` counts as the forward's
        # saved values (H100, issue 37: ZB-H1 1.20x the compiled temporaries without this).
        new_w = w_saved - (w_forwarded if not kept else 0.0)
        throughout = (tab.act_ring + tab.grad_ring + 2) * act_mb + pm * act_mb + tab.w_ring * w_saved + new_w
        # ``sk.pipeline(keep=...)``: a chunk-microbatch's kept residuals (``kept`` bytes) wait
        # in a ring of ``res_ring`` slots, the loss's (``loss_kept``) in one of
        # ``loss_res_ring``, allocated on every device; the slot a backward op reads stands in
        # for the recomputed residuals ``op_peak`` counts.
        throughout += tab.res_ring * kept + tab.loss_res_ring * loss_kept
        if tab.name in sched.SPLIT and whole_recompute:
            # B holds the forward's saved values (the kept slot, or with ``keep="input"`` the
            # residuals it saves itself) and one layer's share of the rest.
            saved = kept if kept else stage_residuals
            op_peak = saved + max(op_peak - saved, 0.0) / stage_layers
        if kept:
            op_peak += loss_out
        return throughout + operands + op_peak + rest_grads + chunk_weights
    rings = (tab.act_ring + tab.grad_ring + 2) * act_mb + tab.w_ring * w_saved
    carry = stage_grads + rest_grads + (pm + 1) * act_mb * acc_ratio + rings + pm * act_mb
    backward_op = stage_grads + rest_grads + stage_residuals * (1 + 1 / stage_layers)
    # [issue 25] ZB-H1/ZB-V: B keeps what its W reads (``w_saved`` bytes per pending W, the
    # trace note's ``w_saved``; ``pipeline.split``) in a ring of ``w_ring`` slots, carried
    # through the loop, and the switch hands back one slot (the ring itself is only read there).
    return carry + backward_op + w_saved


def pipelined_uses(pipe: PipelineNote, layers: int) -> float:
    """Layer applications per device per step, in units of one layer over the whole local
    batch: GPipe/circular run their k = L/(p·v) layers every tick (idle ticks compute too) on
    a 1/m microbatch; the explicit schedules run each of their L/p layers' forward once per
    microbatch (their backward ops' recompute: ``recompute_factor``)."""
    p, pm, v = pipe.stages, pipe.microbatches, pipe.repeats
    if is_explicit(pipe):
        return layers / p
    return pipeline_ticks(pipe) * layers / (p * v) / pm


def idle_tick_flops(note: PipelineNote, busy: float, part: float, whole: float = 1.0) -> float:
    """The flops a GPipe/circular pipeline executes for ``busy`` useful ones, ``part / whole``
    of them its stages': every tick runs every device's layer group, idle ones too (on data
    the schedule then discards), so the stages' matmuls run ticks/(v·m) times their useful
    count. (1F1B's switch runs one branch a tick: no extra flops.) The step time is timed on
    the busy flops; its bubble (``steptime.times``) stands for the idle ticks."""
    extra = pipeline_ticks(note) / (note.repeats * note.microbatches) - 1
    return busy * (1 + extra * part / whole)


def pipeline_traffic(pipe: PipelineNote, *, stage: float, rest: float, tied: float, act_mb: float,
                     has_dx: bool, wire: int, bg: int, n_data: int, step_m: int = 1) -> RoleTraffic:
    """``sk.pipeline``'s collectives per device per step, by role: the one formula set both
    estimators use, fed by a ``ModelShape`` (``from_shape.estimate``) or by a real step's leaf
    sums (``from_step``).

    Args:
        pipe: the pipeline's note (stages, microbatches, repeats, schedule; ``data_axes``:
            the data axes the shard_map made manual — absent means manual).
        stage, rest: elements of one device's stage weights and of the other parameters.
        tied: elements of a table that is looked up before the pipeline and is also its
            head (reduced apart from the head's part).
        act_mb: bytes of one pipeline microbatch's activations crossing a stage boundary.
        has_dx: the pipeline's input is differentiable (it came from an embedding).
        wire: bytes per element of the weights on the wire; bg: of gradients.
        n_data: devices along the data axes; step_m: the step's own microbatches.

    * ``pipe-permute``: every tick hands one activation microbatch down the pipe, and (explicit:
      its cotangent up; GPipe/circular: the transposed scan's permute) back — 2 per tick.
      GPipe/circular also move the last stage's m outputs and their cotangent once.
    * ``pipe-relayout``: circular and interleaved 1F1B (v > 1) reorder the weights stage-major (forward) and the
      gradients back (backward): XLA swaps halves with one all-to-all for p = 2, and adds a
      permute for p > 2.
    * ``pipe-reduce``: the psum that broadcasts what lives on one stage: GPipe/circular the
      m outputs (and, backward, the input's cotangent); 1F1B the loss params' gradients (+ the
      input's).
    * ``grad-reduce`` over the data axes (the weights' whole reduction: a caller leaves it out of
      ``roles.data_traffic``; what else the step reduces over data, its row syncs, stays beside
      it): ``sk.pipeline`` makes the data axes manual and
      reduces the stage weights' gradient once per pipeline call, after the loop, like the
      params outside the stacks (1F1B: the loss params, in the same psum); a tied table twice.
      When the data axes stayed compiler-managed (a pipeline with ``rng``), XLA reduces where
      the gradient is produced instead — every tick of the transposed scan (GPipe/circular,
      ticks × a layer group), every backward op of 1F1B (m × the stage) — and 1F1B's loss
      params m times on the last stage (m/p per device).
    """
    p, pm, v = pipe.stages, pipe.microbatches, pipe.repeats
    ticks = pipeline_ticks(pipe)
    col, counts = defaultdict(float), defaultdict(float)
    col["pipe-permute"] += 2 * ticks * act_mb * step_m
    counts["pipe-permute"] += 2 * ticks * step_m
    if v > 1:
        hops = 1 if p == 2 else 2
        col["pipe-relayout"] += 2 * stage * wire * hops * step_m
        counts["pipe-relayout"] += 2 * hops * step_m
    if not is_explicit(pipe):
        col["pipe-permute"] += 2 * pm * act_mb * step_m
        counts["pipe-permute"] += 2 * step_m
        col["pipe-reduce"] += pm * act_mb * step_m * (2 if has_dx else 1)
    else:
        col["pipe-reduce"] += (rest * bg + (pm * act_mb if has_dx else 0.0)) * step_m
    counts["pipe-reduce"] += step_m
    if n_data > 1:
        if pipe.manual_data:
            col["grad-reduce"] += (stage + rest + tied) * bg * step_m
            counts["grad-reduce"] += 2 * step_m
        elif is_explicit(pipe):
            col["grad-reduce"] += (pm * stage + pm / p * rest) * bg * step_m
            counts["grad-reduce"] += (pm + 1) * step_m
        else:
            col["grad-reduce"] += (ticks * stage / v + rest) * bg * step_m
            counts["grad-reduce"] += (ticks + 1) * step_m
    return RoleTraffic(dict(col), dict(counts))
