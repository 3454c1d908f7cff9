"""The cost model fed by a real ``sk.train_step``: each leaf's resolved spec, not global shapes.

Everything here is bookkeeping on specs and abstract shapes and one abstract trace of the loss
(``step_facts``); nothing is compiled. ``sk.cost.estimate_for_step``
is the public entry point; ``step.explain()`` compares it with the compiled program. What the
figures read is gathered once in ``step_facts`` (the traced program's reading among it); the
per-leaf accounting is ``leaf_sizes``; the per-role formulas ``roles`` and ``pipeline_cost``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ...rules import entry_axes
from .. import hardware as hw_lib
from ..terms import Estimate, Layout, RoleTraffic, tokens_in
from .steptime import roofline_excess, times
from .pipeline_memory import (backward_op_peak, chunk_layers, chunk_weights, gpipe_backward, kept_rings,
                              loss_out_bytes, microbatch_rows, saved_bytes, w_forwarded_bytes, whole_recompute)
from .roles import data_traffic, grads_on_shard, step_temporaries, tensor_traffic
from .caveats import step_caveats
from . import gpu_combining
from ..pipeline_note import is_explicit
from .pipeline_cost import (idle_tick_flops, one_f_one_b_loop, pipeline_buffers, pipeline_ticks, pipeline_traffic,
                            recompute_factor)
from .leaf_sizes import argument_memory, grad_reduce_elems, residual_bytes, tensor_uses
from .step_facts import StepFacts, loop_grads_on_shard, step_facts


def step_estimate(step, state, batch, *, pipeline=None, hardware=None, flops_per_token=None) -> Estimate:
    """The ``Estimate`` of one step of ``step`` on ``state`` and ``batch`` (see the module
    docstring); ``pipeline``: an ``sk.pipeline`` trace note to use instead of the step's."""
    # The loss closes over the model state (BatchNorm statistics): an abstract one
    # (``sk.cost.simulate``'s) is traced as zeros of its shapes — jax arrays, which a Flax NNX
    # BatchNorm can write its new statistics into while the loss is traced (a numpy one it
    # would assign a tracer into, in place).
    state = state.replace(model_state=jax.tree.map(
        lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, state.model_state))
    s = step_facts(step, state, batch, pipeline)
    arguments = argument_memory(step, state, batch, s.lv)
    mem = {**arguments, **(_pass_memory(s, arguments["grads"]) if not s.pipe
                           else _pipeline_memory(s, arguments["grads"]))}
    mem["peak"] = mem["arguments"] + mem["temporaries"] + (0 if step.donate else mem["arguments"])
    col, counts = _collectives(s)
    flops, busy, fpt = _flops(s, flops_per_token)
    tokens = tokens_in(batch)
    mesh, sizes, pipe = step.plan.mesh, s.sizes, s.pipe
    hw = _hardware(hardware, mesh)
    layout = Layout(data=math.prod(sizes[a] for a in ("replica", "data") if a in sizes),
                    fsdp=sizes.get("fsdp", 1), tensor=sizes.get("tensor", 1), pipe=pipe.stages if pipe else 1,
                    zero=s.zero, microbatches=pipe.microbatches if pipe else s.m,
                    schedule=pipe.schedule if pipe else "gpipe", repeats=pipe.repeats if pipe else 1)
    t = times(col, counts, busy, hw, layout, memory_seconds=_memory_seconds(s, mem, hw))
    n_dev = mesh.size
    notes = list(s.reading.notes)
    if not pipe and s.platform == "cpu":
        notes.append("modelled memory: a liveness simulation of the traced forward + backward pass with "
                     "XLA's fusion rules: the bytes alive at once. XLA's temporaries are its packing of its "
                     "buffers into one heap, which large steps leave fragmented (1.3-1.4x the bytes alive at "
                     "once on a 1B transformer at 2048 tokens; not modelled, BENCHMARKS.md)")
    if flops_per_token is None and not pipe:
        notes.append("modelled flops: every matmul and convolution of the traced program, per device")
    plan, lv = step.plan, s.lv
    tensor_split = [any(a not in plan.batch_axes and sizes.get(a, 1) > 1 for e in l.spec for a in entry_axes(e))
                    for l in lv.leaves]
    caveats = step_caveats(s.reading, [st < c for st, c in zip(lv.stored, lv.comp)], tensor_split, bool(pipe),
                           bool(step.trace_notes.get("moe")), s.data_axes, s.sp)
    return Estimate(mem, col, flops, fpt * tokens / n_dev, t, hw.name, layout, tokens,
                    hw.hbm_bytes, n_dev, notes, caveats)


