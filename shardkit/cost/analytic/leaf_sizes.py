"""Per-leaf accounting for the step estimate (``from_step``): what each parameter leaf of a real
``sk.train_step`` occupies on one device under its resolved spec (stored, ZeRO shard, the
gathered copy a device computes with), the arguments' memory, the residuals the backward keeps,
and the tensor-parallel uses of the weights (Megatron's per-use count).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import numpy as np

from ...plan import shard_shape
from ...rules import entry_axes
from ..pipeline_note import PipelineNote, is_explicit
from .pipeline_cost import pipelined_uses
from .roles import zero_state


def microbatch(step, state, batch):
    """Abstract ``(one microbatch, parameters in the gradient dtype)``, as the step's loss
    sees them."""
    m, prec = step.microbatches, step.plan.precision
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // m,) + tuple(x.shape[1:]),
                                                     np.float32 if np.dtype(x.dtype) == np.float64 else x.dtype)
                      if getattr(x, "ndim", 0) else x, batch)
    return mb, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, prec.grads), state.params)


def itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def _size(shape, spec, mesh) -> int:
    return math.prod(shard_shape(shape, spec, mesh))


def _stack_dim(leaves) -> int:
    """The layer count of scanned (stacked) weights: the most common leading dim of rank ≥ 3
    leaves; 1 when there is none."""
    lead = collections.Counter(l.shape[0] for l in leaves if len(l.shape) >= 3)
    return lead.most_common(1)[0][0] if lead else 1


def residual_bytes(step, state, batch, saved: list, data_axes, sizes, tensor_dims: set[int],
                    param_shapes: set[tuple], pipe: PipelineNote | None = None,
                    sp: bool = False) -> tuple[float, float]:
    """Per-device bytes of the residuals the backward pass keeps for one microbatch.

    ``saved``: the residuals of the traced pass as ``jax.ad_checkpoint`` names them (they
    respect remat policies), ``ProgramReading.saved``: read off the trace the program reader
    walks, not a second one. A residual's dimension that
    equals the microbatch size is taken as sharded over the batch axes, and the residual as
    sharded over ``tensor`` when a dimension after that one equals a tensor-sharded weight
    dimension (a heuristic: activations follow the batch and the Megatron-split features;
    under sequence parallelism every activation is split over ``tensor``). Inside
    ``sk.pipeline`` (``pipe``: its trace note) the residuals leave the shard_map stacked over
    the pipe axis (and the manual data axes) along their first dimension (global shape,
    ``stages × data ×`` one device's), and their batch dimension is the pipeline microbatch (a
    device's rows of it when data is manual): both are divided out.

    Returns (all residuals, those saved inside the pipeline)."""
    mb, _ = microbatch(step, state, batch)
    b_mb = jax.tree.leaves(mb)[0].shape[0] if jax.tree.leaves(mb) else 0
    n_data = math.prod(sizes[a] for a in data_axes)
    n_tensor = sizes.get("tensor", 1)
    total = piped = 0.0
    for aval, where in saved:
        if "from the argument" in where or tuple(aval.shape) in param_shapes:
            continue  # parameters and their compute-dtype copies are counted on their own
        nbytes = math.prod(aval.shape) * itemsize(aval.dtype)
        shape = list(aval.shape)
        in_pipe = pipe is not None and "shard_map" in where
        # Manual data axes stack GPipe/circular's residuals over them too, with a device's rows
        # inside (an explicit schedule's residuals are its gradients, stacked over pipe only).
        manual = (math.prod(sizes[a] for a in (pipe.data_axes or ()))
                  if in_pipe and not is_explicit(pipe) else 1)
        if in_pipe and shape and shape[0] % (pipe.stages * manual) == 0:
            nbytes /= pipe.stages * manual
            shape = shape[1:]
            rows = b_mb // pipe.microbatches
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


def grad_reduce_elems(leaves, comp, grad_specs, data_axes, sizes) -> float:
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
    return n if split_feature_dims(shape, rows, tensor_dims) else 1


def split_feature_dims(shape, rows: int, tensor_dims: set[int]) -> list[int]:
    """The dims of an activation ``n_tensor_of`` reads as tensor-split: its feature dims (after
    its ``rows`` dim) whose size is a tensor-sharded weight dimension."""
    shape = list(shape)
    at = 0 if shape[:1] == [rows] else 1 if shape[1:2] == [rows] else -1
    return [k for k in range(at + 1, len(shape)) if shape[k] in tensor_dims]


def _strip(spec, axes):
    from jax.sharding import PartitionSpec as P

    out = []
    for e in spec:
        keep = tuple(a for a in entry_axes(e) if a not in axes)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)




@dataclasses.dataclass(frozen=True)
class Leaves:
    """One device's elements of each parameter leaf (lists in ``jax.tree.leaves`` order).

    Attributes:
        leaves: the layout's leaves (shape, spec).
        full: each leaf under its spec (what plain data parallelism stores).
        zshard: each leaf under its ZeRO spec.
        comp: what a device computes with: the leaf with its batch-axis (FSDP) sharding
            gathered. sk.moe's expert weights stay split over ``expert`` where they are used
            (each device runs its own experts) although the batch is split over that axis
            too: no FSDP gather there.
        stored: what the state holds (``zshard`` under ZeRO-3, else ``full``).
        stacked: the leaf is a scanned stack of ``layers`` layers.
        layers: the layer count of the stacked weights (1 when none).
        layer_comp: one layer's ``comp`` elements (unstacked leaves whole).
        width: the model width: the most common weight dimension (d_model in a residual network).
        tensor_dims: the dimension sizes split over a non-batch axis (Megatron-split features).
        piped: the leaf is a pipeline stage weight (its leading dim split over the pipe axis).
    """
    leaves: list
    full: list
    zshard: list
    comp: list
    stored: list
    stacked: list
    layers: int
    layer_comp: float
    width: int
    tensor_dims: set
    piped: list

    @property
    def fsdp(self) -> bool:
        """Some weights are gathered where used."""
        return any(s < c for s, c in zip(self.stored, self.comp))


def leaf_sizes(plan, lay, pipe: PipelineNote | None) -> Leaves:
    """The ``Leaves`` of ``lay`` (a step's layout) under ``plan``; ``pipe``: the pipeline's trace
    note, or None."""
    mesh, zero = plan.mesh, plan.zero
    leaves = lay.leaves
    full = [_size(l.shape, l.spec, mesh) for l in leaves]
    zshard = [_size(l.shape, z, mesh) for l, z in zip(leaves, lay.zero_specs)]
    comp = [_size(l.shape, _strip(l.spec, tuple(a for a in plan.batch_axes if a != "expert")), mesh)
            for l in leaves]
    L = _stack_dim(leaves)
    stacked = [len(l.shape) >= 3 and l.shape[0] == L and L > 1 for l in leaves]
    dims = collections.Counter(d for l, s in zip(leaves, stacked) for d in l.shape[int(s):])
    tensor_dims = {l.shape[d] for l in leaves for d, e in enumerate(l.spec)
                   if any(a not in plan.batch_axes for a in entry_axes(e))}
    piped = [bool(pipe and l.spec and pipe.axis in entry_axes(l.spec[0])) for l in leaves]
    return Leaves(leaves, full, zshard, comp, zshard if zero == 3 else full, stacked, L,
                  sum(c / L if s else c for c, s in zip(comp, stacked)),
                  dims.most_common(1)[0][0] if dims else 0, tensor_dims, piped)


def argument_memory(step, state, batch, lv: Leaves) -> dict[str, float]:
    """Per-device bytes of the step's arguments (parameters, optimizer state, model state, the
    batch and the step's scalars) and of its gradients."""
    plan, prec = step.plan, step.plan.precision
    mesh, sizes = plan.mesh, dict(plan.mesh.shape)
    state_elems = zero_state(plan.zero, model=sum(lv.full), shard=sum(lv.zshard))
    mem = {"params": float(state_elems["params"] * itemsize(prec.params))}
    opt_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state.opt_state)
    opt_specs = plan.opt_state_specs(opt_abstract, state.params, step.layout)
    mem["opt_state"] = float(sum(_size(x.shape, s, mesh) * itemsize(x.dtype) for x, s in
                                 zip(jax.tree.leaves(opt_abstract), jax.tree.leaves(
                                     opt_specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec)))))
    mem["model_state"] = float(sum(x.size * itemsize(x.dtype) for x in jax.tree.leaves(state.model_state)))
    n_batch = math.prod(sizes[a] for a in plan.batch_axes)
    mem["batch"] = float(sum(math.prod(x.shape) * min(itemsize(x.dtype), 4) / (n_batch if x.ndim else 1)
                             for x in jax.tree.leaves(batch)))
    scalars = 20 + (8 if state.loss_scale is not None else 0)
    mem["arguments"] = mem["params"] + mem["opt_state"] + mem["model_state"] + mem["batch"] + scalars
    mem["grads"] = float(state_elems["grads"] * itemsize(prec.grads))
    return mem


