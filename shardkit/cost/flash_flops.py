"""The flops of one call of ``sk.attention``'s Pallas flash kernels (Triton on GPU, Mosaic on
TPU): the one formula both readers use — the program reader on a ``pallas_call`` in the jaxpr
(``program.flash``) and the compiled-HLO reader on the custom call it lowers to
(``compiled.hlo``: ``__gpu$xla.gpu.triton``, ``tpu_custom_call``), which no compiler counts.

A call is told apart from any other kernel by the named scope ``sk.attention`` runs it in
(``kernels.attention.flash_scope``), which the jaxpr keeps in its name stacks and the compiled
HLO in the op's ``metadata={op_name=...}``: the kernel (its layout) and whether it is causal,
which the operands do not say.

Flops, the convention of a dot (2·M·N·K; the plain form's QKᵀ and PV are two), for one call on
(B, T, H, Q) queries against S keys, a matmul being ``2·B·H·T·S·Q``:

* forward (q, k, v in; the output out): QKᵀ and PV, 2 matmuls (Dao et al. 2022, alg. 1);
* backward (more operands in: the output, its cotangent, the log-sum-exp): it recomputes QKᵀ
  and dO·Vᵀ, then one matmul per gradient it writes (dV = PᵀdO, dQ = dS·K, dK = dSᵀQ): 5 for
  Triton's one call (2.5x the forward; Dao 2023, FlashAttention-2 alg. 2), 4 + 3 for Mosaic's
  dK/dV and dQ calls, each recomputing;
* a call that writes no query-shaped array (Triton's backward preprocessing: rowsum(dO·O)):
  no matmul.

Causal kernels skip the key blocks wholly above the diagonal and compute the diagonal ones
whole: ``(n + 1) / 2n`` of the matmuls for ``n`` blocks of 128 (both kernels' default block).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..kernels.attention import _BLOCK, FLASH_SCOPE  # the kernels' sequence block

SCOPE = re.compile(FLASH_SCOPE + r"_(triton|mosaic)_(causal|full)")
_SEQ_DIM = {"triton": 1, "mosaic": 2}  # (B, T, H, Q) and (B, H, T, Q)

# An array of a call: its shape, and whether its elements are floating point (a query-shaped
# integer array, e.g. segment ids, is no operand of the matmuls).
Array = tuple[Sequence[int], bool]


def flash_kernel(names: str) -> tuple[str, bool] | None:
    """``(kernel, causal)`` of the flash scope in ``names`` (a jaxpr name stack, an HLO
    ``op_name``), or None where there is none."""
    m = SCOPE.search(names)
    return None if m is None else (m.group(1), m.group(2) == "causal")


def flash_call_flops(kernel: str, causal: bool, operands: Sequence[Array], results: Sequence[Array]) -> float:
    """The flops of one flash kernel call (see the module docstring): ``kernel`` (``"triton"``
    or ``"mosaic"``) and ``causal`` from ``flash_kernel``; the call's ``operands`` and
    ``results`` in order, queries and keys first."""
    q, k = tuple(operands[0][0]), tuple(operands[1][0])
    # Query- or key-shaped float arrays (a ring's block pairs queries and keys of two lengths).
    same = lambda a: tuple(a[0]) in (q, k) and a[1]  # noqa: E731
    n_in, n_out = sum(map(same, operands)), sum(map(same, results))
    matmuls = 0 if n_out == 0 else 2 if n_in <= 3 else 2 + n_out
    T, S = q[_SEQ_DIM[kernel]], k[_SEQ_DIM[kernel]]
    flops = matmuls * 2.0 * math.prod(q) * S
    if causal:
        n = -(-T // _BLOCK)
        flops *= (n + 1) / (2 * n)
    return flops