def _pass_memory(s: StepFacts, grad_bytes: float) -> dict[str, float]:
    """Temporaries and activations of a step without a pipeline (``grad_bytes``: its gradients').

    The pass's own peak (its gradients live at its end), or, after it, the reduced gradients
    beside the unreduced ones, a ZeRO-1/2 update's new parameter shard before the gather, and
    the microbatch accumulator. The reduced gradient is a new buffer (a collective does not
    write in place): a full copy without ZeRO-2; with it the shard — except on XLA:CPU for a
    gradient made outside a loop, which it all-reduces whole and slices after (a loop's stacked
    gradient is reduced slice by slice inside the loop)."""
    lv, zero = s.lv, s.zero
    whole = [(f if not grads_on_shard(zero, s.m, bool(s.pipe)) or (s.platform == "cpu" and not loop) else z)
             for f, z, loop in zip(lv.full, lv.zshard, s.reading.loop_use)]
    reduced = sum(whole) * s.bg if s.n_data > 1 else 0.0
    shard_update = sum(lv.zshard) * s.bp if zero in (1, 2) and s.n_data > 1 else 0.0
    accumulate = grad_bytes if s.m > 1 else 0.0
    if s.platform == "gpu":
        # XLA:GPU's scheduler issues the ZeRO-3/FSDP gathers of weights used outside a loop
        # early, to overlap them with compute, and keeps each gathered copy to its backward
        # use: all of them are alive at once (measured on H100 compiles of the house MLP at
        # ZeRO-3: 0.57 -> see BENCHMARKS.md). XLA:CPU gathers each just before its use.
        accumulate += sum(c - st for c, st, loop in zip(lv.comp, lv.stored, s.reading.loop_use)
                          if st < c and not loop) * s.bc
    # A loop's stacked gradient is reduced slice by slice inside the loop (``loop_stacks``):
    # what it leaves is the shard, not the whole gradient beside it.
    on_shard = loop_grads_on_shard(s.platform, s.n_data, zero, s.m, bool(s.pipe))
    grads = sum(z if on_shard and loop else c for c, z, loop in zip(lv.comp, lv.zshard, s.reading.loop_use)) * s.bg
    return {"temporaries": step_temporaries(pass_peak=s.reading.peak, grads=grads, reduced=reduced,
                                            update=shard_update, throughout=accumulate),
            "activations": s.reading.residuals}


