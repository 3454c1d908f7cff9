"""What ``sk.pipeline`` holds at its peak on XLA:GPU and XLA:TPU, read off the jaxprs its trace
note keeps for a target's estimate (``plan.detailed_notes``): one backward op's liveness (the
chunk's recomputed forward and its VJP), GPipe's per-tick residuals, and what the loss leaves
for the loss params' gradient matmuls. ``from_step`` feeds these to ``pipeline``'s formulas;
each function takes the step's ``step_facts.StepFacts`` (its leaves, sizes, note and traced
program).
"""

from __future__ import annotations

import math

import jax

from .pipeline_cost import pipeline_buffers, pipeline_ticks
from ..program.reader import jaxpr_peak
from ..terms import tokens_in
from .leaf_sizes import itemsize, n_tensor_of


def gpipe_backward(s, act_carried: float, g_comp: float) -> float:
    """GPipe/circular's backward on XLA:GPU/XLA:TPU at its peak, a tick of the transposed scan,
    per device: what the forward scan saved every tick (the chunk's residuals and its input),
    the tick's backward (``backward_op_peak``) with the chunk's compute-dtype weights the
    layer scan's loop carries, the pipeline's input, the outputs' cotangent and its
    ``pipeline_buffers``; and what the loss's backward leaves alive for the loss params'
    gradient matmuls, which XLA's scheduler runs after the pipeline's backward (they are off
    its critical path): the cotangent of each loss-param matmul's output (the logits'), in f32
    — the loss's dtype (measured: the recipe's 62.5 MiB f32 logits gradient alive through
    GPipe's backward on H100)."""
    pipe = s.pipe
    rows, k = microbatch_rows(s), chunk_layers(s)
    act_mb = act_carried / pipe.microbatches
    stage_res = saved_bytes(s, "stage_residuals", rows, k)
    op = backward_op_peak(s, rows) or 0.0
    return (pipeline_ticks(pipe) * (stage_res + act_mb) + op + chunk_weights(s)
            + pipeline_buffers(pipe, act_carried, g_comp) + loss_out_bytes(s))


def loss_out_bytes(s) -> float:
    """Per-device bytes, in f32 (the loss's dtype), of the outputs of the loss params' matmuls
    (an output head's logits) over a step microbatch's tokens: the cotangent the loss params'
    weight-gradient matmul reads, which XLA's scheduler runs after the pipeline's backward
    (GPipe) or the chunk's (an explicit schedule's op on the loss chunk, one pipeline
    microbatch's share)."""
    lv = s.lv
    tokens = tokens_in(s.batch) / s.n_data / s.m
    return sum(tokens * math.prod(l.shape) / lv.width / (math.prod(l.shape) / c) * 4
               for l, c, q, mm in zip(lv.leaves, lv.comp, lv.piped, s.reading.matmul)
               if mm and not q and len(l.shape) == 2 and lv.width in l.shape)


def microbatch_rows(s) -> int:
    """Rows of one pipeline microbatch on one device (of a step microbatch, over the data axes
    the pipeline made manual)."""
    lead = jax.tree.leaves(s.batch)[0].shape[0] // s.m
    return lead // s.pipe.microbatches // math.prod(s.sizes[a] for a in (s.pipe.data_axes or ()))


