"""Grouped matmul (``lax.ragged_dot``'s contract: rows ``(M, K)`` sorted into groups, one
``(K, N)`` weight per group) run by the best kernel of the target (``sk.target_platform()``):

- TPU (rows, K and N multiples of 128): Pallas Megablox (Gale et al. 2023),
  ``jax.experimental.pallas.ops.tpu.megablox.gmm``, whose backward is Megablox's too (``gmm``
  for the input gradient, ``tgmm`` for the weights').
- GPU (16-bit, K and N multiples of 128): the Pallas Mosaic GPU (Hopper) grouped GEMM,
  ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``, forward and input gradient; the weight
  gradient by ``transposed_ragged_dot_mgpu`` on a real GPU. That kernel sizes its grid by
  ``jax.devices()[0].core_count``, which in a deviceless compile is the CPU, so there the weight
  gradient is a masked product per group (``G · M · K · N · 2`` flops, one group's masked copy
  of the rows at a time).
- Otherwise (CPU, f32 on GPU, other widths, a mesh axis left to the compiler):
  ``lax.ragged_dot``. XLA:CPU and XLA:GPU expand it to a masked dense product over all ``G``
  groups (``G`` times the routed rows' flops, a ``(G, M, K)`` temporary); XLA:TPU lowers its
  forward and input gradient to Mosaic grouped matmuls but its weight gradient densely.

The Pallas kernels are per-device programs the SPMD partitioner cannot split, so they run only
where no mesh axis above size 1 is left to the compiler (inside ``sk.moe``'s shard_map without a
``tensor`` axis); otherwise ``lax.ragged_dot`` runs and the trace notes why.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax

from .._vma import vary_like
from ..plan import note
from ..xla import target_platform

_BLOCK = 128  # the kernels' block of K and N (block_m = block_n = 128, block_k = 64)
# While ``planning``: the mesh axes to take as left to the compiler, and the choices made.
_PLANNING = contextvars.ContextVar("grouped_planning", default=None)
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def grouped_matmul(lhs_MxK: jax.Array, rhs_GxKxN: jax.Array, group_sizes: jax.Array, *, precision=None,
                   preferred_element_type=None) -> jax.Array:
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` by the target's grouped-GEMM kernel (module
    docstring); rows past ``sum(group_sizes)`` are not to be read (zeros under
    ``lax.ragged_dot``, unwritten under the GPU kernel)."""
    kernel, _ = grouped_kernel(lhs_MxK, rhs_GxKxN, preferred_element_type)
    if kernel == "mosaic_gpu":
        return _mosaic_gpu(lhs_MxK, rhs_GxKxN, group_sizes)
    if kernel == "megablox":
        from jax.experimental.pallas.ops.tpu import megablox

        out_dtype = lhs_MxK.dtype if preferred_element_type is None else preferred_element_type
        return megablox.gmm(lhs_MxK, rhs_GxKxN, group_sizes, out_dtype, (_BLOCK, _BLOCK, _BLOCK))
    return lax.ragged_dot(lhs_MxK, rhs_GxKxN, group_sizes, precision=precision,
                          preferred_element_type=preferred_element_type)


def grouped_kernel(lhs, rhs, preferred_element_type=None) -> tuple[str, str]:
    """``(kernel, why)``: which implementation ``grouped_matmul`` runs for rows ``lhs`` and
    weights ``rhs`` on the target (``"mosaic_gpu"``, ``"megablox"`` or ``"ragged_dot"``) and, for
    ``ragged_dot`` on a GPU/TPU target, why the kernel could not take it (also noted in the
    trace)."""
    platform = target_platform()
    if platform not in ("gpu", "tpu"):
        return "ragged_dot", ""
    (M, _), (K, N) = lhs.shape, rhs.shape[1:]
    planning_ = _PLANNING.get()
    if planning_ is not None:
        free = list(planning_[0])
    else:
        mesh = jax.sharding.get_abstract_mesh()
        free = [] if mesh is None or mesh.empty else [
            a for a, t in zip(mesh.axis_names, mesh.axis_types)
            if t != jax.sharding.AxisType.Manual and mesh.shape[a] > 1]
    why = None
    if rhs.dtype != lhs.dtype:
        why = f"operands of two dtypes, {lhs.dtype} x {rhs.dtype}"
    elif platform == "gpu" and lhs.dtype not in _HALF:
        why = f"{lhs.dtype} operands (the Mosaic GPU kernel takes bf16 or f16)"
    elif platform == "gpu" and preferred_element_type not in (None, lhs.dtype):
        why = f"a {jnp.dtype(preferred_element_type)} result was asked for"
    elif platform == "tpu" and M % _BLOCK:
        why = f"{M} rows, not a multiple of the kernel's block {_BLOCK}"
    elif K % _BLOCK or N % _BLOCK:
        why = f"K={K}, N={N} not multiples of the kernel's block {_BLOCK}"
    elif free:
        why = f"mesh axes {free} are left to the compiler, which cannot split the kernel"
    choice = ("ragged_dot", why) if why else ("mosaic_gpu" if platform == "gpu" else "megablox", "")
    if planning_ is not None:
        planning_[1].append(choice)
    elif why:
        note("grouped_matmul", f"lax.ragged_dot on {platform}: {why}")
    return choice


