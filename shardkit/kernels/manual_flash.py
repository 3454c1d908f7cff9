"""``sk.attention``'s Pallas flash kernels per device: under a plain ``jit`` (a ``shard_map``
over the batch and head axes) and inside a ``shard_map`` that checks types: a stage of
``sk.pipeline`` (manual over ``pipe``), a DiLoCo replica (manual over ``replica``).

Such a ``shard_map`` types every value by the manual axes it varies over, and a custom VJP must
hand back gradients of its inputs' types. Two things stand in the way of running a Pallas
kernel there (jax 0.10.2): a ``pallas_call`` can only be traced in a region that does not
check types (its outputs carry none), and both kernels' backward rules return gradients typed
as varying over no axis. So the kernel runs in a nested ``shard_map`` that does not check
types, manual over the axes still left to the compiler (as outside a manual region), and one
custom VJP around that region calls the kernel's own forward and backward rules (``op.fwd``,
``op.bwd`` of its ``jax.custom_vjp``) there, its residuals split like the queries (the
log-sum-exp's (B, H, T) like their batch and heads), and types the output and the gradients
as varying over the axes the inputs vary over. The kernels themselves run unchanged: the
same forward, the same backward from the same residuals, no recomputed forward. The custom
VJP keeps the output it returns and the kernel's row statistics under the names
``sk.LEAN_RESIDUALS`` saves (``kept.py``), so a names policy keeps them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._vma import varying
from .kept import kept_output, kept_stats


@dataclasses.dataclass(frozen=True)
class KernelRegion:
    """A Pallas flash kernel's rules and the nested unchecked region they run in.

    Attributes:
        op: the kernel's ``jax.custom_vjp`` (``op.fwd``, ``op.bwd`` its rules), called as
            ``op(q, k, v, *nones, *fixed)`` in its own layout.
        fixed: its trailing non-differentiable arguments.
        nones: the optional differentiable inputs left out (segment ids, a bias).
        heads_first: its layout is (B, H, T, Q) (Mosaic), else (B, T, H, Q) (Triton).
        kspec: how its (B, ., ., Q) operands are split over the region's axes.
        stats: how its (B, H, T) row statistics (log-sum-exp; Mosaic's l and m) are split.
        mesh: the ambient (abstract) mesh.
        free: the mesh axes the region makes manual (those still left to the compiler).
    """
    op: Callable
    fixed: tuple
    nones: tuple
    heads_first: bool
    kspec: P
    stats: P
    mesh: object
    free: tuple

    def to_kernel(self, a):
        """(B, T, H, Q) to the kernel's layout, and back (the transpose is its own inverse)."""
        return a.transpose(0, 2, 1, 3) if self.heads_first else a

    def __call__(self, fn, in_specs, out_specs):
        if self.mesh.empty:  # no mesh: a one-device program
            return fn
        return jax.shard_map(fn, mesh=self.mesh, axis_names=set(self.free), in_specs=in_specs,
                             out_specs=out_specs, check_vma=False)


def kernel_region(impl: str, q, causal: bool, scale: float, spec: P | None,
                  kv_len: int | None = None) -> KernelRegion:
    """The ``impl`` kernel (``"triton"`` or ``"mosaic"``) for (B, T, H, Q) queries ``q`` (and
    keys of ``kv_len``, default T) in a region manual over the axes not yet manual; ``spec``
    as ``sk.attention``'s (default: the plan's batch and head axes)."""
    from .attention import _free_axes, _rules, _spec

    mesh = jax.sharding.get_abstract_mesh()
    free = _free_axes(mesh)
    spec = (_spec(q, mesh, free) if free else P()) if spec is None else spec
    entries = tuple(spec) + (None,) * (4 - len(spec))
    heads_first = impl == "mosaic"
    extra = {} if kv_len is None or kv_len == q.shape[1] else {"kv_len": kv_len}
    op, fixed, nones = _rules(impl, q.transpose(0, 2, 1, 3) if heads_first else q, causal, scale, **extra)
    kspec = P(entries[0], entries[2], entries[1], entries[3]) if heads_first else P(*entries)
    return KernelRegion(op, fixed, nones, heads_first, kspec, P(entries[0], entries[2], None), mesh, free)


def varying_axes(*arrays) -> tuple[str, ...]:
    """The manual axes any of ``arrays`` varies over: those a region's outputs are typed with."""
    return tuple(sorted(frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))))


