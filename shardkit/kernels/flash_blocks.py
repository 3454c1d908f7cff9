"""One block of ring attention by the target's Pallas flash kernel: what ``sk.context_attention``
runs at each ring step on GPU and TPU targets (``context.py``; the CPU path is its blockwise
online softmax).

``FlashBlocks.forward`` runs the kernel's forward rule on (this device's queries, the visiting
K/V block) and returns the block's output and its log-sum-exp; the ring combines blocks by
their log-sum-exps. ``FlashBlocks.backward`` runs the kernel's backward rule on the same block
with the *whole row's* output and log-sum-exp in place of the block's: flash attention's
backward (Dao et al. 2022, FlashAttention, alg. 2) recomputes ``P = exp(S - lse)`` and uses
``delta = rowsum(dO * O)``, so given the row's final ``lse`` and ``O``, ``P`` is the block's
part of the row's softmax and the block's dQ, dK, dV are its exact contributions, which sum
over the blocks (ring flash attention; Liu et al. 2023, arXiv:2310.01889).

Each call runs inside the ring's type-checked ``shard_map``, so the kernel's rules run in a
nested unchecked region manual over the axes left to the compiler, and the outputs are typed
as varying over the ring's axes (``manual_flash.py``). The kernels' own forms of the
statistics are converted at the boundary: Triton keeps a base-2 log-sum-exp, Mosaic a row max
``m`` and sum ``l``. Neither kernel takes grouped-query heads: K/V heads are repeated per
block (the ring still carries the unrepeated K/V) and their gradients summed back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .._vma import varying
from .attention import _repeat_kv_heads, flash_scope
from .manual_flash import kernel_region, varying_axes

F32 = jnp.float32
_LOG2E = math.log2(math.e)


def _triton_stats(res):
    return res[5] / _LOG2E  # (B, H, T): the forward's base-2 log-sum-exp


def _triton_residuals(q, k, v, out, lse):
    return q, k, v, None, out.astype(q.dtype), lse * _LOG2E


def _mosaic_stats(res):
    return res[7] + jnp.log(res[6])  # (B, H, T): m + log l


def _mosaic_residuals(q, k, v, out, lse):
    return q, k, v, None, None, out, jnp.ones_like(lse), lse  # P = exp(S - m) / l with l = 1


# The kernel's residual tuple -> (B, H, T) natural log-sum-exp, and back (with the row's output).
_FORMS = {"triton": (_triton_stats, _triton_residuals), "mosaic": (_mosaic_stats, _mosaic_residuals)}


class FlashBlocks:
    """The ``impl`` kernel (``"triton"`` or ``"mosaic"``) on one (queries, K/V block) pair.

    Shapes: q ``(B, Tq, H, Q)``, k and v ``(B, Tk, K, Q)`` (H a multiple of K), the
    log-sum-exp ``(B, Tq, H)`` float32. ``causal`` masks by position within the pair (query
    ``t`` sees keys ``<= t``): a ring's diagonal block, ``Tq == Tk``.
    """

    def __init__(self, impl: str, scale: float):
        if impl not in _FORMS:
            raise ValueError(f"FlashBlocks: implementation {impl!r} is not one of {tuple(_FORMS)}")
        self.impl, self.scale = impl, scale

    def forward(self, q, k, v, causal: bool):
        """``(out, lse)``: the block's softmax-normalised output (q's dtype) and log-sum-exp."""
        axes = varying_axes(q, k, v)
        r = kernel_region(self.impl, q, causal, self.scale, None, kv_len=k.shape[1])
        stats_of = _FORMS[self.impl][0]

        def fwd(a, b, c):
            out, res = r.op.fwd(a, b, c, *r.nones, *r.fixed)
            return out, stats_of(res)

        k, v = _repeat_kv_heads(q, k, v)
        with jax.named_scope(flash_scope(self.impl, causal)):  # the cost readers count its flops
            out, lse = r(fwd, (r.kspec,) * 3, (r.kspec, r.stats))(*map(r.to_kernel, (q, k, v)))
        return varying((r.to_kernel(out), lse.transpose(0, 2, 1)), axes)

    def backward(self, q, k, v, out, lse, dout, causal: bool):
        """``(dq, dk, dv)`` float32: the block's part of the gradients, given the row's whole
        ``out`` (B, Tq, H, Q) and ``lse`` (B, Tq, H) and the output cotangent ``dout``."""
        axes = varying_axes(q, k, v, out, lse, dout)
        B, Tk, K, Q = k.shape
        r = kernel_region(self.impl, q, causal, self.scale, None, kv_len=Tk)
        residuals = _FORMS[self.impl][1]

        def bwd(a, b, c, o, stats, g):
            return tuple(r.op.bwd(*r.fixed, residuals(a, b, c, o, stats), g)[:3])

        kr, vr = _repeat_kv_heads(q, k, v)
        args = tuple(map(r.to_kernel, (q, kr, vr, out, dout)))
        with jax.named_scope(flash_scope(self.impl, causal)):
            dq, dk, dv = r(bwd, (r.kspec,) * 4 + (r.stats, r.kspec), (r.kspec,) * 3)(
                *args[:4], lse.transpose(0, 2, 1), args[4])
        fold = lambda d: r.to_kernel(d).astype(F32).reshape(B, Tk, K, -1, Q).sum(3)  # noqa: E731
        return varying((r.to_kernel(dq).astype(F32), fold(dk), fold(dv)), axes)