def _pipeline_memory(s: StepFacts, grad_bytes: float) -> dict[str, float]:
    """Activations and temporaries of a step whose loss runs ``sk.pipeline`` (``grad_bytes``: its
    gradients')."""
    step, state, batch, pipe, lv = s.step, s.state, s.batch, s.pipe, s.lv
    sizes, zero, m, L, wire, bg, bp, bc = s.sizes, s.zero, s.m, lv.layers, s.wire, s.bg, s.bp, s.bc
    comp, piped, stored = lv.comp, lv.piped, lv.stored
    g_comp = sum(comp) * bg
    grad_buffer = grad_bytes * (2 if m > 1 else 1)  # + the f32 microbatch accumulator
    act, piped_act = residual_bytes(step, state, batch, s.reading.saved, s.data_axes, sizes, lv.tensor_dims,
                                    {tuple(l.shape) for l in lv.leaves} | {tuple(l.shape[1:]) for l in lv.leaves},
                                    pipe, s.sp)
    # Backward of one layer holds, beside the waiting residuals, the cotangents of that
    # layer's intermediates (≈ its residuals) — or, under ZeRO-3/FSDP, the gathered layer
    # and its unreduced gradient, whichever is larger. In a GPipe/circular pipeline the
    # residuals are stacked per tick; a tick's backward holds the cotangents of one tick's.
    gpipe_like = not is_explicit(pipe)
    working = piped_act / pipeline_ticks(pipe) if gpipe_like else act / L
    if lv.fsdp:
        working = max(working, lv.layer_comp * (wire + bg))
    elif zero == 2 and s.n_data > 1:
        working = max(working, lv.layer_comp * bg)
    # A step microbatch's activations as the pipeline carries them (f32 on XLA:CPU).
    act_carried = tokens_in(batch) / s.n_data / m * lv.width * wire
    if not gpipe_like and pipe.stage_residuals is not None:
        rows, k = microbatch_rows(s), chunk_layers(s)
        stage_res, w_saved = (saved_bytes(s, key, rows, k) for key in ("stage_residuals", "w_saved"))
        # The input's cotangent accumulates in f32 (``explicit._acc_dtype``). The backward op's
        # liveness reading and the copies around the switch are XLA:GPU's and XLA:TPU's habits
        # (measured on their compiles, BENCHMARKS.md issue 25); XLA:CPU keeps issue 24's form,
        # which its compiles hold within 10% (the reading put the 1F1B test transformer at 1.30x).
        op_peak = backward_op_peak(s, rows) if s.platform != "cpu" else None
        backward = one_f_one_b_loop(pipe, act_carried, sum(c for c, q in zip(comp, piped) if q) * 4,
                                    sum(c for c, q in zip(comp, piped) if not q) * 4, stage_res, k,
                                    w_saved=w_saved,  # ZB's pending W's (pipeline.split)
                                    w_forwarded=w_forwarded_bytes(s, rows, k),
                                    **kept_rings(s, rows, k, stage_res),
                                    loss_out=loss_out_bytes(s) / pipe.microbatches,
                                    op_peak=op_peak, acc_ratio=4 / wire, whole_recompute=whole_recompute(s),
                                    chunk_weights=chunk_weights(s))
    elif gpipe_like and s.platform != "cpu" and pipe.stage_residuals is not None:
        # The f32 gradients are made after the pipeline's backward (its scan accumulates them in
        # the compute dtype); a step microbatch accumulator lives throughout.
        backward = (grad_bytes if m > 1 else 0.0) + gpipe_backward(s, act_carried, g_comp)
    else:
        working += pipeline_buffers(pipe, act_carried, g_comp)
        # A pipeline's backward starts after the loss's (whose residuals are freed by then).
        backward = grad_buffer + (max(act, piped_act + working) if gpipe_like else act + working)
    new_params = sum(stored) * bp
    # The compute-dtype copy of the parameters (absent when compute == params dtype).
    cast = sum(stored) * bc if bc != bp else 0.0
    return {"activations": act,
            "temporaries": step_temporaries(pass_peak=backward, grads=grad_buffer, update=new_params,
                                            throughout=cast)}


