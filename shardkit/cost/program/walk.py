"""What the program's readings know of jaxpr equations: the nested jaxprs of an equation with
their trip counts (``walker`` descends through them), a ``shard_map`` output that needs no
buffer of its own, an equation's matmul flops."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax._src import core as jcore

from .op_kinds import FUSIBLE as _FUSIBLE, VIEW as _VIEW


def sub_jaxprs(eqn) -> list[tuple[jcore.Jaxpr, list, float]]:
    """Nested jaxprs of an equation with the outer vars feeding their inputs and how many times
    each runs (``scan``: its length; a ``cond``: each branch once, the caller takes the max)."""
    p, name = eqn.params, eqn.primitive.name
    if name == "scan":
        return [(p["jaxpr"].jaxpr, list(eqn.invars), float(p["length"]))]
    if name == "cond":
        return [(b.jaxpr, list(eqn.invars[1:]), 1.0) for b in p["branches"]]
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        body = p["body_jaxpr"].jaxpr
        return [(body, list(eqn.invars[nc:nc + nb]) + list(eqn.invars[nc + nb:]), float("nan"))]
    out = []
    for sub in jcore.jaxprs_in_params(p):
        sub = getattr(sub, "jaxpr", sub)
        if _combiner(sub, eqn):
            continue  # a scatter's, reduce's or sort's scalar computation: not a region of the program
        if len(sub.invars) == len(eqn.invars):
            out.append((sub, list(eqn.invars), 1.0))
        elif len(sub.invars) < len(eqn.invars):  # custom_vjp: consts first
            out.append((sub, list(eqn.invars[len(eqn.invars) - len(sub.invars):]), 1.0))
    return out


def scan_split(eqn) -> tuple[int, int]:
    """``(consts, carries)``: how many of a ``scan`` equation's leading inputs are loop
    constants and how many carries (the rest are the scanned ``xs``).

    Read off the avals, which every jax version has (jax 0.10 also wrote ``num_consts`` and
    ``num_carry`` into the params; jax 0.11 replaced them by a ``FlatTree``): the body's inputs
    are consts, carries, then one slice of each ``xs`` (the outer value has one more, leading,
    dimension); its outputs are the carries (the outer value has the body's shape), then one
    slice of each ``ys``.
    """
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    ndim = lambda v: len(getattr(v.aval, "shape", ()))  # noqa: E731
    carries = 0
    for inner, outer in zip(body.outvars, eqn.outvars):
        if ndim(inner) != ndim(outer):
            break
        carries += 1
    xs = 0
    for inner, outer in zip(reversed(body.invars), reversed(eqn.invars)):
        if ndim(outer) != ndim(inner) + 1:
            break
        xs += 1
    return len(eqn.invars) - carries - xs, carries


def _combiner(sub: jcore.Jaxpr, eqn) -> bool:
    """Whether ``sub`` is the scalar function an array op applies element by element (a
    scatter's update, a reduction's or a sort's comparison): all its inputs are scalars
    while the op's are arrays. Its inputs and outputs do not correspond to the op's."""
    return all(not getattr(v.aval, "shape", ()) for v in sub.invars) and any(
        getattr(getattr(u, "aval", None), "shape", ()) for u in eqn.invars)


def elementwise_output(eqn, index: int) -> bool:
    """Whether a ``shard_map``'s output ``index`` needs no buffer of its own once XLA has
    partitioned the shard_map away: one of its inputs passed through (a weight saved for the
    backward: the caller's buffer), or a fusible elementwise op of values it keeps anyway."""
    body = eqn.params["jaxpr"]
    body = getattr(body, "jaxpr", body)
    out = body.outvars[index]
    if isinstance(out, jcore.Literal) or out in body.invars:
        return True
    for e in body.eqns:
        if out in e.outvars:
            if e.primitive.name in _VIEW:
                return bool(e.invars) and e.invars[0] in body.invars
            return e.primitive.name in _FUSIBLE
    return False


def nbytes(aval) -> float:
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def dot_flops(eqn) -> float:
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)
    rhs = eqn.invars[1].aval  # conv: rhs = (out_features, in_features / groups, *window)
    dn = eqn.params["dimension_numbers"]
    rhs_spec = dn.rhs_spec if dn is not None else tuple(range(rhs.ndim))
    swapped = _swapped_window(eqn)
    if swapped is not None:
        return 2.0 * math.prod(out.shape) * rhs.shape[rhs_spec[1]] * swapped
    window = math.prod(rhs.shape[d] for d in rhs_spec[2:])
    if any(d > 1 for d in eqn.params.get("lhs_dilation") or ()):
        # A strided convolution's input gradient is a convolution of the gradient dilated by the
        # stride (lhs_dilation): the inserted zeros are not multiplied, each gradient element
        # meets every tap (cuDNN's backward-input, XLA:GPU's count) — per spatial dim the
        # gradient's extent, not the result's over the stride (they differ at a 1x1 map).
        lhs = eqn.invars[0].aval
        lhs_spec, out_spec = (dn.lhs_spec, dn.out_spec) if dn is not None else (tuple(range(lhs.ndim)),) * 2
        window *= math.prod(lhs.shape[a] / out.shape[b] for a, b in zip(lhs_spec[2:], out_spec[2:]))
    return 2.0 * math.prod(out.shape) * rhs.shape[rhs_spec[1]] * window


def ragged_dot_flops(eqn, grouped: bool = False) -> float:
    """A ``ragged_dot_general`` (``lax.ragged_dot``, the grouped matmul where no kernel runs) as
    XLA:CPU and XLA:GPU run it: a masked dense product over all ``G`` groups, ``2·G·M·K·N``
    (``G`` times the routed rows' ``2·M·K·N``); the weight-gradient form, ragged over the
    contraction, has ``G`` in its result already. ``grouped``: XLA:TPU's, whose forward and
    input gradient run as Mosaic grouped matmuls (``ragged-dot`` custom calls), ``G`` times
    fewer; its weight gradient stays dense."""
    rdn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, _), _ = rdn.dot_dimension_numbers
    lhs, out = eqn.invars[0].aval, eqn.outvars[0].aval
    flops = 2.0 * math.prod(out.shape) * math.prod(lhs.shape[d] for d in lc)
    if any(d in lc for d in rdn.lhs_ragged_dimensions):
        return flops  # the weights' gradient: (G, K, N) from the rows, each row in one group
    return flops if grouped else flops * eqn.invars[2].aval.shape[-1]  # group_sizes: (..., G)


def ragged_dot_masked(eqn, grouped: bool = False) -> tuple[int, ...]:
    """The operands (0: lhs, 1: rhs) a ``ragged_dot_general`` run as a masked dense product
    reads as ``G`` masked copies: jax lowers it for XLA:CPU and XLA:GPU (``lax.lax``'s
    ``_ragged_dot_general_impl``) by broadcasting the ragged operand over the ``G`` groups and
    zeroing the rows outside each group (``(G, M, K)``), then one dot contracts over groups and
    ``K``. Ragged over the rows (forward, input gradient): the rows (lhs); ragged over the
    contraction (the weights' gradient, both operands hold the rows): both; ragged over a batch
    dimension: none (a plain batched dot). ``grouped``: XLA:TPU's, whose forward and input
    gradient are grouped-matmul kernels; its weight gradient stays masked."""
    rdn = eqn.params["ragged_dot_dimension_numbers"]
    (lc, _), (lb, _) = rdn.dot_dimension_numbers
    ragged = set(rdn.lhs_ragged_dimensions)
    if ragged & set(lb):
        return ()
    if ragged & set(lc):
        return (0, 1)
    return () if grouped else (0,)


# The grouped-matmul kernels (``shardkit.kernels.grouped``): Megablox's gmm and tgmm (a
# ``pallas_call`` on TPU) and Mosaic GPU's ragged_dot / transposed_ragged_dot (an ``mpmd_map``).
GROUPED_KERNELS = ("pallas_call", "mpmd_map")


def grouped_kernel(eqn) -> tuple[str, float] | None:
    """``(name, flops)`` of a grouped-matmul kernel call, or None for any other kernel.

    Told by its float operands and result (the int operands are group sizes and tile maps):
    rows ``(M, K)`` by per-group weights ``(G, K, N)`` into ``(M, N)`` ("gmm": Megablox's gmm,
    Mosaic GPU's ragged_dot), or two row blocks ``(M, K)``, ``(M, N)`` (either may come
    transposed) into per-group ``(G, K, N)`` ("tgmm": the weights' gradient). Each row meets
    one group's weights: ``2·M·K·N`` for both (Megablox's own ``CostEstimate``), the static
    bound ``M`` being the rows the kernel is handed (a receive buffer's worst case)."""
    if eqn.primitive.name not in GROUPED_KERNELS or len(eqn.outvars) != 1:
        return None
    floats = [v.aval for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)]
    out = eqn.outvars[0].aval
    if len(floats) != 2 or not jnp.issubdtype(out.dtype, jnp.floating):
        return None
    ranks = sorted(a.ndim for a in floats)
    if ranks == [2, 3] and out.ndim == 2:
        name = "gmm"
    elif ranks == [2, 2] and out.ndim == 3:
        name = "tgmm"
    else:
        return None
    # Of M·K, K·N and M·N (the 3-d array counted per group), the product is (M·K·N)²; a kernel
    # whose shapes do not fit that (another two-operand kernel) is not taken for one.
    sizes = math.prod(math.prod(a.shape[1:] if a.ndim == 3 else a.shape) for a in (*floats, out))
    mkn = math.isqrt(sizes)
    if mkn * mkn != sizes or (name == "gmm" and out.shape[0] not in [a.shape[0] for a in floats if a.ndim == 2]):
        return None
    return name, 2.0 * mkn