def chunk_layers(s) -> int:
    """Layers of one chunk: a stage's layers over its ``repeats``."""
    return max(s.lv.layers // (s.pipe.stages * s.pipe.repeats), 1)


def saved_bytes(s, key: str, rows: int, k: int) -> float:
    """Per-device bytes of the values the trace note lists under ``key`` (``stage_residuals``:
    what a chunk's forward saves for its backward; ``w_saved``: ZB's pending W's)."""
    return sum(math.prod(sh) * itemsize(d) / n_tensor_stacked(sh, rows, k, s.lv.tensor_dims, s.sizes)
               for sh, d in (getattr(s.pipe, key) or ()))


def kept_rings(s, rows: int, k: int, stage_res: float) -> dict:
    """``one_f_one_b_loop``'s ``kept`` and ``loss_kept``: per-device bytes of one slot of the
    kept-residual rings (``sk.pipeline(keep=...)``), as the trace note lists them; a note
    without them (an override) takes the chunk's saved residuals and no loss slot. Nothing
    kept (``keep="input"``): zero."""
    if s.pipe.keep == "input":
        return {"kept": 0.0, "loss_kept": 0.0}
    if s.pipe.kept is None:
        return {"kept": stage_res, "loss_kept": 0.0}
    return {"kept": saved_bytes(s, "kept", rows, k), "loss_kept": saved_bytes(s, "loss_kept", rows, k)}


def w_forwarded_bytes(s, rows: int, k: int) -> float:
    """Per-device bytes of a pending W's values that are residuals of the layers' forward
    (the note's ``w_forwarded``, ``pipeline.split``): where B runs that forward itself
    (``keep="input"``) its new W slot holds those buffers, which its backward op's peak
    already counts as the forward's saved values."""
    flags = s.pipe.w_forwarded or ()
    return sum(math.prod(sh) * itemsize(d) / n_tensor_stacked(sh, rows, k, s.lv.tensor_dims, s.sizes)
               for (sh, d), f in zip(s.pipe.w_saved or (), flags) if f)


def chunk_weights(s) -> float:
    """Bytes of one chunk's weights in the compute dtype (what a layer scan's loop carries)."""
    return sum(c for c, q in zip(s.lv.comp, s.lv.piped) if q) * s.bc / s.pipe.repeats


def n_tensor_stacked(shape, rows: int, k: int, tensor_dims, sizes) -> int:
    """``n_tensor_of`` for a value of a pipeline chunk: one stacked over the chunk's ``k``
    layers (a layer scan's residuals, ``(k, rows, ...)``) is read past its stacking dim (with
    ``k`` equal to the rows, the layer dim would pass for the rows and the rows for a feature)."""
    shape = tuple(shape)
    if len(shape) > 2 and shape[0] == k and shape[1] == rows:
        shape = shape[1:]
    return n_tensor_of(shape, rows, tensor_dims, sizes)


def whole_recompute(s) -> bool:
    """Whether the backward op checkpoints its chunk's layer scan whole (a keep policy, or
    ``keep="input"`` on layers without their own checkpoint): its recompute then materialises
    every layer's values, stacked, before the first layer's backward; layers that checkpoint
    themselves recompute one at a time inside the scan."""
    from jax._src.ad_checkpoint import remat_p

    closed = s.pipe.chunk_backward
    return closed is not None and any(e.primitive is remat_p for e in closed.jaxpr.eqns)


def backward_op_peak(s, rows: int) -> float | None:
    """The liveness peak of one explicit backward op (the pipeline note's ``chunk_backward``:
    the chunk's forward recomputed and its VJP for one microbatch), read with the liveness
    model of the un-pipelined estimate (``program.jaxpr_peak``): the layers' saved inputs, one
    layer's recomputed intermediates with their cotangents, the chunk's weight gradients.
    None when the note has no such jaxpr or its weights are not the stage's leaves in order."""
    closed, lv, sizes, pipe = s.pipe.chunk_backward, s.lv, s.sizes, s.pipe
    if closed is None:
        return None
    stage = [i for i, q in enumerate(lv.piped) if q]
    n = len(closed.jaxpr.invars) - 2  # the chunk's weights, then its input and output cotangent
    avals = [v.aval for v in closed.jaxpr.invars[:n]]
    v = pipe.repeats
    k = lv.leaves[stage[0]].shape[0] // (pipe.stages * v) if stage else 0
    if n != len(stage) or any(tuple(a.shape) != (v, k) + tuple(lv.leaves[i].shape[1:]) for a, i in zip(avals, stage)):
        return None
    # The chunk's weights: the stage leaves' compute layout over the axes the pipeline leaves
    # to the compiler (the pipe split is already in the note's shapes).
    t_split = [math.prod(lv.leaves[i].shape) / pipe.stages / lv.comp[i] for i in stage]

    def split_of(aval, leaf, manual=frozenset()):
        if leaf is not None:
            return 1, t_split[leaf]  # any view of it (a layer of the stack) is split like it
        # A stack over the chunk's layers (the checkpoint's recompute, ``(k, rows, ...)``) is
        # split as one layer's value: with k == rows, read whole, its rows pass for a feature
        # (issue 37: the recipe's 4-layer chunks of 4 rows and 4 KV heads, 1F1B keep="dots"
        # 0.87x the H100 temporaries).
        return 1, n_tensor_stacked(aval.shape, rows, k, lv.tensor_dims, sizes)

    # The chunk's inputs saved by its layer scan, ``(k,) + h``: the residual stream, whole over
    # the tensor axes (by shape alone a stack of k == rows layers passes for a split feature).
    h = tuple(closed.jaxpr.invars[n].aval.shape)
    return jaxpr_peak(closed, n_params=n, split_of=split_of, canonical_dots=s.platform == "cpu",
                      whole=lambda var: tuple(getattr(var.aval, "shape", ())) == (k,) + h)
