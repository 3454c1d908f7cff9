"""The 1F1B schedule's forward-and-backward pass (the custom_vjp forward of ``pipeline``).

One ``lax.scan`` over the rows of ``one_f_one_b_table``; per tick a device runs one of five
branches with ``lax.switch`` (idle, forward, backward, and the last stage's forward+loss and
backward-through-loss), then two ppermutes move activations down and cotangents up the pipe.
A backward recomputes its stage from the saved input (``jax.vjp``), so the only per-microbatch
state is a ring of ``act_ring`` (<= p) stage inputs: memory does not grow with ``m``.

With data axes (``data``, manual like the pipe axis) a device holds its rows of every
microbatch; ``loss_fn`` is a mean over rows, so each local loss is seeded with
``1 / (m · n_data)`` and the local gradients, accumulated over the whole scan, are ``psum``'d
over data once after it (never per backward op).
"""

from __future__ import annotations

import math

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from . import schedules as sched
from .forward import forward
from .schedules import ONE_F_ONE_B_SCOPE
from .stage import mean_loss, put, row_spec, take, varying


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _zeros_acc(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), tree)


def _add(acc, d):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, d)


def one_f_one_b_grads(chunk, loss_fn, params_s, loss_params, x_mb, extras_mb, targets_mb, rng, *,
                      mesh, axis, data, p, m):
    """Returns (mean loss, (d params_s, d loss_params, d x_mb)) for a 1F1B pipeline."""
    tab = sched.one_f_one_b_table(p, m)
    down = [(s, s + 1) for s in range(p - 1)]
    up = [(s + 1, s) for s in range(p - 1)]
    n_data = math.prod(mesh.shape[a] for a in data)
    everywhere = (axis, *data)

    def body(params_l, loss_params, x_mb, extras_mb, targets_mb, rng):
        stage = lax.axis_index(axis)
        # Varying before the switch: the transpose of an implicit invariant->varying cast is a
        # psum, which must not end up inside a branch only some stages take (nor, over data,
        # inside the loop at all: the data reduction is the one psum after the scan).
        params_l, loss_params, x_mb, extras_mb, targets_mb = varying(
            (jax.tree.map(lambda a: a[0], params_l), loss_params, x_mb, extras_mb, targets_mb),
            everywhere)  # params_l: (v=1, k, ...)
        zero_h = jnp.zeros_like(x_mb[0])
        rows = tuple(jnp.asarray(a) for a in (tab.op, tab.mb, tab.act_slot, tab.grad_slot,
                                              tab.recv_act, tab.recv_grad))

        def stage_out(P_, h, mb):
            return chunk(P_, 0, h, stage, mb, take(extras_mb, mb))

        def stage_loss(P_, LP, h, mb):
            return loss_fn(LP, stage_out(P_, h, mb), take(targets_mb, mb)).astype(jnp.float32)

        def tick(carry, row):
            op, mb, a_slot, g_slot, r_act, r_grad = (r[stage] for r in row)
            recv_h, recv_g, act_ring, grad_ring, acc = carry
            act_ring = put(act_ring, recv_h, r_act)
            grad_ring = put(grad_ring, recv_g, r_grad)
            h = jnp.where(stage == 0, take(x_mb, mb), take(act_ring, a_slot))
            g = take(grad_ring, g_slot)

            def idle(acc):
                return zero_h, zero_h, acc

            def fwd(acc):
                return stage_out(params_l, h, mb), zero_h, acc

            def bwd(acc):
                _, vjp = jax.vjp(lambda P_, h: stage_out(P_, h, mb), params_l, h)
                d_p, d_h = vjp(g)
                return zero_h, d_h, _grads(acc, d_p, None, d_h)

            def fwd_last(acc):
                gp, gl, gx, loss = acc
                return zero_h, zero_h, (gp, gl, gx, loss + stage_loss(params_l, loss_params, h, mb))

            def bwd_last(acc):
                _, vjp = jax.vjp(lambda P_, LP, h: stage_loss(P_, LP, h, mb), params_l, loss_params, h)
                d_p, d_l, d_h = vjp(varying(jnp.float32(1.0 / (m * n_data)), everywhere))
                return zero_h, d_h, _grads(acc, d_p, d_l, d_h)

            def _grads(acc, d_p, d_l, d_h):
                gp, gl, gx, loss = acc
                gl = gl if d_l is None else _add(gl, d_l)
                gx = put(gx, d_h, jnp.where(stage == 0, mb, m))  # only stage 0 owns dx
                return _add(gp, d_p), gl, gx, loss

            # The scope names the switch in the compiled HLO, so explain() can weight its
            # branches by the schedule table (``cost.hlo.pipeline_branch_weights``) and no other.
            with jax.named_scope(ONE_F_ONE_B_SCOPE):
                send_h, send_g, acc = lax.switch(op, [idle, fwd, bwd, fwd_last, bwd_last], acc)
            if p > 1:
                send_h = lax.ppermute(send_h, axis, down)
                send_g = lax.ppermute(send_g, axis, up)
            return (send_h, send_g, act_ring, grad_ring, acc), None

        acc = (_zeros_acc(params_l), _zeros_acc(loss_params),
               jnp.zeros((m + 1,) + zero_h.shape, _acc_dtype(zero_h.dtype)), jnp.zeros((), jnp.float32))
        init = varying((zero_h, zero_h, jnp.zeros((tab.act_ring + 1,) + zero_h.shape, zero_h.dtype),
                         jnp.zeros((tab.grad_ring + 1,) + zero_h.shape, zero_h.dtype), acc), everywhere)
        *_, (gp, gl, gx, loss) = lax.scan(tick, init, rows)[0]
        if data:  # the one reduction over data per step
            gp, gl, loss = lax.psum((gp, gl, loss), data)
        # Loss, loss_params grads and dx live on one stage each; psum broadcasts them.
        loss, gl, gx = lax.psum((loss / (m * n_data), gl, gx[:m]), axis)
        gp = jax.tree.map(lambda a: a[None], gp)
        return loss, (gp, gl, gx)

    spec, row = P(axis), row_spec(data)
    rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
    rows_of = lambda t: jax.tree.map(lambda _: row, t)  # noqa: E731
    loss, (gp, gl, gx) = jax.shard_map(
        body, mesh=mesh, axis_names={axis, *data},
        in_specs=(jax.tree.map(lambda _: spec, params_s), rep(loss_params), row, rows_of(extras_mb),
                  rows_of(targets_mb), None if rng is None else P()),
        out_specs=(P(), (jax.tree.map(lambda _: spec, params_s), rep(loss_params), row)),
    )(params_s, loss_params, x_mb, extras_mb, targets_mb, rng)
    cast = lambda d, a: d.astype(jnp.result_type(a))  # noqa: E731
    return loss, (jax.tree.map(cast, gp, params_s), jax.tree.map(cast, gl, loss_params), gx.astype(x_mb.dtype))


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def one_f_one_b(chunk, params_s, loss_fn, loss_params, x_mb, extras_mb, targets_mb, rng, *,
                 mesh, axis, data, p, m):
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                         (extras_mb, targets_mb, rng))

    def primal(params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
        y_mb = forward(chunk, params_s, x_mb, extras_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m, v=1)
        return mean_loss(loss_fn, loss_params, y_mb, targets_mb)

    def fwd(params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
        loss, grads = one_f_one_b_grads(chunk, loss_fn, params_s, loss_params, x_mb, extras_mb,
                                        targets_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m)
        return loss, grads

    def bwd(grads, g):
        scaled = jax.tree.map(lambda d: (d * g).astype(d.dtype), grads)
        return (*scaled, *jax.tree.map(_zero_cotangent, avals))

    run = jax.custom_vjp(primal)
    run.defvjp(fwd, bwd)
    return run(params_s, loss_params, x_mb, extras_mb, targets_mb, rng)
