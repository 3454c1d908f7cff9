"""GPipe and circular pipelines: the forward schedule is scanned, the backward is autodiff's.

One ``lax.scan`` over the rows of ``schedules.forward_table``; each device reads its own
column, runs its layer group and hands the activation on with ``lax.ppermute``. Circular with
``repeats=v`` loops the activation leaving the last stage back to stage 0 for the next group.
All forwards run before all backwards, so every microbatch's residuals stay alive (GPipe,
Huang et al. 2019).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from ..mesh import block_shard_map
from .schedules import forward_table
from .stage import put, row_spec, take, varying


def forward(chunk, params_s, x_mb, extras_mb, rng, *, mesh, axis, data, p, m, v):
    """GPipe / circular forward; returns y as (m, B/m, ...). Backward via autodiff."""
    tab = forward_table(p, m, v)
    shift = [(s, (s + 1) % p) for s in range(p)] if v > 1 else [(s, s + 1) for s in range(p - 1)]
    # Idle ticks compute too (on real activations; the result is discarded): a lax.cond here
    # would hide from the scan that the weights are loop-invariant, so autodiff would save a
    # copy of the stage's weights per tick. In lockstep SPMD the idle stage waits anyway.

    def body(params_l, x_mb, extras_mb, rng):
        stage = lax.axis_index(axis)
        # Data-varying here, once: its transpose is the one psum over data after the loop.
        params_l = varying(jax.tree.map(lambda a: a[0], params_l), data)  # (v, k, ...)
        x_mb, extras_mb = varying((x_mb, extras_mb), (axis, *data))
        zero_h = jnp.zeros_like(x_mb[0])
        rows = tuple(jnp.asarray(a) for a in (tab.item, tab.loop_slot, tab.out_slot))

        def tick(carry, row):
            recv_h, loop_buf, out_buf = carry
            item, loop_slot, out_slot = (r[stage] for r in row)
            it = jnp.maximum(item, 0)
            # A static rep for v == 1 keeps the weights loop-invariant: autodiff then saves
            # them once, not once per tick.
            mb, rep = it % m, (it // m if v > 1 else 0)
            if v > 1:  # stage 0 parks the activation coming back from the last stage
                loop_buf = put(loop_buf, recv_h, loop_slot)
                first_h = jnp.where(rep == 0, take(x_mb, mb), take(loop_buf, mb))
            else:
                first_h = take(x_mb, mb)
            h = jnp.where(stage == 0, first_h, recv_h)
            y = chunk(params_l, rep, h, rep * p + stage, mb, take(extras_mb, mb))
            out_buf = put(out_buf, y, out_slot)
            recv_h = lax.ppermute(y, axis, shift) if shift else y
            return (recv_h, loop_buf, out_buf), None

        bufs = jnp.zeros((m + 1,) + zero_h.shape, zero_h.dtype)
        loop_buf = bufs if v > 1 else jnp.zeros((), zero_h.dtype)
        init = varying((zero_h, loop_buf, bufs), (axis, *data))
        _, _, out_buf = lax.scan(tick, init, rows)[0]
        return out_buf[None, :m]

    spec, rows = P(axis), row_spec(data)
    out = block_shard_map(
        body, mesh=mesh, axis_names={axis, *data},
        in_specs=(jax.tree.map(lambda _: spec, params_s), rows, jax.tree.map(lambda _: rows, extras_mb),
                  None if rng is None else P()),
        out_specs=P(axis, None, data) if data else spec)(params_s, x_mb, extras_mb, rng)
    return out[p - 1]  # only the last stage's buffer holds the outputs