def _collectives(s: StepFacts) -> tuple[dict, dict]:
    """Bytes and counts per role (``sk.Report.roles()``'s names), per device per step."""
    step, lv, reading, pipe, sizes = s.step, s.lv, s.reading, s.pipe, s.sizes
    plan, zero, m, n_data, ctx, sp = step.plan, s.zero, s.m, s.n_data, s.ctx, s.sp
    comp, stored, full, zshard = lv.comp, lv.stored, lv.full, lv.zshard
    tokens = tokens_in(s.batch)
    tok_dev_mb = tokens / n_data / m / ctx
    parts = []  # the roles' traffic, added up once at the end
    # Tables the program indexes (a gather), and those of them it also multiplies with (tied:
    # an embedding that is the output head too), read off the traced program.
    lookup = [u and not st for u, st in zip(reading.lookup, lv.stacked)]
    tied = [u and mm for u, mm in zip(lookup, reading.matmul)]
    if n_data * ctx > 1:
        reduce_axes = s.data_axes + (("context",) if ctx > 1 and "context" not in s.data_axes else ())
        # A tied embedding's two gradients (output head, lookup's scatter-add) are reduced
        # apart; under sequence parallelism the lookup ran on the whole (gathered) table.
        reduced = grad_reduce_elems(lv.leaves, comp, step.layout.zero_specs if grads_on_shard(zero, m, bool(pipe))
                                    else [l.spec for l in lv.leaves], reduce_axes, sizes) + sum(
            (math.prod(l.shape) if sp else c) for l, c, t in zip(lv.leaves, comp, tied) if t)
        # ZeRO-3/FSDP gathers a weight where it is used: inside a loop (a layer scan) for the
        # forward and again for the backward, every microbatch; outside any loop once (XLA
        # keeps the gathered copy for the backward) — but a convolution kernel once per
        # convolution that reads it (the backward's input-gradient one reads it reversed: a
        # second operand). A tied table counts once: XLA gathered the scanned GPT family's twice
        # (lookup, transposed head) but the recipe's once. Pipelines gather per use, twice.
        uses = [2 if (loop or pipe) else max(1, c) for loop, c in zip(reading.loop_use, reading.conv)]
        reduce_ops = m * lv.layers
        gather_ops = m * sum(u for u, st, c in zip(uses, stored, comp) if st < c) if not pipe else 2 * m * lv.layers
        zero12_ops = 1
        if s.platform == "gpu" and not pipe:  # XLA:GPU combines them
            reduce_ops, gather_ops, zero12_ops = gpu_combining.data_ops(
                lv, step.layout.zero_specs, uses, reading, zero=zero, microbatches=m, grad_bytes=s.bg, wire=s.wire)
        # A pipeline over data axes reduces the weights' gradients by its own formula
        # (``pipeline_traffic``, below); the row syncs stay beside them.
        pipe_reduces = bool(pipe) and n_data > 1
        parts.append(data_traffic(
            reduced=0.0 if pipe_reduces else m * reduced, reduce_ops=0 if pipe_reduces else reduce_ops,
            gathered=m * sum(u * c for u, st, c in zip(uses, stored, comp) if st < c) if lv.fsdp else 0.0,
            gather_ops=gather_ops,
            zero12_gathered=sum(f for f, z in zip(full, zshard) if z < f) if zero in (1, 2) else 0.0,
            # Reduced into the shard, a tied table's head gradient is gathered back whole to take
            # the lookup's scatter-add (XLA:GPU and XLA:TPU alike; ``gpu_combining``'s extra op):
            # GPT-2, BERT, Griffin and the scanned GPT at ZeRO-1/2 on data=8 and data=4,fsdp=2,
            # param-gather 0.85-0.95 before. Beside a tensor axis XLA splits that gradient over the
            # tensor devices first and gathers back less (half the table on data=2,fsdp=2,tensor=2,
            # none on data=2,tensor=4): not counted there.
            regathered=sum(c for c, t, f, z in zip(comp, tied, full, zshard) if t and z < f)
            if zero in (1, 2) and grads_on_shard(zero, m, bool(pipe)) and not any(
                n > 1 for a, n in sizes.items() if a not in s.data_axes) else 0.0,
            zero12_ops=zero12_ops, bg=s.bg, wire=s.wire, bp=s.bp))
        # Reductions over the rows the rest of the pass reads back (a MoE load-balancing loss's
        # expert counts, BatchNorm's batch statistics): all-reduces of their own, before the
        # gradients exist, one op per link of their longest chain (``row_syncs``); grad-reduce in
        # the compile.
        syncs, sync_bytes = reading.row_syncs
        parts.append(RoleTraffic({"grad-reduce": m * sync_bytes}, {"grad-reduce": m * syncs}))
    # Tensor-parallel traffic (``roles.tensor_traffic``): without a pipeline or sequence
    # parallelism the traced program's tensor-split contractions give the reductions; with them,
    # Megatron's per-use count (``leaf_sizes.tensor_uses``).
    fwd, bwd, regions, recomputed, tables, n_tables = (tensor_uses(plan, lv, lookup, tied, pipe, sp)
                                                       if (pipe or sp) else (0.0,) * 6)
    tensor = tensor_traffic(forward=fwd, backward=bwd, regions=regions, regathered=recomputed,
                            head_gather=any(lookup), tokens=tok_dev_mb, width=lv.width, wire=s.wire, microbatches=m, sequence_parallel=sp,
                            tables=(tables, n_tables), param_bytes=s.bp, grad_bytes=s.bg,
                            measured=None if (pipe or sp) else (reading.tensor_reduce, reading.tensor_reduce_ops))
    parts.append(tensor)
    if s.platform == "gpu" and not pipe and not sp and tensor.ops.get("tensor-reduce"):
        # The step's gradient-norm metric sums tensor-split gradients over the tensor axes: one
        # scalar all-reduce a step (its bytes are nothing; its latency is not).
        parts.append(RoleTraffic(ops={"tensor-reduce": 1}))
    # Collectives the program writes itself (sk.context_attention's ring, sk.moe's all-to-alls,
    # a user's shard_map): read off the traced program, per microbatch.
    explicit = _explicit_roles(reading.explicit).items()
    parts.append(RoleTraffic({role: m * nbytes for role, (n, nbytes) in explicit},
                             {role: m * n for role, (n, nbytes) in explicit}))
    if pipe:
        # Activations cross the stages in the compute dtype, in f32 on XLA:CPU (the
        # transformer recipe carries f32 there: XLA:CPU aborts on a bf16 pipeline input's grad).
        act_mb = tokens / n_data / m * lv.width * s.wire / pipe.microbatches
        piped = lv.piped
        parts.append(pipeline_traffic(pipe, stage=sum(c for c, q in zip(comp, piped) if q),
                                      rest=sum(c for c, q in zip(comp, piped) if not q),
                                      tied=sum(c for c, t, q in zip(comp, tied, piped) if t and not q),
                                      act_mb=act_mb, has_dx=any(lookup), wire=s.wire, bg=s.bg, n_data=n_data,
                                      step_m=m))
    total = sum(parts, RoleTraffic.zero())
    return dict(total.bytes), dict(total.ops)


