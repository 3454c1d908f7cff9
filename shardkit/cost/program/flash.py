"""``sk.attention``'s Pallas flash kernels (Triton on GPU, Mosaic on TPU) as the program reader
sees them: ``pallas_call``\\ s whose bodies it cannot read, told apart from any other kernel by
the named scope ``sk.attention`` runs them in (``kernels.attention.flash_scope``), which every
call of one attention carries along its path in the jaxpr, forward and backward.

A named scope rather than jax's kernel names or operand shapes: the names are jax's internals
(``mha_forward``; Mosaic's calls have none), and a shape pattern would also match another
kernel with three same-shaped inputs. The scope is shardkit's own and says the kernel (its
layout) and whether it is causal, which the calls' operands do not.

Flops: ``cost.flash_flops``, the one formula the compiled-HLO reader uses too (forward 2
matmuls, Triton's backward 5, Mosaic's 4 + 3; causal ``(n + 1) / 2n`` of ``n`` blocks).

``sk.chunked_cross_entropy`` is named too (``kernels.loss.CHUNKED_LOSS_SCOPE``): its scans over
token chunks keep nothing per step but a log-sum-exp, and are read as the chunks of one loss,
not as a recurrence inside a layer (``ProgramReading.unseen``'s ``"recurrence"``).

Memory needs nothing here: the reader sizes a ``pallas_call``'s results as any op's (the output
and the log-sum-exp residual: O(B·H·T·Q), Mosaic's l and m at 128 f32 lanes a row), and the
(T, T) scores never leave the chip.
"""

from __future__ import annotations

import jax.numpy as jnp

from ...kernels.loss import CHUNKED_LOSS_SCOPE
from ..flash_flops import flash_call_flops, flash_kernel
from .walk import grouped_kernel


def chunked_loss(stack: str) -> bool:
    """Whether ``stack`` (``walker.scopes``) is inside ``sk.chunked_cross_entropy``: its scans walk
    token chunks of one loss (nothing saved per step but a log-sum-exp), not a recurrence."""
    return CHUNKED_LOSS_SCOPE in stack


def flash_flops(eqn, stack: str) -> float | None:
    """The flops of one flash kernel call (``cost.flash_flops``), or None where ``eqn`` is not
    one (not a ``pallas_call``, or not inside a flash scope: ``stack``, ``walker.scopes``'s)."""
    found = flash_kernel(stack) if eqn.primitive.name == "pallas_call" else None
    if found is None:
        return None
    array = lambda v: (v.aval.shape, jnp.issubdtype(v.aval.dtype, jnp.floating))  # noqa: E731
    return flash_call_flops(*found, [array(v) for v in eqn.invars], [array(v) for v in eqn.outvars])


def kernel_call(eqn, stack: str) -> tuple[str, float] | None:
    """``(name, flops)`` of a kernel call whose matmuls the reader counts — ``sk.attention``'s
    flash kernels (``"flash"``), ``sk.moe``'s grouped matmuls (``walk.grouped_kernel``) — or
    None. Their bodies hold tiles, not the program's values: no reading descends into them."""
    flash = flash_flops(eqn, stack)
    return ("flash", flash) if flash is not None else grouped_kernel(eqn)
