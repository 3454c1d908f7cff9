"""What one step's estimate reads, gathered once (``StepFacts``): the plan's figures, each leaf's
per-device sizes, ``sk.pipeline``'s trace note and the reading of the traced program
(``program.read_program``, with per-device sizes from the plan). ``from_step`` builds its
figures from it, ``pipeline_memory`` its pipeline memory.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from ...rules import entry_axes
from ..program.reader import ProgramReading, read_program
from ..program.explicit import TPU_ROW_BYTES
from .leaf_sizes import Leaves, itemsize, leaf_sizes, microbatch, n_tensor_of, split_feature_dims
from ..pipeline_note import PipelineNote
from .pipeline_cost import pipeline_note
from .roles import grads_on_shard


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What every part of one step's estimate reads (``from_step``, ``pipeline_memory``): the
    plan's figures, the leaves, the pipeline's trace note (or None) and the traced program's
    reading.

    Attributes:
        step, state, batch: the step estimated and its inputs (shapes are enough).
        sizes: the mesh's axis sizes.
        zero: the plan's ZeRO stage.
        m: the step's microbatches.
        bp, bc, bg: bytes per parameter, compute and gradient element.
        platform: the plan's platform (``"cpu"``, ``"gpu"``, ``"tpu"``).
        wire: bytes per element of the collectives beside the matmuls (f32 on XLA:CPU).
        data_axes, n_data: the batch axes of size > 1, and their devices.
        sp: sequence parallelism is on.
        ctx: the context axis's size.
        pipe: ``sk.pipeline``'s trace note, or None.
        lv: the leaves' per-device sizes (``leaf_sizes.Leaves``).
        reading: the traced program's reading (``program.read_program``).
    """
    step: object
    state: object
    batch: object
    sizes: dict
    zero: int
    m: int  # the step's microbatches
    bp: int  # bytes per parameter, compute and gradient element
    bc: int
    bg: int
    platform: str
    wire: int  # bytes per element of the collectives beside the matmuls
    data_axes: tuple
    n_data: int
    sp: bool  # sequence parallelism
    ctx: int  # the context axis's size
    pipe: PipelineNote | None
    lv: Leaves
    reading: ProgramReading


def step_facts(step, state, batch, pipeline) -> StepFacts:
    """The ``StepFacts`` of ``step`` on ``state`` and ``batch``: its plan read, its leaves sized,
    its loss traced and read once; ``pipeline``: as ``from_step.step_estimate``'s."""
    plan = step.plan
    sizes, prec = dict(plan.mesh.shape), plan.precision
    bc = itemsize(prec.compute)
    # XLA:CPU runs 16-bit dots in f32, so the collectives beside them (TP all-reduces, ZeRO-3
    # gathers) move f32 there; on GPU/TPU they move the compute dtype.
    platform = _platform(plan.mesh)
    data_axes = tuple(a for a in plan.batch_axes if sizes[a] > 1)
    pipe = pipeline_note(step, state, batch, pipeline, sizes)
    lv = leaf_sizes(plan, step.layout, pipe)
    seq_rule = plan.axis_rules.mapping.get("seq", ()) if plan.axis_rules is not None else ()
    # Sequence parallelism splits the sequence over a tensor-like axis; a ``context`` axis
    # (sk.context_attention) splits it too, but the weights stay whole there: it reduces the
    # gradients like a data axis and shrinks every activation by its size.
    sp = any(a not in plan.batch_axes and a not in ("pipe", "context") and sizes.get(a, 1) > 1 for a in seq_rule)
    # What a device computes with, reads and keeps: read off the traced program (also for
    # pipelines, whose parameter uses it tells; their memory has its own model).
    # A weight's dims split over the tensor-like axes (not the batch axes, not pipe): they place
    # its matmuls' tensor-parallel reductions (``program``); not followed where activations are
    # split on other grounds (sequence, context) or inside a pipeline's shard_map.
    tensor_like = lambda a: a not in plan.batch_axes and a != "pipe" and sizes.get(a, 1) > 1  # noqa: E731
    weight_dims = None if (pipe or sp or sizes.get("context", 1) > 1) else [
        [d for d, e in enumerate(l.spec) if any(map(tensor_like, entry_axes(e)))] for l in lv.leaves]
    weight_axes = frozenset(a for l in lv.leaves for e in l.spec for a in entry_axes(e) if tensor_like(a))
    n_data = math.prod(sizes[a] for a in data_axes)
    on_shard = loop_grads_on_shard(platform, n_data, plan.zero, step.microbatches, bool(pipe))
    # A scanned stack only a loop reads or writes, as the loop holds it (``loop_stacks``).
    stacks = None if pipe or platform == "cpu" else ([c / st for c, st in zip(lv.comp, lv.stored)],
                                                    [c / z if on_shard else 1.0 for c, z in zip(lv.comp, lv.zshard)])
    reading = _read(step, state, batch, lv.comp, sizes, data_axes, lv.tensor_dims, sp, weight_dims, weight_axes,
                    stacks)
    return StepFacts(step, state, batch, sizes, plan.zero, step.microbatches, itemsize(prec.params), bc,
                 itemsize(prec.grads), platform, 4 if platform == "cpu" else bc, data_axes,
                 math.prod(sizes[a] for a in data_axes), sp, sizes.get("context", 1), pipe, lv, reading)


def loop_grads_on_shard(platform: str, n_data: int, zero: int, microbatches: int, pipelined: bool) -> bool:
    """Whether a loop's stacked gradient leaves only ZeRO's shard: reduced slice by slice inside
    the loop where gradients are reduced into the shard (``roles.grads_on_shard``), as measured
    on XLA:GPU and XLA:TPU compiles (the 7B on 64 devices); XLA:CPU all-reduces the whole
    stacked gradient after its loop (tests/test_cost.py's pytree model at ZeRO-1)."""
    return platform != "cpu" and n_data > 1 and grads_on_shard(zero, microbatches, pipelined)


def _platform(mesh) -> str:
    """The mesh's platform; an AbstractMesh (``sk.cost.simulate``) names it in ``abstract_device``."""
    device = mesh.abstract_mesh.abstract_device
    if device is None:
        raise ValueError("the plan's AbstractMesh names no platform: give it abstract_device="
                         "jax.sharding.AbstractDevice(...) (sk.cost.simulated.abstract_mesh does)")
    return device.platform


def _read(step, state, batch, comp, sizes, data_axes, tensor_dims, sp, weight_dims=None,
          weight_axes=None, stacks=None) -> ProgramReading:
    """``program.read_program`` on one microbatch of this step, with per-device sizes from the
    plan (see ``program``'s docstring for the rules); ``stacks``: ``read_program``'s
    ``(stored_split, grad_split)``."""
    mb, params = microbatch(step, state, batch)
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
                            canonical_dots=_platform(step.plan.mesh) == "cpu", weight_dims=weight_dims,
                            weight_axes=weight_axes,
                            feature_dims=lambda shape: split_feature_dims(shape, rows, tensor_dims),
                            tensor_axis=n_tensor, grouped_ragged_dots=_platform(step.plan.mesh) == "tpu",
                            ragged_row_bytes=TPU_ROW_BYTES if _platform(step.plan.mesh) == "tpu" else 1,
                            stored_split=stacks[0] if stacks else None, grad_split=stacks[1] if stacks else None)
