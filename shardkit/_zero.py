"""Where ZeRO puts a leaf: the data axes on the dimension fsdp already splits, else its largest
divisible one; optimizer state of any shape matched to its parameter (factored moments keep the
parameter's axes), and the strict check that nothing large is replicated silently. ``Plan`` is
the public face."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from . import _model
from .rules import LeafLayout, ShardingError, entry_axes, key_to_str, leaf_info, spec_axes

# A leaf ZeRO cannot shard is replicated without an error when its ZeRO shard would hold fewer
# elements than this (a PRNG key, a 10-class head's bias, an optimizer's coefficient vector):
# its replica is noise next to any weight matrix. Larger ones are errors under Plan(strict=True).
SMALL_PER_DEVICE = 128
# sk.moe's default axis: a batch axis the experts are split over, not gathered over.
EXPERT_AXIS = "expert"


def zero_spec(plan, shape: tuple[int, ...], spec: P) -> tuple[P, str, bool]:
    """Adds the unused data axes to the dimension already split over a batch axis, else to
    the largest dimension they divide (ZeRO's shard).

    Returns ``(spec, note, refused)``: ``refused`` when the leaf is big enough that
    replicating it over the data axes counts (``SMALL_PER_DEVICE``) and no dimension is
    divisible by any of them.
    """
    used = set(spec_axes(spec))
    free = tuple(a for a in plan.data_axes if a not in used and plan.mesh.shape[a] > 1)
    if not free or not shape:
        return spec, "", False
    entries = list(spec) + [None] * (len(shape) - len(spec))
    sizes = dict(plan.mesh.shape)
    # Try all free axes together, then each alone (largest first), on a dim already split over
    # a batch axis (fsdp), else on the largest dim. The gradient is a partial sum over every
    # batch axis: with all of them on one dim its reduction is one reduce-scatter, while
    # fsdp on one dim and data on another leaves XLA to all-reduce over both and slice
    # (twice the wire bytes; issue 36). Not sk.moe's ``expert`` axis: each expert's gradient is
    # whole on its expert device (partial over the data axes only), so joining its dim gains
    # nothing, and under ZeRO-3 the batch-order reorder would put the data axes before
    # ``expert``, leaving XLA to permute the experts' blocks into sk.moe's shard_map.
    options = [free] + [(a,) for a in sorted(free, key=lambda a: -sizes[a])] if len(free) > 1 else [free]
    batch = set(plan.batch_axes) - {EXPERT_AXIS}
    dims = sorted(range(len(shape)), key=lambda d: (not batch & set(entry_axes(entries[d])), -shape[d]))
    for axes in options:
        n = math.prod(sizes[a] for a in axes)
        for d in dims:
            cur = entry_axes(entries[d])
            if shape[d] % (n * math.prod(sizes[a] for a in cur)) == 0:
                # After the dim's own axes: a ZeRO shard is then a slice of the device's
                # tensor shard, where the gradient's reduce-scatter over data leaves it
                # (data-major order would need collective-permutes to reorder the blocks).
                new = cur + axes
                if plan.zero >= 3 and set(cur) <= batch:
                    new = tuple(a for a in plan.batch_axes if a in new)
                entries[d] = new[0] if len(new) == 1 else new
                while entries and entries[-1] is None:
                    entries.pop()
                note = "" if axes == free else f"ZeRO shards over {axes} only (no dim divisible by all of {free})"
                return P(*entries), note, False
    axes_txt = ", ".join(f"{a}={sizes[a]}" for a in free)
    small = math.prod(shape) < math.prod(sizes[a] for a in free) * SMALL_PER_DEVICE
    why = (f"{math.prod(shape)} elements, fewer than {SMALL_PER_DEVICE} per data device" if small
           else "Plan(strict=False)")
    return spec, f"ZeRO cannot shard it: no dim divisible by {axes_txt}; kept replicated over them ({why})", not small

def refuse_replicated(plan, offenders: list[tuple[str, tuple[int, ...], str]], what: str) -> None:
    """Under ``strict``, one error naming every leaf ZeRO would have to replicate."""
    if not offenders or not plan.strict:
        return
    sizes = dict(plan.mesh.shape)
    axes_txt = " x ".join(f"{a}={sizes[a]}" for a in plan.data_axes if sizes[a] > 1)
    problems = [f"{path} shape={shape} ({source}): no dim is divisible by {axes_txt} or any one of them"
                for path, shape, source in offenders]
    raise ShardingError(
        f"{len(problems)} {what} leaf/leaves cannot be sharded over the data axes {axes_txt} "
        f"(ZeRO-{plan.zero}) and would be replicated on every data device:", problems,
        fix="make a dimension of each a multiple of the data axes' size (or change the mesh), or pass "
            "Plan(..., strict=False) to keep them replicated; plan.describe(params, opt_state=...) lists them")


def opt_layout(plan, opt_state, params, layout, check):
    """``(treedef, one LeafLayout per optimizer-state leaf)``: see ``Plan.opt_state_layouts``."""
    lay = layout or plan.param_layout(params)
    ppaths = leaf_info(_model.unpack(params).params if layout is None else params)[0]
    by_path = {p: i for i, p in enumerate(ppaths)}
    flat, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
    rows, offenders = [], []
    for keypath, leaf in flat:
        parts = [key_to_str(k) for k in keypath]
        path, shape = "/".join(parts), tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", None)
        if math.prod(shape) <= 1:  # step counts, placeholders: nothing to split
            kind = "scalar" if not shape else "one element" if math.prod(shape) else "empty"
            rows.append(LeafLayout(path, shape, dtype, P(), kind))
            continue
        # The longest suffix of the path that is a parameter's path; an NNX Variable adds a
        # trailing "value" key to an optimizer state built from an nnx.State.
        tails = [parts] + ([parts[:-1]] if len(parts) > 1 and parts[-1] == "value" else [])
        j = next((by_path[s] for t in tails for s in ("/".join(t[i:]) for i in range(len(t))) if s in by_path),
                 None)
        base, source = P(), "own shape"
        if j is not None:
            param = lay.leaves[j]
            if param.shape == shape:
                base, source = param.spec, f"follows parameter {param.path}"
            else:
                base, how = factored_spec(shape, param.shape, param.spec)
                source = f"{how} of parameter {param.path}" if how else f"own shape (under parameter {param.path})"
        if plan.zero == 0:
            rows.append(LeafLayout(path, shape, dtype, base, source))
            continue
        spec, note, refused = zero_spec(plan, shape, base)
        rows.append(LeafLayout(path, shape, dtype, spec, source, note))
        if refused:
            offenders.append((f"opt_state/{path}", shape, source))
    if check:
        refuse_replicated(plan, offenders, "optimizer-state")
    return treedef, rows


def factored_spec(shape: tuple[int, ...], pshape: tuple[int, ...], pspec: P) -> tuple[P, str]:
    """The spec of a factored moment of a parameter (its shape with one dimension removed or
    set to 1) and how it was recognised; ``(P(), "")`` when ``shape`` is not one.

    The moment keeps the parameter's axes on the dimensions it shares with it. When several
    dimensions could be the one summarised (a square matrix), only the axes every reading
    agrees on are kept: which one it is cannot be told from shapes, and guessing is wrong for
    half of them.
    """
    entries = list(pspec) + [None] * (len(pshape) - len(pspec))
    readings, dims = [], []
    for d in range(len(pshape)):
        if len(shape) == len(pshape) - 1 and shape == pshape[:d] + pshape[d + 1:]:
            readings.append(entries[:d] + entries[d + 1:])
            dims.append(d)
        elif len(shape) == len(pshape) and pshape[d] != 1 and shape == pshape[:d] + (1,) + pshape[d + 1:]:
            readings.append(entries[:d] + [None] + entries[d + 1:])
            dims.append(d)
    if not readings:
        return P(), ""
    kept = [r[0] if all(x == r[0] for x in r) else None for r in zip(*readings)]
    while kept and kept[-1] is None:
        kept.pop()
    which = f"dim {dims[0]}" if len(dims) == 1 else "dim " + " or ".join(map(str, dims))
    return P(*kept), f"factored moment ({which} summarised)"