def _flops(s: StepFacts, flops_per_token) -> tuple[float, float, float]:
    """(flops the program executes, flops that do useful work, model flops per token) of one
    device's step."""
    lv, pipe, reading = s.lv, s.pipe, s.reading
    comp, leaves, piped = lv.comp, lv.leaves, lv.piped
    tokens = tokens_in(s.batch)
    matmul = sum(c for c, l in zip(comp, leaves) if len(l.shape) >= 2)
    total = sum(math.prod(l.shape) for l in leaves)
    fpt = flops_per_token or 6.0 * total
    flops = busy = fpt * (matmul / total if total else 1.0) * tokens / s.n_data / s.ctx  # ctx: the sequence split
    if not pipe and flops_per_token is None:
        # The traced program's matmuls, not 6Ψ (a lookup table does no matmul).
        flops = busy = reading.flops * s.m
        fpt = reading.total_flops * s.m / max(tokens, 1)
    staged = sum(c for c, l, q in zip(comp, leaves, piped) if q and len(l.shape) >= 2)  # stage matmuls
    if pipe and not is_explicit(pipe) and matmul:
        # GPipe/circular idle ticks compute too: the stage's matmuls, ticks/(v·m) times.
        flops = idle_tick_flops(pipe, busy, staged, matmul)
    elif pipe and matmul:
        # An explicit schedule's backward recomputes the chunk's forward from its saved input
        # (1F1B, interleaved: 4/3 of the flops; ZB-H1's B and W each: 2x); the loss params
        # (head) run on the last stage only, and the compiled figure averages the switch's
        # branches over the stages.
        rf = recompute_factor(pipe)
        flops = busy * rf * (staged + (matmul - staged) / pipe.stages) / matmul
        busy *= rf
    return flops, busy, fpt


def _explicit_roles(explicit: dict) -> dict[str, tuple[float, float]]:
    """``ProgramReading.explicit`` grouped into ``sk.Report.roles()``'s names, for the roles the
    formulas do not model (a context axis's ring or gather, an expert axis's all-to-alls)."""
    out: dict[str, tuple[float, float]] = {}
    for (kind, axes), (n, nbytes) in explicit.items():
        if "expert" in axes and kind == "all-to-all":
            role = "expert-all-to-all"
        elif "context" in axes and kind in ("collective-permute", "all-gather"):
            role = "context-permute" if kind == "collective-permute" else "context-gather"
        else:
            continue
        n0, b0 = out.get(role, (0.0, 0.0))
        out[role] = (n0 + n, b0 + nbytes)
    return out


def _memory_seconds(s: StepFacts, mem: dict, hw: hw_lib.Hardware) -> float:
    """What device memory adds to the step's matmul time (``steptime.roofline_excess``): the
    traced pass's kernels, once per microbatch, and the optimizer's update — a pass outside
    the traced loss that reads the parameters, their gradients and the optimizer state and
    writes the parameters and the state back. 0 for a pipelined step (its kernels run per
    tick and stage, which the reader's one pass does not time) or hardware without an HBM
    bandwidth."""
    if s.pipe or hw.hbm_bandwidth <= 0:
        return 0.0
    # ZeRO-1/2 update the parameters' shard (then gather it), ZeRO-3 keeps only the shard.
    params = sum(s.lv.zshard) * s.bp if s.zero in (1, 2) and s.n_data > 1 else mem["params"]
    update = 2 * (params + mem["opt_state"]) + mem["grads"]
    return roofline_excess(s.reading.kernels, hw) * s.m + update / hw.hbm_bandwidth


def _hardware(hardware, mesh) -> hw_lib.Hardware:
    if isinstance(hardware, hw_lib.Hardware):
        return hardware
    if hardware is not None:
        return hw_lib.lookup(hardware)
    try:
        return hw_lib.lookup(mesh.abstract_mesh.abstract_device)
    except ValueError:
        return hw_lib.lookup("h100")