def tensor_uses(plan, lv: Leaves, lookup: list[bool], tied: list[bool], pipe: PipelineNote | None,
                sp: bool) -> tuple[float, float, float, float, float, float]:
    """Megatron's per-use count of tensor-parallel reductions, one use per tensor-sharded weight
    (XLA does not merge the q/k/v or gate/up input-gradient reductions): a row-parallel one
    (split on its input dim) in the forward — again in 1F1B's recomputed forward —, a
    column-parallel one in the backward, a vocab-parallel lookup in the forward and, tied, as
    the output head in the backward.

    Returns (forward uses, backward uses, sequence-parallel regions, those of them whose input
    an explicit schedule's backward ops gather again (their recomputed forward),
    whole-table elements looked up under sequence parallelism, their count)."""
    fwd = bwd = regions = recomputed = tables = n_tables = 0.0
    for l, s, t, tie, staged in zip(lv.leaves, lv.stacked, lookup, tied, lv.piped):
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
            # again): BW, or B of ZB-H1/ZB-V, whose W then only multiplies what B kept.
            if row:
                fwd += stack
        if sp and s and l.shape[-1] == lv.width and not vocab_lookup:
            regions += stack  # a region closes with a row-parallel weight into the residual stream
            # A backward op that recomputes the forward gathers the region's input again:
            # keep="input", and a policy's (the gather is no matmul); keep="all" holds it
            # (XLA:GPU, Llama 3 405B's 8K rows: 6.5 / 6.4 / 4.4 all-gathers per layer and
            # microbatch under input / dots / all).
            if staged and is_explicit(pipe) and pipe.keep != "all":
                recomputed += stack
    return fwd, bwd, regions, recomputed, tables, n_tables
