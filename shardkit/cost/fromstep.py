"""The cost model fed by a real ``sk.train_step``: each leaf's resolved spec, not global shapes.

Everything here is bookkeeping on specs and abstract shapes (plus one abstract trace of the
loss for its saved residuals); nothing is compiled. ``sk.cost.estimate_for_step`` is the
public entry point; ``step.explain()`` compares it with the compiled program.
"""

from __future__ import annotations

import collections
import math

import jax
import numpy as np

from ..plan import shard_shape
from ..rules import entry_axes
from . import hardware as hw_lib
from .shapes import ROLES, Estimate, Layout, tokens_in
from .steptime import times
from .program import ProgramReading, read_program
from .roles import data_traffic, step_temporaries, tensor_traffic, zero_state
from .caveats import step_caveats
from .pipeline import (is_explicit, one_f_one_b_loop, pipeline_buffers, pipeline_note, pipeline_ticks,
                       pipeline_traffic, pipelined_uses, recompute_factor)


def _microbatch(step, state, batch):
    """Abstract ``(one microbatch, parameters in the gradient dtype)``, as the step's loss
    sees them."""
    m, prec = step.microbatches, step.plan.precision
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // m,) + tuple(x.shape[1:]),
                                                     np.float32 if np.dtype(x.dtype) == np.float64 else x.dtype)
                      if getattr(x, "ndim", 0) else x, batch)
    return mb, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, prec.grads), state.params)


def _itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def _size(shape, spec, mesh) -> int:
    return math.prod(shard_shape(shape, spec, mesh))


def _stack_dim(leaves) -> int:
    """The layer count of scanned (stacked) weights: the most common leading dim of rank ≥ 3
    leaves; 1 when there is none."""
    lead = collections.Counter(l.shape[0] for l in leaves if len(l.shape) >= 3)
    return lead.most_common(1)[0][0] if lead else 1


