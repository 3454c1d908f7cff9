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

from . import hardware as hw_lib
from .cost import ROLES, Estimate, Layout, _tokens, times
from .plan import shard_shape
from .rules import entry_axes


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
                    param_shapes: set[tuple]) -> float:
    """Per-device bytes of the residuals the backward pass keeps for one microbatch.

    Traced with ``jax.ad_checkpoint`` (respects remat policies). A residual's dimension that
    equals the microbatch size is taken as sharded over the batch axes, one that equals a
    tensor-sharded weight dimension as sharded over ``tensor`` (a heuristic: activations
    follow the batch and the Megatron-split features)."""
    try:
        from jax._src.ad_checkpoint import saved_residuals
    except ImportError:  # pragma: no cover - private API moved
        return 0.0
    m = step.microbatches
    prec = step.plan.precision
    mb = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // m,) + tuple(x.shape[1:]),
                                                     np.float32 if np.dtype(x.dtype) == np.float64 else x.dtype)
                      if getattr(x, "ndim", 0) else x, batch)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, prec.grads), state.params)
    key = jax.random.key(0) if step._takes_rng else None

    def loss(p, b):
        return step._loss(p, state.model_state, b, key, None)[0]

    with step.plan.active():
        res = saved_residuals(loss, params, mb)
    b_mb = jax.tree.leaves(mb)[0].shape[0] if jax.tree.leaves(mb) else 0
    n_data = math.prod(sizes[a] for a in data_axes)
    n_tensor = sizes.get("tensor", 1)
    total = 0.0
    for aval, where in res:
        if "from the argument" in where or tuple(aval.shape) in param_shapes:
            continue  # parameters and their compute-dtype copies are counted on their own
        nbytes = math.prod(aval.shape) * _itemsize(aval.dtype)
        shape = list(aval.shape)
        if b_mb and b_mb in shape and n_data > 1:
            nbytes /= n_data
            shape.remove(b_mb)
        if n_tensor > 1 and any(d in tensor_dims for d in shape):
            nbytes /= n_tensor
        total += nbytes
    return total