@contextlib.contextmanager
def planning(free_axes):
    """Within it ``grouped_kernel`` takes ``free_axes`` as the mesh axes left to the compiler
    (for a caller tracing outside the ``shard_map`` the products will run in) and records each
    ``(kernel, why)`` it answers in the list this yields."""
    seen: list[tuple[str, str]] = []
    token = _PLANNING.set((tuple(free_axes), seen))
    try:
        yield seen
    finally:
        _PLANNING.reset(token)


def _real_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _kernels():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    blocks = dict(block_m=_BLOCK, block_n=_BLOCK, block_k=64, max_concurrent_steps=4, grid_block_n=1)
    return (functools.partial(ragged_dot_mgpu.ragged_dot, **blocks),
            functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, **blocks))


@jax.custom_vjp
def _mosaic_gpu(lhs_MxK, rhs_GxKxN, group_sizes):
    dot, _ = _kernels()
    return vary_like(dot(lhs_MxK, rhs_GxKxN, group_sizes=group_sizes), (lhs_MxK, rhs_GxKxN))


def _fwd(lhs_MxK, rhs_GxKxN, group_sizes):
    return _mosaic_gpu(lhs_MxK, rhs_GxKxN, group_sizes), (lhs_MxK, rhs_GxKxN, group_sizes)


def _bwd(res, dy_MxN):
    lhs_MxK, rhs_GxKxN, group_sizes = res
    dot, tdot = _kernels()
    dlhs_MxK = dot(dy_MxN, rhs_GxKxN, group_sizes=group_sizes, transpose_rhs=True)
    if _real_gpu():
        drhs_GxKxN = tdot(lhs_MxK, dy_MxN, group_sizes=group_sizes)
    else:  # deviceless: the kernel sizes its grid by jax.devices()[0].core_count, the CPU's here
        drhs_GxKxN = _weight_grad_by_group(lhs_MxK, dy_MxN, group_sizes)
    # A group no row reached may keep its kernel tiles unwritten: zero it.
    drhs_GxKxN = jnp.where((group_sizes > 0)[:, None, None], drhs_GxKxN, 0).astype(rhs_GxKxN.dtype)
    zeros = np.zeros(group_sizes.shape, jax.dtypes.float0)  # integer input: no cotangent
    return vary_like(dlhs_MxK, (lhs_MxK,)), vary_like(drhs_GxKxN, (rhs_GxKxN,)), zeros


_mosaic_gpu.defvjp(_fwd, _bwd)


def _weight_grad_by_group(x_MxK, dy_MxN, group_sizes):
    """Each group's ``x_g^T dy_g`` as a masked product over all rows, one group at a time: the
    flops of XLA's dense expansion of ``lax.ragged_dot_general`` (``G · M · K · N · 2``) without
    its ``(G, M, K)`` temporary."""
    ends = jnp.cumsum(group_sizes)
    rows_M = jnp.arange(x_MxK.shape[0])

    def one(bounds):
        start, end = bounds
        mine_Mx1 = ((rows_M >= start) & (rows_M < end))[:, None]
        # Both masked: rows past the groups hold whatever the kernel left there.
        return jnp.einsum("mk,mn->kn", jnp.where(mine_Mx1, x_MxK, 0), jnp.where(mine_Mx1, dy_MxN, 0),
                          preferred_element_type=jnp.float32)

    return lax.map(one, (ends - group_sizes, ends))
