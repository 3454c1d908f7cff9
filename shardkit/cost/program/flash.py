"""``sk.attention``'s Pallas flash kernels (Triton on GPU, Mosaic on TPU) as the program reader
sees them: ``pallas_call``\\ s whose bodies it cannot read, told apart from any other kernel by
the named scope ``sk.attention`` runs them in (``kernels.attention.flash_scope``), which every
call of one attention carries along its path in the jaxpr, forward and backward.

A named scope rather than jax's kernel names or operand shapes: the names are jax's internals
(``mha_forward``; Mosaic's calls have none), and a shape pattern would also match another
kernel with three same-shaped inputs. The scope is shardkit's own and says the kernel (its
layout) and whether it is causal, which the calls' operands do not.

Flops, the reader's convention for a dot (2·M·N·K; the plain form's QKᵀ and PV are two), for
one call on (B, T, H, Q) queries against S keys, a matmul being ``2·B·H·T·S·Q``:

* forward (q, k, v in; the output out): QKᵀ and PV, 2 matmuls (Dao et al. 2022, alg. 1);
* backward (more operands in: the output, its cotangent, the log-sum-exp): it recomputes QKᵀ
  and dO·Vᵀ, then one matmul per gradient it writes (dV = PᵀdO, dQ = dS·K, dK = dSᵀQ): 5 for
  Triton's one call (2.5x the forward; Dao 2023, FlashAttention-2 alg. 2), 4 + 3 for Mosaic's
  dK/dV and dQ calls, each recomputing;
* a call that writes no query-shaped array (Triton's backward preprocessing: rowsum(dO·O)):
  no matmul.

Causal kernels skip the key blocks wholly above the diagonal and compute the diagonal ones
whole: ``(n + 1) / 2n`` of the matmuls for ``n`` blocks of 128 (both kernels' default block).

``sk.chunked_cross_entropy`` is named too (``kernels.loss.CHUNKED_LOSS_SCOPE``): its scans over
token chunks keep nothing per step but a log-sum-exp, and are read as the chunks of one loss,
not as a recurrence inside a layer (``ProgramReading.unseen``'s ``"recurrence"``).

Memory needs nothing here: the reader sizes a ``pallas_call``'s results as any op's (the output
and the log-sum-exp residual: O(B·H·T·Q), Mosaic's l and m at 128 f32 lanes a row), and the
(T, T) scores never leave the chip.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp

from ...kernels.attention import _BLOCK, FLASH_SCOPE  # the kernels' sequence block
from ...kernels.loss import CHUNKED_LOSS_SCOPE
from .walk import grouped_kernel

_SCOPE = re.compile(FLASH_SCOPE + r"_(triton|mosaic)_(causal|full)")
_SEQ_DIM = {"triton": 1, "mosaic": 2}  # (B, T, H, Q) and (B, H, T, Q)


def chunked_loss(stack: str) -> bool:
    """Whether ``stack`` (``walker.scopes``) is inside ``sk.chunked_cross_entropy``: its scans walk
    token chunks of one loss (nothing saved per step but a log-sum-exp), not a recurrence."""
    return CHUNKED_LOSS_SCOPE in stack


def flash_flops(eqn, stack: str) -> float | None:
    """The flops of one flash kernel call (see the module docstring), or None where ``eqn`` is
    not one (not a ``pallas_call``, or not inside a flash scope: ``stack``, ``walker.scopes``'s)."""
    scope = _SCOPE.search(stack) if eqn.primitive.name == "pallas_call" else None
    if scope is None:
        return None
    kernel, mask = scope.groups()
    q, k = eqn.invars[0].aval, eqn.invars[1].aval
    same = lambda a: a.shape == q.shape and jnp.issubdtype(a.dtype, jnp.floating)  # noqa: E731
    n_in = sum(same(v.aval) for v in eqn.invars)
    n_out = sum(same(v.aval) for v in eqn.outvars)
    matmuls = 0 if n_out == 0 else 2 if n_in <= 3 else 2 + n_out
    T, S = q.shape[_SEQ_DIM[kernel]], k.shape[_SEQ_DIM[kernel]]
    flops = matmuls * 2.0 * math.prod(q.shape) * S
    if mask == "causal":
        n = -(-T // _BLOCK)
        flops *= (n + 1) / (2 * n)
    return flops


def kernel_call(eqn, stack: str) -> tuple[str, float] | None:
    """``(name, flops)`` of a kernel call whose matmuls the reader counts — ``sk.attention``'s
    flash kernels (``"flash"``), ``sk.moe``'s grouped matmuls (``walk.grouped_kernel``) — or
    None. Their bodies hold tiles, not the program's values: no reading descends into them."""
    flash = flash_flops(eqn, stack)
    return ("flash", flash) if flash is not None else grouped_kernel(eqn)
