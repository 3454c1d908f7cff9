"""``sk.attention``: softmax attention (causal, grouped-query, sliding window) run by the best
kernel of the platform the program is compiled for (``sk.target_platform()``), not of the
process's backend, so a deviceless H100 or TPU compile holds the program that device would run.

| platform | kernel (``implementation``) |
|---|---|
| GPU, a real one with cuDNN, 16-bit | cuDNN's fused flash attention (``"cudnn"``: ``jax.nn.dot_product_attention``) |
| GPU otherwise (deviceless compiles, f32) | Pallas Triton flash attention (``"triton"``: ``jax.experimental.pallas.ops.gpu.attention.mha``) |
| TPU | Pallas Mosaic flash attention (``"mosaic"``: ``jax.experimental.pallas.ops.tpu.flash_attention``) |
| CPU | the blockwise online-softmax scan (``"blockwise"``, ``kernels/blockwise.py``) |

The Pallas kernels are per-device programs (a custom call the SPMD partitioner cannot split),
so they run inside a ``shard_map`` over the batch and head dimensions' mesh axes: each device
attends its own sequences and heads. Where a kernel cannot take the call (a sliding window,
a sequence its blocks do not divide, a head_dim it does not support) the blockwise form runs
instead and says why (a ``KernelFallbackWarning`` and a trace note), never silently.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..plan import active_plan, note
from ..rules import ShardingError
from ..xla import target_platform
from .blockwise import blockwise_attention, reference_attention
from .kept import kept_output

IMPLEMENTATIONS = ("auto", "cudnn", "triton", "mosaic", "blockwise", "reference")
_BLOCK = 128  # the Pallas kernels' sequence block (both default to 128)
# Triton's kernel holds four (block, head_dim) tiles in shared memory: f32 × head_dim 128 at
# block 128 asked for 262,144 bytes, refused by a deviceless H100 compile and on a real H200
# (the limit per block on both is 232,448: 227 KiB). Such inputs take the next smaller block.
_TRITON_TILES, _GPU_SHARED_BYTES = 4, 232_448
_TRITON_BLOCKS = (128, 64, 32)


def _triton_block(Q: int, itemsize: int) -> int | None:
    """The largest Triton sequence block whose tiles fit in shared memory, None if none does."""
    return next((b for b in _TRITON_BLOCKS if _TRITON_TILES * b * Q * itemsize <= _GPU_SHARED_BYTES), None)


class KernelFallbackWarning(UserWarning):
    """The target's kernel could not take this call; the blockwise form ran instead."""


class Choice(NamedTuple):
    """Which implementation runs, and why (``reason`` is set when it is a fallback)."""
    implementation: str
    reason: str = ""


def attention_implementation(q_shape: tuple[int, ...], dtype, *, causal: bool,
                             window: int | None = None, platform: str | None = None) -> Choice:
    """The implementation ``attention(..., implementation="auto")`` runs for queries of
    ``q_shape`` (B, T, H, Q) in ``dtype`` on ``platform`` (default ``sk.target_platform()``),
    with the reason when it falls back to the blockwise form."""
    platform = target_platform() if platform is None else platform
    T, Q = q_shape[1], q_shape[3]
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if platform == "gpu":
        # cuDNN ships with jax's CUDA wheels but cannot be loaded without a GPU, and has no
        # f32 kernel: a real GPU in 16-bit gets it, a deviceless compile Triton's.
        if half and jax.default_backend() == "gpu":
            return Choice("cudnn")
        return _fits("triton", T, Q, window, jnp.dtype(dtype).itemsize)
    if platform == "tpu":
        return _fits("mosaic", T, Q, window, jnp.dtype(dtype).itemsize)
    return Choice("blockwise")