def _swapped_window(eqn) -> float | None:
    """The window a convolution runs with once XLA has swapped its operands, or None where it
    does not. XLA's ``ConvOperandSwapper`` (once in ``AlgebraicSimplifier``) makes the kernel
    the input where the window has more taps than the input has positions (a 3x3 convolution
    on a 1x1 or 2x2 map, forward or input gradient): the swapped window is the input's extent,
    its dilation (a strided convolution's input gradient) written out as zeros, so most taps
    that would land on padding are never multiplied. Read off ResNet-18's H100 compile at 16x16
    images (its 1x1 and 2x2 stages); the filter gradients, whose window is the output map,
    keep theirs."""
    p = eqn.params
    if p.get("feature_group_count", 1) > 1 or p.get("batch_group_count", 1) > 1:
        return None
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    dn = p["dimension_numbers"]
    lhs_spec = dn.lhs_spec if dn is not None else tuple(range(lhs.ndim))
    rhs_spec = dn.rhs_spec if dn is not None else tuple(range(rhs.ndim))
    nd = len(rhs_spec) - 2
    strides = p.get("window_strides") or (1,) * nd
    pads = p.get("padding") or ((0, 0),) * nd
    base = p.get("lhs_dilation") or (1,) * nd
    wdil = p.get("rhs_dilation") or (1,) * nd
    kernel = swapped = 1
    window = 1.0
    for i in range(nd):
        k, n = rhs.shape[rhs_spec[2 + i]], lhs.shape[lhs_spec[2 + i]]
        (lo, hi), s, b, w = pads[i], strides[i], base[i], wdil[i]
        plain = lo == hi == 0 and w == 1
        if plain and ((b == k and s == k - 1) or (k == n and b == 1 and s == 1)):
            window *= k  # a group or pure contraction dim: kept as it is
            continue
        kernel *= k
        swapped *= k if (n == 1 and s == 1 and w == 1 and lo == hi == k - 1) else n
        window *= 1 + (n - 1) * b
    return window if kernel > swapped else None