def step_estimate(step, state, batch, *, pipeline=None, hardware=None, flops_per_token=None) -> Estimate:
    step._require_init()
    plan, lay = step.plan, step._layout
    mesh, sizes, prec, zero, m = plan.mesh, dict(plan.mesh.shape), plan.precision, plan.zero, step.microbatches
    bp, bc, bg = _itemsize(prec.params), _itemsize(prec.compute), _itemsize(prec.grads)
    # XLA:CPU runs 16-bit dots in f32, so the collectives beside them (TP all-reduces, ZeRO-3
    # gathers) move f32 there; on GPU/TPU they move the compute dtype.
    platform = mesh.devices.flat[0].platform
    wire = 4 if platform == "cpu" else bc
    data_axes = tuple(a for a in plan.batch_axes if sizes[a] > 1)
    n_data = math.prod(sizes[a] for a in data_axes)
    leaves = lay.leaves
    full = [_size(l.shape, l.spec, mesh) for l in leaves]
    zshard = [_size(l.shape, z, mesh) for l, z in zip(leaves, lay.zero_specs)]
    # What a device computes with: the leaf with its batch-axis (FSDP) sharding gathered.
    comp = [_size(l.shape, _strip(l.spec, plan.batch_axes), mesh) for l in leaves]
    stored = zshard if zero == 3 else full
    L = _stack_dim(leaves)
    stacked = [len(l.shape) >= 3 and l.shape[0] == L and L > 1 for l in leaves]
    layer_comp = sum(c / L if s else c for c, s in zip(comp, stacked))
    # The model width: the most common weight dimension (d_model in a residual network).
    dims = collections.Counter(d for l, s in zip(leaves, stacked) for d in l.shape[int(s):])
    width = dims.most_common(1)[0][0] if dims else 0

    mem = {"params": float(sum(stored) * bp)}
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
    g_full, g_shard, g_comp = sum(full) * bg, sum(zshard) * bg, sum(comp) * bg
    mem["grads"] = float(g_full if zero < 2 else g_shard)
    grad_buffer = mem["grads"] * (2 if m > 1 else 1)  # + the f32 microbatch accumulator
    tensor_dims = {l.shape[d] for l in leaves for d, e in enumerate(l.spec)
                   if any(a not in plan.batch_axes for a in entry_axes(e))}
    act = _residual_bytes(step, state, batch, data_axes, sizes, tensor_dims,
                          {tuple(l.shape) for l in leaves} | {tuple(l.shape[1:]) for l in leaves})
    mem["activations"] = act
    # Backward of one layer holds, beside the waiting residuals, the cotangents of that layer's
    # intermediates (≈ its residuals) — or, under ZeRO-3/FSDP, the gathered layer and its
    # unreduced gradient, whichever is larger.
    fsdp = any(s < c for s, c in zip(stored, comp))
    working = act / L
    if fsdp:
        working = max(working, layer_comp * (wire + bg))
    elif zero == 2 and n_data > 1:
        working = max(working, layer_comp * bg)
    backward = grad_buffer + act + working
    new_params = sum(stored) * bp
    # The compute-dtype copy of the parameters (absent when compute == params dtype).
    cast = sum(stored) * bc if bc != bp else 0.0
    mem["temporaries"] = max(backward, grad_buffer + new_params) + cast
    mem["peak"] = mem["arguments"] + mem["temporaries"] + (0 if step.donate else mem["arguments"])

    tokens = _tokens(batch)
    tok_dev_mb = tokens / n_data / m
    col = dict.fromkeys(ROLES, 0.0)
    counts = dict.fromkeys(ROLES, 0.0)
    if n_data > 1:
        col["grad-reduce"] = m * g_comp
        counts["grad-reduce"] = m * L
        if fsdp:  # gathered for the forward and again for the backward, every microbatch
            col["param-gather"] = 2 * m * sum(c for s, c in zip(stored, comp) if s < c) * wire
            counts["param-gather"] = 2 * m * L
        elif zero in (1, 2):
            col["param-gather"] = sum(f for f, z in zip(full, zshard) if z < f) * bp
            counts["param-gather"] = 1
    has_head = any("head" in l.path for l in leaves)
    for l, s in zip(leaves, stacked):
        # One all-reduce of (tokens × width) per use of a tensor-sharded weight: the output of
        # a row-parallel one (forward), the input gradient of a column-parallel one (backward)
        # (Megatron; XLA does not merge the q/k/v or gate/up input-gradient reductions). A tied
        # vocab-parallel embedding is used twice: lookup (forward) and output head (backward).
        dims = [d for d, e in enumerate(l.spec)
                if any(a not in plan.batch_axes and a != "pipe" for a in entry_axes(e))]
        if len(l.shape) < 2 or not dims:
            continue
        stack = l.shape[0] if s else 1
        uses = 2 if (not s and len(l.shape) == 2 and dims[0] == 0 and "embed" in l.path and not has_head) else 1
        col["tensor-reduce"] += uses * m * stack * tok_dev_mb * width * wire
        counts["tensor-reduce"] += uses * m * stack
    p = sizes.get("pipe", 1)
    if pipeline is not None and p > 1:
        pm, schedule, v = (tuple(pipeline) + ("gpipe", 1))[:3]
        ticks = (v * pm + p - 1) if schedule != "1f1b" else 2 * (pm + p - 1)
        col["pipe-permute"] = 2 * ticks * tokens / n_data / pm * width * bc
        counts["pipe-permute"] = 2 * ticks
        m = max(m, pm)

    matmul = sum(c for c, l in zip(comp, leaves) if len(l.shape) >= 2)
    total = sum(math.prod(l.shape) for l in leaves)
    fpt = flops_per_token or 6.0 * total
    flops = fpt * (matmul / total if total else 1.0) * tokens / n_data
    hw = _hardware(hardware, mesh)
    layout = Layout(data=math.prod(sizes[a] for a in ("replica", "data") if a in sizes),
                    fsdp=sizes.get("fsdp", 1), tensor=sizes.get("tensor", 1), pipe=p, zero=zero,
                    microbatches=m, schedule=(pipeline or (0, "gpipe"))[1] if pipeline else "gpipe")
    t = times(col, counts, flops, hw, layout)
    n_dev = mesh.devices.size
    return Estimate(mem, col, flops, fpt * tokens / n_dev, t, hw.name, layout, tokens,
                    hw.hbm_bytes, n_dev)


def _strip(spec, axes):
    from jax.sharding import PartitionSpec as P

    out = []
    for e in spec:
        keep = tuple(a for a in entry_axes(e) if a not in axes)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


def _hardware(hardware, mesh) -> hw_lib.Hardware:
    if isinstance(hardware, hw_lib.Hardware):
        return hardware
    if hardware is not None:
        return hw_lib.lookup(hardware)
    try:
        return hw_lib.lookup(mesh.devices.flat[0])
    except ValueError:
        return hw_lib.lookup("h100")