def _fits(kernel: str, T: int, Q: int, window: int | None, itemsize: int) -> Choice:
    if window is not None:
        return Choice("blockwise", f"the Pallas {kernel} kernel has no sliding window")
    if kernel == "triton" and not 16 <= Q <= 256:
        return Choice("blockwise", f"head_dim {Q} is outside the triton kernel's 16..256")
    block = _BLOCK
    if kernel == "triton":
        block = _triton_block(Q, itemsize)
        if block is None:
            need = _TRITON_TILES * _TRITON_BLOCKS[-1] * Q * itemsize
            return Choice("blockwise", f"head_dim {Q} at {itemsize} bytes per element needs {need:,} "
                                       f"bytes of shared memory in the triton kernel at its smallest "
                                       f"block, over the GPU's {_GPU_SHARED_BYTES:,}")
    if T % block:
        return Choice("blockwise", f"sequence {T} is not a multiple of the {kernel} kernel's "
                                   f"block of {block}")
    return Choice(kernel)


def _manual_axes() -> tuple[str, ...]:
    mesh = jax.sharding.get_abstract_mesh()
    return () if mesh.empty else tuple(
        a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, window: int | None = None,
              scale: float | None = None, implementation: str = "auto",
              spec: P | None = None, block: int = 512) -> jax.Array:
    """Softmax attention by the best kernel of the platform being compiled for.

    Args:
        q: queries (B, T, H, Q), as ``jax.nn.dot_product_attention``.
        k, v: keys and values (B, T, K, Q), H a multiple of K (grouped-query attention).
        causal: queries attend to keys at or before their position (required: a decoder that
            forgets it would silently see the future).
        window: sliding window: keys less than ``window`` positions away (behind only, when
            causal); None: all.
        scale: score scale; default 1/sqrt(Q).
        implementation: ``"auto"`` (``attention_implementation``), or one of ``"cudnn"``,
            ``"triton"``, ``"mosaic"``, ``"blockwise"``, ``"reference"`` (the plain (T, T)
            form) to force it.
        spec: how (B, T, H, Q) is split over the mesh, for the Pallas kernels' ``shard_map``
            (batch and head dims only; split the sequence with ``sk.context_attention``).
            Default: the active shardkit plan's logical axes ``("batch", None, "heads",
            None)``; outside a plan, unsplit.
        block: the blockwise form's key/value block.

    Returns:
        (B, T, H, Q) in q's dtype, named ``"attention_out"`` (``kept.py``; a flash kernel's
        log-sum-exp ``"attention_lse"``): ``sk.LEAN_RESIDUALS`` keeps it, and the kernel's
        backward reads that same value, never running its forward again. Name it no further.

    Raises:
        ValueError: mismatched shapes, an unknown implementation, a window < 1.
    """
    _check(q, k, v, window, implementation)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    choice = (attention_implementation(q.shape, q.dtype, causal=causal, window=window)
              if implementation == "auto" else Choice(implementation))
    if choice.reason:
        msg = (f"sk.attention: the blockwise form runs instead of the target's kernel: {choice.reason} "
               f"(q {tuple(q.shape)} {jnp.dtype(q.dtype).name}, platform {target_platform()})")
        warnings.warn(msg, KernelFallbackWarning, stacklevel=2)
    note("attention", {"implementation": choice.implementation, "fallback": choice.reason})
    impl = choice.implementation
    if impl == "reference":
        return kept_output(reference_attention(q, k, v, causal=causal, window=window, scale=scale))
    if impl == "blockwise":  # names its output and log-sum-exp itself
        return blockwise_attention(q, k, v, causal=causal, window=window, scale=scale, block=block)
    if impl == "cudnn":
        # jax's own custom VJP: its residuals carry no name, so under a names policy its
        # forward runs again in the backward (on a real GPU only; deviceless compiles take Triton).
        local = None if window is None else (window - 1, 0 if causal else window - 1)
        return kept_output(jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                                        local_window_size=local, implementation="cudnn"))
    if window is not None:
        raise ValueError(f"sk.attention: implementation={impl!r} has no sliding window; use "
                         "'auto' (falls back to the blockwise form) or 'blockwise'")
    # Per device (a shard_map over the batch and head axes, inside sk.pipeline's or DiLoCo's
    # manual region too), with the residuals a names policy keeps (manual_flash.py).
    from .manual_flash import flash_call

    return flash_call(impl, q, k, v, causal, scale, spec)


_INTERPRET = False  # tests: run the Triton kernel in Pallas's interpreter (on CPU)