def _residual_bytes(step, state, batch, data_axes, sizes, tensor_dims: set[int],
                    param_shapes: set[tuple], pipe: dict | None = None,
                    sp: bool = False) -> tuple[float, float]:
    """Per-device bytes of the residuals the backward pass keeps for one microbatch.

    Traced with ``jax.ad_checkpoint`` (respects remat policies). A residual's dimension that
    equals the microbatch size is taken as sharded over the batch axes, and the residual as
    sharded over ``tensor`` when a dimension after that one equals a tensor-sharded weight
    dimension (a heuristic: activations follow the batch and the Megatron-split features;
    under sequence parallelism every activation is split over ``tensor``). Inside
    ``sk.pipeline`` (``pipe``: its trace note) the residuals leave the shard_map stacked over
    the pipe axis (and the manual data axes) along their first dimension (global shape,
    ``stages × data ×`` one device's), and their batch dimension is the pipeline microbatch (a
    device's rows of it when data is manual): both are divided out.

    Returns (all residuals, those saved inside the pipeline)."""
    # jax's own residual report (private in jax 0.10: if it moves, this fails loudly).
    from jax._src.ad_checkpoint import saved_residuals

    mb, params = _microbatch(step, state, batch)
    with step.plan.active():
        res = saved_residuals(step.microbatch_loss(state), params, mb)
    b_mb = jax.tree.leaves(mb)[0].shape[0] if jax.tree.leaves(mb) else 0
    n_data = math.prod(sizes[a] for a in data_axes)
    n_tensor = sizes.get("tensor", 1)
    total = piped = 0.0
    for aval, where in res:
        if "from the argument" in where or tuple(aval.shape) in param_shapes:
            continue  # parameters and their compute-dtype copies are counted on their own
        nbytes = math.prod(aval.shape) * _itemsize(aval.dtype)
        shape = list(aval.shape)
        in_pipe = pipe is not None and "shard_map" in where
        # Manual data axes stack GPipe/circular's residuals over them too, with a device's rows
        # inside (an explicit schedule's residuals are its gradients, stacked over pipe only).
        manual = (math.prod(sizes[a] for a in pipe.get("data_axes", ()))
                  if in_pipe and not is_explicit(pipe) else 1)
        if in_pipe and shape and shape[0] % (pipe["stages"] * manual) == 0:
            nbytes /= pipe["stages"] * manual
            shape = shape[1:]
            rows = b_mb // pipe["microbatches"]
            if manual == 1 and rows in shape and n_data > 1:
                nbytes /= n_data
            share = nbytes / n_tensor_of(shape, rows if manual == 1 else rows // manual, tensor_dims, sizes)
            total += share
            piped += share
            continue
        if b_mb and b_mb in shape and n_data > 1:
            nbytes /= n_data
        if sp and b_mb in shape:  # sequence parallel: a region's activations are split over the
            total += nbytes / n_tensor  # sequence, the others over the features (Korthikanti et al.)
            continue
        total += nbytes / n_tensor_of(shape, b_mb, tensor_dims, sizes)
    return total, piped


def step_estimate(step, state, batch, *, pipeline=None, hardware=None, flops_per_token=None) -> Estimate:
    plan, lay = step.plan, step.layout
    mesh, sizes, prec, zero, m = plan.mesh, dict(plan.mesh.shape), plan.precision, plan.zero, step.microbatches
    bp, bc, bg = _itemsize(prec.params), _itemsize(prec.compute), _itemsize(prec.grads)
    # XLA:CPU runs 16-bit dots in f32, so the collectives beside them (TP all-reduces, ZeRO-3
    # gathers) move f32 there; on GPU/TPU they move the compute dtype.
    platform = _platform(mesh)
    wire = 4 if platform == "cpu" else bc
    data_axes = tuple(a for a in plan.batch_axes if sizes[a] > 1)
    n_data = math.prod(sizes[a] for a in data_axes)
    leaves = lay.leaves
    full = [_size(l.shape, l.spec, mesh) for l in leaves]
    zshard = [_size(l.shape, z, mesh) for l, z in zip(leaves, lay.zero_specs)]
    # What a device computes with: the leaf with its batch-axis (FSDP) sharding gathered.
    # sk.moe's expert weights stay split over ``expert`` where they are used (each device runs
    # its own experts) although the batch is split over that axis too: no FSDP gather there.
    comp = [_size(l.shape, _strip(l.spec, tuple(a for a in plan.batch_axes if a != "expert")), mesh)
            for l in leaves]
    stored = zshard if zero == 3 else full
    L = _stack_dim(leaves)
    stacked = [len(l.shape) >= 3 and l.shape[0] == L and L > 1 for l in leaves]
    layer_comp = sum(c / L if s else c for c, s in zip(comp, stacked))
    # The model width: the most common weight dimension (d_model in a residual network).
    dims = collections.Counter(d for l, s in zip(leaves, stacked) for d in l.shape[int(s):])
    width = dims.most_common(1)[0][0] if dims else 0

    state_elems = zero_state(zero, model=sum(full), shard=sum(zshard))
    mem = {"params": float(state_elems["params"] * bp)}
    opt_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.opt_state)
    opt_specs = plan.opt_state_specs(opt_abstract, state.params, lay)
    mem["opt_state"] = float(sum(_size(x.shape, s, mesh) * _itemsize(x.dtype) for x, s in
                                 zip(jax.tree.leaves(opt_abstract), jax.tree.leaves(
                                     opt_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))))
    mem["model_state"] = float(sum(x.size * _itemsize(x.dtype) for x in jax.tree.leaves(state.model_state)))
    n_batch = math.prod(sizes[a] for a in plan.batch_axes)
    mem["batch"] = float(sum(math.prod(x.shape) * min(_itemsize(x.dtype), 4) / (n_batch if x.ndim else 1)
                             for x in jax.tree.leaves(batch)))
    scalars = 20 + (8 if state.loss_scale is not None else 0)
    mem["arguments"] = mem["params"] + mem["opt_state"] + mem["model_state"] + mem["batch"] + scalars
    g_comp = sum(comp) * bg
    mem["grads"] = float(state_elems["grads"] * bg)
    grad_buffer = mem["grads"] * (2 if m > 1 else 1)  # + the f32 microbatch accumulator
    tensor_dims = {l.shape[d] for l in leaves for d, e in enumerate(l.spec)
                   if any(a not in plan.batch_axes for a in entry_axes(e))}
    pipe = pipeline_note(step, state, batch, pipeline, sizes)
    # Which leaves are pipeline stage weights (their leading dim split over the pipe axis).
    piped = [bool(pipe and l.spec and pipe.get("axis", "pipe") in entry_axes(l.spec[0])) for l in leaves]
    seq_rule = plan.axis_rules.mapping.get("seq", ()) if plan.axis_rules is not None else ()
    # Sequence parallelism splits the sequence over a tensor-like axis; a ``context`` axis
    # (sk.context_attention) splits it too, but the weights stay whole there: it reduces the
    # gradients like a data axis and shrinks every activation by its size.
    sp = any(a not in plan.batch_axes and a not in ("pipe", "context") and sizes.get(a, 1) > 1 for a in seq_rule)
    ctx = sizes.get("context", 1)
    reduce_axes = data_axes + (("context",) if ctx > 1 and "context" not in data_axes else ())
    fsdp = any(s < c for s, c in zip(stored, comp))  # some weights are gathered where used
    # What a device computes with, reads and keeps: read off the traced program (also for
    # pipelines, whose parameter uses it tells; their memory has its own model below).
    reading = _read(step, state, batch, comp, sizes, data_axes, tensor_dims, sp)
    if not pipe:
        # The pass's own peak (its gradients live at its end), or, after it, the reduced
        # gradients beside the unreduced ones, a ZeRO-1/2 update's new parameter shard before
        # the gather, and the microbatch accumulator. The reduced gradient is a new buffer (a
        # collective does not write in place): a full copy without ZeRO-2; with it the shard —
        # except on XLA:CPU for a gradient made outside a loop, which it all-reduces whole and
        # slices after (a loop's stacked gradient is reduced slice by slice inside the loop).
        whole = [(f if zero < 2 or (platform == "cpu" and not loop) else z)
                 for f, z, loop in zip(full, zshard, reading.loop_use)]
        reduced = sum(whole) * bg if n_data > 1 else 0.0
        shard_update = sum(zshard) * bp if zero in (1, 2) and n_data > 1 else 0.0
        accumulate = mem["grads"] if m > 1 else 0.0
        mem["temporaries"] = step_temporaries(pass_peak=reading.peak, grads=g_comp, reduced=reduced,
                                              update=shard_update, throughout=accumulate)
        mem["activations"] = reading.residuals
    else:
        act, piped_act = _residual_bytes(step, state, batch, data_axes, sizes, tensor_dims,
                              {tuple(l.shape) for l in leaves} | {tuple(l.shape[1:]) for l in leaves}, pipe, sp)
        mem["activations"] = act
        # Backward of one layer holds, beside the waiting residuals, the cotangents of that
        # layer's intermediates (≈ its residuals) — or, under ZeRO-3/FSDP, the gathered layer
        # and its unreduced gradient, whichever is larger. In a GPipe/circular pipeline the
        # residuals are stacked per tick; a tick's backward holds the cotangents of one tick's.
        gpipe_like = not is_explicit(pipe)
        working = piped_act / pipeline_ticks(pipe) if gpipe_like else act / L
        if fsdp:
            working = max(working, layer_comp * (wire + bg))
        elif zero == 2 and n_data > 1:
            working = max(working, layer_comp * bg)
        # A step microbatch's activations as the pipeline carries them (f32 on XLA:CPU).
        act_carried = tokens_in(batch) / n_data / m * width * wire
        if not gpipe_like and pipe.get("stage_residuals") is not None:
            lead = jax.tree.leaves(batch)[0].shape[0] // m  # rows of a step microbatch
            rows = lead // pipe["microbatches"] // math.prod(sizes[a] for a in pipe.get("data_axes", ()))
            stage_res, w_saved = (sum(math.prod(s) * _itemsize(d) / n_tensor_of(s, rows, tensor_dims, sizes)
                                      for s, d in pipe.get(key, ())) for key in ("stage_residuals", "w_saved"))
            backward = one_f_one_b_loop(pipe, act_carried, sum(c for c, q in zip(comp, piped) if q) * 4,
                                        sum(c for c, q in zip(comp, piped) if not q) * 4, stage_res,
                                        max(L // (pipe["stages"] * pipe.get("repeats", 1)), 1),
                                        w_saved=w_saved)  # [issue 25] ZB's pending W's
        else:
            working += pipeline_buffers(pipe, act_carried, g_comp)
            # A pipeline's backward starts after the loss's (whose residuals are freed by then).
            backward = grad_buffer + (max(act, piped_act + working) if gpipe_like else act + working)
        new_params = sum(stored) * bp
        # The compute-dtype copy of the parameters (absent when compute == params dtype).
        cast = sum(stored) * bc if bc != bp else 0.0
        mem["temporaries"] = step_temporaries(pass_peak=backward, grads=grad_buffer, update=new_params,
                                              throughout=cast)
    mem["peak"] = mem["arguments"] + mem["temporaries"] + (0 if step.donate else mem["arguments"])

    tokens = tokens_in(batch)
    tok_dev_mb = tokens / n_data / m / ctx
    col = dict.fromkeys(ROLES, 0.0)
    counts = dict.fromkeys(ROLES, 0.0)
    # Tables the program indexes (a gather), and those of them it also multiplies with (tied:
    # an embedding that is the output head too), read off the traced program.
    lookup = [u and not s for u, s in zip(reading.lookup, stacked)]
    tied = [u and mm for u, mm in zip(lookup, reading.matmul)]
    if n_data * ctx > 1:
        # A tied embedding's two gradients (output head, lookup's scatter-add) are reduced
        # apart; under sequence parallelism the lookup ran on the whole (gathered) table.
        reduced = _grad_reduce_elems(leaves, comp, lay.zero_specs if zero >= 2 else [l.spec for l in leaves],
                                     reduce_axes, sizes) + sum((math.prod(l.shape) if sp else c)
                                                             for l, c, t in zip(leaves, comp, tied) if t)
        # ZeRO-3/FSDP gathers a weight where it is used: inside a loop (a layer scan) for the
        # forward and again for the backward, every microbatch; outside any loop once (XLA
        # keeps the gathered copy for the backward) — but a convolution kernel once per
        # convolution that reads it (the backward's input-gradient one reads it reversed: a
        # second operand). A tied table counts once: XLA gathered the scanned GPT family's twice
        # (lookup, transposed head) but the recipe's once. Pipelines gather per use, twice.
        uses = [2 if (loop or pipe) else max(1, c) for loop, c in zip(reading.loop_use, reading.conv)]
        data_traffic(col, counts, reduced=m * reduced, reduce_ops=m * L,
                     gathered=m * sum(u * c for u, s, c in zip(uses, stored, comp) if s < c) if fsdp else 0.0,
                     gather_ops=m * sum(u for u, s, c in zip(uses, stored, comp) if s < c) if not pipe else 2 * m * L,
                     zero12_gathered=sum(f for f, z in zip(full, zshard) if z < f) if zero in (1, 2) else 0.0,
                     bg=bg, wire=wire, bp=bp)
    # Tensor-parallel traffic (``roles.tensor_traffic``): without a pipeline or sequence
    # parallelism the traced program's tensor-split contractions give the reductions; with them,
    # Megatron's per-use count, one use per tensor-sharded weight (XLA does not merge the q/k/v or
    # gate/up input-gradient reductions): a row-parallel one (split on its input dim) in the
    # forward — again in 1F1B's recomputed forward —, a column-parallel one in the backward, a
    # vocab-parallel lookup in the forward and, tied, as the output head in the backward.
    fwd = bwd = regions = tables = n_tables = 0.0
    for l, s, t, tie, staged in zip(leaves, stacked, lookup, tied, piped) if (pipe or sp) else ():
        dims = [d for d, e in enumerate(l.spec)
                if any(a not in plan.batch_axes and a != "pipe" for a in entry_axes(e))]
        if len(l.shape) < 2 or not dims:
            continue
        stack = l.shape[0] if s else 1
        if staged:
            stack = pipelined_uses(pipe, stack)
        vocab_lookup = t and dims[0] == 0
        row = dims[0] == int(s)
        if vocab_lookup and sp:  # tokens split over tensor: the whole table instead
            tables, n_tables = tables + math.prod(l.shape), n_tables + 1
        elif vocab_lookup or row:
            fwd += stack
        else:
            bwd += stack
        if vocab_lookup and tie:
            bwd += stack
        if staged and is_explicit(pipe):
            # Backward ops recompute the chunk's forward once (its row-parallel reductions
            # again): BW, or B of ZB-H1/ZB-V, whose W then only multiplies what B kept
            # (issue 25: W no longer recomputes; was redo = 2 for ZB-H1).
            redo = 1
            if row:
                fwd += redo * stack
            elif redo > 1:
                bwd += (redo - 1) * stack
        if sp and s and l.shape[-1] == width and not vocab_lookup:
            regions += stack  # a region closes with a row-parallel weight into the residual stream
    tensor_traffic(col, counts, forward=fwd, backward=bwd, regions=regions, head_gather=any(lookup),
                   tokens=tok_dev_mb, width=width, wire=wire, microbatches=m, sequence_parallel=sp,
                   tables=(tables, n_tables), param_bytes=bp, grad_bytes=bg,
                   measured=None if (pipe or sp) else (reading.tensor_reduce, reading.tensor_reduce_ops))
    # Collectives the program writes itself (sk.context_attention's ring, sk.moe's all-to-alls,
    # a user's shard_map): read off the traced program, per microbatch.
    for role, (n, nbytes) in _explicit_roles(reading.explicit).items():
        col[role] = col.get(role, 0.0) + m * nbytes
        counts[role] = counts.get(role, 0.0) + m * n
    p = pipe["stages"] if pipe else 1
    if pipe:
        # Activations cross the stages in the compute dtype, in f32 on XLA:CPU (the
        # transformer recipe carries f32 there: XLA:CPU aborts on a bf16 pipeline input's grad).
        act_mb = tokens / n_data / m * width * wire / pipe["microbatches"]
        pipeline_traffic(col, counts, pipe, stage=sum(c for c, q in zip(comp, piped) if q),
                         rest=sum(c for c, q in zip(comp, piped) if not q),
                         tied=sum(c for c, t, q in zip(comp, tied, piped) if t and not q),
                         act_mb=act_mb, has_dx=any(lookup), wire=wire, bg=bg, n_data=n_data, step_m=m)
        m = pipe["microbatches"]
    matmul = sum(c for c, l in zip(comp, leaves) if len(l.shape) >= 2)
    total = sum(math.prod(l.shape) for l in leaves)
    fpt = flops_per_token or 6.0 * total
    flops = busy = fpt * (matmul / total if total else 1.0) * tokens / n_data / ctx  # ctx: the sequence split
    if not pipe and flops_per_token is None:
        # The traced program's matmuls, not 6Ψ (a lookup table does no matmul).
        flops = busy = reading.flops * m
        fpt = reading.total_flops * m / max(tokens, 1)
    staged = sum(c for c, l, q in zip(comp, leaves, piped) if q and len(l.shape) >= 2)  # stage matmuls
    if pipe and not is_explicit(pipe) and matmul:
        # GPipe/circular ticks run every device's layer group, idle ones too (on garbage the
        # schedule then discards), so the program executes ticks/(v·m) × the stage's matmuls.
        # 1F1B's idle/forward/backward switch runs one branch a tick: no extra flops. The step
        # time is timed on the busy flops; the bubble (``times``) stands for the idle ticks.
        extra = pipeline_ticks(pipe) / (pipe.get("repeats", 1) * pipe["microbatches"]) - 1
        flops = busy * (1 + extra * staged / matmul)
    elif pipe and matmul:
        # An explicit schedule's backward recomputes the chunk's forward from its saved input
        # (1F1B, interleaved: 4/3 of the flops; ZB-H1's B and W each: 2x); the loss params
        # (head) run on the last stage only, and the compiled figure averages the switch's
        # branches over the stages.
        rf = recompute_factor(pipe)
        flops = busy * rf * (staged + (matmul - staged) / pipe["stages"]) / matmul
        busy *= rf
    hw = _hardware(hardware, mesh)
    layout = Layout(data=math.prod(sizes[a] for a in ("replica", "data") if a in sizes),
                    fsdp=sizes.get("fsdp", 1), tensor=sizes.get("tensor", 1), pipe=p, zero=zero,
                    microbatches=m, schedule=pipe["schedule"] if pipe else "gpipe",
                    repeats=pipe["repeats"] if pipe else 1)
    t = times(col, counts, busy, hw, layout)
    n_dev = mesh.size
    notes = list(reading.notes)
    if not pipe:
        notes.append("modelled memory: a liveness simulation of the traced forward + backward pass with "
                     "XLA's fusion rules: the bytes alive at once. XLA's temporaries are its packing of its "
                     "buffers into one heap, which large steps leave fragmented (1.3-1.4x the bytes alive at "
                     "once on a 1B transformer at 2048 tokens; not modelled, BENCHMARKS.md)")
    if flops_per_token is None and not pipe:
        notes.append("modelled flops: every matmul and convolution of the traced program, per device")
    tensor_split = [any(a not in plan.batch_axes and sizes.get(a, 1) > 1 for e in l.spec for a in entry_axes(e))
                    for l in leaves]
    caveats = step_caveats(reading, [s < c for s, c in zip(stored, comp)], tensor_split, bool(pipe),
                       bool(step.trace_notes.get("moe")))
    return Estimate(mem, col, flops, fpt * tokens / n_dev, t, hw.name, layout, tokens,
                    hw.hbm_bytes, n_dev, notes, caveats)


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


def _grad_reduce_elems(leaves, comp, grad_specs, data_axes, sizes) -> float:
    """Gradient elements reduced over the data axes, counted as bytes reduced (``sk.Report``).

    A leaf whose gradient ends sharded over some data axes but replicated over others (FSDP
    beside plain DP, ZeRO < 2) is reduced in two steps: a reduce-scatter of the full gradient
    over its sharding axes, then an all-reduce of the shard over the rest (XLA partitions it so)."""
    total = 0.0
    for l, c, gs in zip(leaves, comp, grad_specs):
        # An expert weight's gradient comes from its own device's tokens only (sk.moe sent
        # them there): nothing to reduce over ``expert``.
        axes = [a for a in data_axes if not (a == "expert" and "expert" in {x for e in l.spec for x in entry_axes(e)})]
        if math.prod(sizes[a] for a in axes) <= 1:
            continue
        on = {a for e in gs for a in entry_axes(e)} & set(axes)
        shards = math.prod(sizes[a] for a in on)
        rest = [a for a in axes if a not in on]
        total += c + (c / shards if shards > 1 and rest else 0.0)
    return total


def n_tensor_of(shape, rows: int, tensor_dims: set[int], sizes) -> int:
    """The tensor-axis split of an activation: ``tensor`` when one of its feature dimensions
    (those after its ``rows`` dimension, the first or second: a leading dim stacks layers or
    ticks; without one, all of them) is a tensor-sharded weight dimension (the Megatron-split
    features), else 1. A dimension of the rows' size further in is a feature, not the rows: a
    convolution's weight gradient with as many channels as the batch has rows is split like
    its weight, not reduced."""
    n = sizes.get("tensor", 1)
    if n <= 1:
        return 1
    shape = list(shape)
    at = 0 if shape[:1] == [rows] else 1 if shape[1:2] == [rows] else -1
    return n if any(d in tensor_dims for d in shape[at + 1:]) else 1


def _strip(spec, axes):
    from jax.sharding import PartitionSpec as P

    out = []
    for e in spec:
        keep = tuple(a for a in entry_axes(e) if a not in axes)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def _platform(mesh) -> str:
    """The mesh's platform; an AbstractMesh (``sk.cost.simulate``) names it in ``abstract_device``."""
    device = mesh.abstract_mesh.abstract_device
    if device is None:
        raise ValueError("the plan's AbstractMesh names no platform: give it abstract_device="
                         "jax.sharding.AbstractDevice(...) (sk.cost.simulated.abstract_mesh does)")
    return device.platform


def _hardware(hardware, mesh) -> hw_lib.Hardware:
    if isinstance(hardware, hw_lib.Hardware):
        return hardware
    if hardware is not None:
        return hw_lib.lookup(hardware)
    try:
        return hw_lib.lookup(mesh.abstract_mesh.abstract_device)
    except ValueError:
        return hw_lib.lookup("h100")


def _read(step, state, batch, comp, sizes, data_axes, tensor_dims, sp) -> ProgramReading:
    """``program.read_program`` on one microbatch of this step, with per-device sizes from the
    plan (see ``program``'s docstring for the rules)."""
    mb, params = _microbatch(step, state, batch)
    first = jax.tree.leaves(mb)[0].shape if jax.tree.leaves(mb) else ()
    rows = first[0] if first else 0
    # Under a context axis, a dimension of the sequence's length is split over it (the
    # attention's own blocks are already local inside its shard_map).
    seq, ctx = (first[1] if len(first) > 1 else 0), sizes.get("context", 1)
    n_tensor = sizes.get("tensor", 1)
    full = [math.prod(x.shape) for x in jax.tree.leaves(params)]

    def split_of(aval, leaf, manual=frozenset()):
        if leaf is not None:
            if not manual:  # any view of it (a scan's layer of a stack too) is split like it
                return 1, full[leaf] / comp[leaf]
            # Inside a shard_map: larger than its compute layout, still split over the
            # compiler's axes (a weight inside a shard_map that leaves ``tensor`` to XLA); else
            # already local.
            return 1, max(math.prod(aval.shape) / comp[leaf], 1.0)
        shape = list(aval.shape)
        # The rows, or the rows flattened with the sequence (a token list, as sk.moe routes it)
        # — unless a shard_map made the data axes manual: then its values are local already.
        split = [a for a in data_axes if a not in manual]
        n_split = math.prod(sizes[a] for a in split)
        d = n_split if rows and (rows in shape or (seq and rows * seq in shape)) and n_split > 1 else 1
        if "context" in manual:
            return d, n_tensor_of(shape, rows, tensor_dims, sizes)
        if ctx > 1 and seq and shape.count(seq) > (1 if seq == rows and rows in shape else 0):
            d *= ctx
        if sp and rows in shape:
            return d, n_tensor
        return d, n_tensor_of(shape, rows, tensor_dims, sizes)

    with step.plan.active():
        return read_program(step.microbatch_loss(state), params, mb, split_of=split_of, n_params=len(comp),
                            canonical_dots=_platform(step.plan.mesh) == "cpu")