# Where a kernel's residual tuple holds its output; q, k, v come first, the rest are its row
# statistics (Triton's base-2 log-sum-exp; Mosaic's l and m) or optional inputs left out (None).
_OUTPUT_AT = {"triton": 4, "mosaic": 5}


def flash_call(impl: str, q, k, v, causal: bool, scale: float, spec: P | None):
    """``sk.attention``'s ``impl`` kernel (``"triton"`` or ``"mosaic"``) on (B, T, H, Q) inputs,
    per device (module docstring; outside a manual region too, typed as varying over no
    axis); ``spec`` as ``sk.attention``'s. Its custom VJP keeps q, k and v as given (the
    caller's, so a policy that saves them saves those), the output it returns, named
    ``attention_out``, and the kernel's row statistics, named ``attention_lse``
    (``kept.py``): a names policy saves what the kernel's backward reads, so the backward
    never runs the kernel's forward again."""
    from .attention import _repeat_kv_heads, flash_scope

    k, v = _repeat_kv_heads(q, k, v)
    axes = varying_axes(q, k, v)
    r = kernel_region(impl, q, causal, scale, spec)
    op, fixed, nones, kspec = r.op, r.fixed, r.nones, r.kspec
    scope, at = flash_scope(impl, causal), _OUTPUT_AT[impl]
    qk, kk, vk = r.to_kernel(q), r.to_kernel(k), r.to_kernel(v)

    def stats_of(res):  # the residuals that are neither the inputs nor the output
        return tuple(res[3:at]) + tuple(res[at + 1:])

    # The statistics' structure: each leaf's rank, traced inside the region (a pallas_call
    # cannot be traced where types are checked).
    ranks = jax.eval_shape(r(lambda a, b, c: jax.tree.map(
        lambda x: jnp.zeros((x.ndim,)), stats_of(op.fwd(a, b, c, *nones, *fixed)[1])), (kspec,) * 3, P()), qk, kk, vk)
    stats_specs = jax.tree.map(lambda x: kspec if x.shape == (4,) else r.stats, ranks)

    @jax.custom_vjp
    def call(a, b, c):
        with jax.named_scope(scope):
            out = r(lambda a, b, c: op(a, b, c, *nones, *fixed), (kspec,) * 3, kspec)(a, b, c)
        return kept_output(varying(out, axes))

    def fwd(a, b, c):
        with jax.named_scope(scope):
            out, stats = r(lambda a, b, c: (lambda o, res: (o, stats_of(res)))(*op.fwd(a, b, c, *nones, *fixed)),
                           (kspec,) * 3, (kspec, stats_specs))(a, b, c)
        out = kept_output(varying(out, axes))
        return out, (a, b, c, out, kept_stats(stats))

    def bwd(res, g):
        a, b, c, out, stats = res
        n = at - 3

        def grads(a, b, c, out, stats, g):  # the kernel's residual tuple again, in its order
            return tuple(op.bwd(*fixed, (a, b, c) + stats[:n] + (out,) + stats[n:], g)[:3])

        with jax.named_scope(scope):
            grads = r(grads, (kspec,) * 4 + (stats_specs, kspec), (kspec,) * 3)(a, b, c, out, stats, g)
        return tuple(varying(d, axes) for d in grads)

    call.defvjp(fwd, bwd)
    return r.to_kernel(call(qk, kk, vk))