def _rules(impl: str, q, causal: bool, scale: float, kv_len: int | None = None):
    """``(op, fixed, nones)`` of a Pallas flash kernel for queries ``q`` in its own layout
    ((B, T, H, Q) for Triton, (B, H, T, Q) for Mosaic) and keys of ``kv_len`` (default q's):
    ``op`` is its ``jax.custom_vjp`` (``op.fwd``/``op.bwd`` its rules), called as
    ``op(q, k, v, *nones, *fixed)`` — ``nones`` the optional differentiable inputs left out
    (segment ids, a bias), ``fixed`` its trailing non-differentiable arguments."""
    if impl == "triton":
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

        block = _triton_block(q.shape[-1], q.dtype.itemsize) or _TRITON_BLOCKS[-1]
        # Triton's fused backward walks the queries (dq) and the keys (dk, dv) in as many
        # blocks each: unequal lengths (a ring's half blocks) take a larger block on the longer.
        T = q.shape[1]
        S = T if kv_len is None else kv_len
        sizes = gpu_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=32,
                                         block_kv_dkv=32 * max(1, S // T), block_q_dq=32 * max(1, T // S),
                                         block_kv_dq=32)
        # sm_scale, causal, block_sizes, backward_pass_impl, num_warps, num_stages, grid,
        # interpret, debug, return_residuals
        return gpu_attention.mha, (scale, causal, sizes, "triton", None, 2, None, _INTERPRET, False, False), \
            (None,)
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

    (B, H, T, Q) = q.shape
    # flash_attention's own default blocks; save_residuals, causal, sm_scale, block_sizes, debug
    sizes = tpu_attention.BlockSizes.get_default(B, H, T, T, Q)
    return tpu_attention._flash_attention, (False, causal, scale, sizes, False), (None, None)


def _repeat_kv_heads(q, k, v):
    """K and V with their heads repeated to q's: neither Pallas kernel takes grouped-query
    heads."""
    H, K = q.shape[2], k.shape[2]
    return (k, v) if K == H else (jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2))


def _free_axes(mesh) -> tuple[str, ...]:
    """The mesh axes not already manual: those a kernel's ``shard_map`` makes manual."""
    return () if mesh.empty else tuple(a for a in mesh.axis_names if a not in _manual_axes())


def _spec(q, mesh, free) -> P:
    """The batch and head dims' mesh axes from the active plan's logical names (axes that
    are manual already, or do not divide the dim, left out)."""
    plan = active_plan()
    if plan is None:
        return P()
    sizes = dict(mesh.shape)
    entries = []
    try:
        logical = plan.logical_spec(("batch", None, "heads", None))
    except ShardingError as err:
        raise ShardingError(f"sk.attention runs its kernel per device over the batch and head axes, "
                            f"read from the plan's AxisRules: {err}. Map 'batch' and 'heads' there, "
                            "or pass spec=P(batch_axes, None, head_axes, None)") from None
    for d, e in enumerate(logical):
        axes = tuple(a for a in ((e,) if isinstance(e, str) else (e or ())) if a in free)
        n = math.prod(sizes[a] for a in axes)
        entries.append(None if not axes or q.shape[d] % n else axes if len(axes) > 1 else axes[0])
    return P(*entries)


def _check(q, k, v, window, implementation):
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"sk.attention: implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"sk.attention: q (B, T, H, Q) and k, v (B, S, K, Q) of one shape; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"sk.attention: q {tuple(q.shape)} and k {tuple(k.shape)} need the same batch "
                         "and head_dim, and query heads a multiple of kv heads")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sk.attention: window={window!r} must be a positive int (or None)")


FLASH_SCOPE = "sk_flash_attention"


def flash_scope(kernel: str, causal: bool) -> str:
    """The named scope a Pallas flash kernel call runs in: ``FLASH_SCOPE``, the kernel
    (``triton``: (B, T, H, Q) operands; ``mosaic``: (B, H, T, Q)), ``causal`` or ``full``.
    Every ``pallas_call`` of the call, forward and backward, carries it in the name stacks
    along its path in the jaxpr, so the program reader (``cost.program.flash``) counts their
    flops and buffers as flash attention's, whatever jax names its kernels."""
    return f"{FLASH_SCOPE}_{kernel}_{'causal' if causal else 'full'}"
