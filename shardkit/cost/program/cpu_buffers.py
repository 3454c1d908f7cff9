"""What XLA:CPU keeps of a program beyond the fusion rules ``program`` applies on every
platform, as rules on a jaxpr: the copies its matmul and convolution kernels make of operands in
a non-canonical layout, and the products it writes out for its reduction kernels. ``program``'s liveness simulation applies them
when the step's platform is the CPU (``sk.cost.simulate`` compiles on CPU devices, so its
figures are XLA:CPU's too); each was read off XLA:CPU's buffer assignment of a compiled step
(``XLA_FLAGS=--xla_dump_to=... --xla_dump_hlo_as_text``).
"""

from __future__ import annotations

import math

from jax._src import core as jcore


def transposed_operands(eqn) -> list:
    """The operands of a matmul or convolution equation that XLA:CPU copies first."""
    if eqn.primitive.name == "conv_general_dilated":
        return transposed_conv_operands(eqn)
    return transposed_dot_operands(eqn)


def transposed_conv_operands(eqn) -> list:
    """Operands of a convolution that XLA:CPU copies into its native layout first (input
    batch-major with features last, kernel with its input and output features last) — the
    weight-gradient convolution, which treats the batch as features, needs both copied."""
    dn = eqn.params["dimension_numbers"]
    if dn is None:
        return []
    out = []
    for v, spec, want in ((eqn.invars[0], dn.lhs_spec, "lhs"), (eqn.invars[1], dn.rhs_spec, "rhs")):
        rank = v.aval.ndim
        spatial = tuple(range(1, rank - 1)) if want == "lhs" else tuple(range(rank - 2))
        native = (0, rank - 1) + spatial if want == "lhs" else (rank - 1, rank - 2) + spatial
        if tuple(spec) != native and not isinstance(v, jcore.Literal):
            out.append(v)
    return out


def transposed_dot_operands(eqn) -> list:
    """Operands of a ``dot_general`` that XLA:CPU copies into its canonical layout first
    (lhs ``[batch..., M, K]``, rhs ``[batch..., K, N]``: batch dims leading, the lhs's contracted
    dims last, the rhs's right after its batch dims); GPU/TPU matmul libraries take transposed
    operands as they are."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    out = []
    for v, c, b, lhs in ((eqn.invars[0], lc, lb, True), (eqn.invars[1], rc, rb, False)):
        if isinstance(v, jcore.Literal):
            continue
        nb, nc, rank = len(b), len(c), v.aval.ndim
        want_c = tuple(range(rank - nc, rank)) if lhs else tuple(range(nb, nb + nc))
        if tuple(b) != tuple(range(nb)) or tuple(c) != want_c:
            out.append(v)
    return out


def materialised_for_reductions(eqns, fusible: set, views: set, reductions: set) -> set[int]:
    """Equations whose result XLA:CPU materialises for a reduction: an elementwise op with
    an operand broadcast from a non-scalar (a norm's ``x * rsqrt(mean(x²))``, a per-feature
    scale, a masked lookup) whose result a reduction reads, directly or through fusible
    elementwise ops (``fusible``: the ops XLA fuses, ``views``: those that only re-label a
    buffer, ``reductions``: the reduction primitives). XLA:CPU's reduction kernels (YNNPACK
    fusions in jax 0.10) take elementwise math on their operands but no broadcast, so that product is written out — in the forward, when
    the reduction is its backward's (a norm scale's gradient), where it then waits as a
    residual."""
    made: dict = {}
    for e in eqns:
        for v in e.outvars:
            made[v] = e
    reaches: set = set()  # vars a reduction reads through fusible elementwise ops
    for e in reversed(eqns):
        name = e.primitive.name
        if name in reductions or (name in fusible and any(v in reaches for v in e.outvars)):
            reaches.update(u for u in e.invars if not isinstance(u, jcore.Literal))
    out = set()
    for i, e in enumerate(eqns):
        if e.primitive.name not in fusible or e.primitive.name in views:
            continue
        if not any(v in reaches for v in e.outvars):
            continue
        full = math.prod(e.outvars[0].aval.shape)
        for u in e.invars:
            if isinstance(u, jcore.Literal):
                continue
            b = made.get(u)
            # lax broadcasts size-1 dims of an operand of equal rank itself; jnp may write
            # the broadcast out as its own equation.
            src = b.invars[0] if (b is not None and b.primitive.name == "broadcast_in_dim" and b.invars
                                  and not isinstance(b.invars[0], jcore.Literal)) else u
            n = math.prod(src.aval.shape)
            if 1 < n < full:
                out.add(i)
                break
    return out
