"""``sk.attention``'s Pallas flash kernels inside a ``shard_map`` that checks types: a stage of
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
same forward, the same backward from the same residuals, no recomputed forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .._vma import varying


def flash_in_manual_region(impl: str, q, k, v, causal: bool, scale: float, spec: P | None):
    """``sk.attention``'s ``impl`` kernel (``"triton"`` or ``"mosaic"``) on (B, T, H, Q) inputs
    inside a manual region (module docstring); ``spec`` as ``sk.attention``'s."""
    from .attention import _free_axes, _repeat_kv_heads, _rules, _spec, flash_scope

    k, v = _repeat_kv_heads(q, k, v)
    mesh = jax.sharding.get_abstract_mesh()
    free = _free_axes(mesh)
    axes = tuple(sorted(frozenset().union(*(jax.typeof(a).mat.varying for a in (q, k, v)))))
    spec = (_spec(q, mesh, free) if free else P()) if spec is None else spec
    entries = tuple(spec) + (None,) * (4 - len(spec))
    heads_first = impl == "mosaic"  # Mosaic's layout is (B, H, T, Q)
    op, fixed, nones = _rules(impl, q.transpose(0, 2, 1, 3) if heads_first else q, causal, scale)
    to_kernel = (lambda a: a.transpose(0, 2, 1, 3)) if heads_first else (lambda a: a)
    kspec = P(entries[0], entries[2], entries[1], entries[3]) if heads_first else P(*entries)
    stats = P(entries[0], entries[2], None)  # the log-sum-exp (and Mosaic's l, m): (B, H, T)
    scope = flash_scope(impl, causal)

    def region(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, axis_names=set(free), in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    qk, kk, vk = to_kernel(q), to_kernel(k), to_kernel(v)
    # The residuals' structure: each leaf's rank, traced inside the region (a pallas_call
    # cannot be traced where types are checked).
    ranks = jax.eval_shape(region(lambda a, b, c: jax.tree.map(
        lambda r: jnp.zeros((r.ndim,)), op.fwd(a, b, c, *nones, *fixed)[1]), (kspec,) * 3, P()), qk, kk, vk)
    res_specs = jax.tree.map(lambda r: kspec if r.shape == (4,) else stats, ranks)

    @jax.custom_vjp
    def call(a, b, c):
        with jax.named_scope(scope):
            out = region(lambda a, b, c: op(a, b, c, *nones, *fixed), (kspec,) * 3, kspec)(a, b, c)
        return varying(out, axes)

    def fwd(a, b, c):
        with jax.named_scope(scope):
            out, res = region(lambda a, b, c: op.fwd(a, b, c, *nones, *fixed), (kspec,) * 3,
                              (kspec, res_specs))(a, b, c)
        return varying(out, axes), res

    def bwd(res, g):
        with jax.named_scope(scope):
            grads = region(lambda res, g: tuple(op.bwd(*fixed, res, g)[:3]), (res_specs, kspec),
                           (kspec,) * 3)(res, g)
        return tuple(varying(d, axes) for d in grads)

    call.defvjp(fwd, bwd)
    return to_kernel(call(qk, kk, vk))

