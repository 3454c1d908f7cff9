"""The table-driven explicit-backward executor: 1F1B, interleaved 1F1B and ZB-H1.

One ``lax.scan`` over the rows of a ``schedules.Schedule``; per tick a device reads its own
column and runs one ``lax.switch`` branch — idle, F (forward; on the last layer group the
per-microbatch loss), BW (fused backward: 1F1B, interleaved 1F1B), or, split for zero bubble
(Qi et al., ICLR 2024), B (input gradient: ``jax.vjp`` of the stage w.r.t. its input only,
sent upstream at once) and W (weight gradient: ``jax.vjp`` w.r.t. the chunk's weights only,
from the saved stage input and the saved output cotangent, run later where the table put it).
Every backward op recomputes its chunk's forward from the saved input, so the per-microbatch
state is two rings (stage inputs, output cotangents) sized from the table, whatever ``m``.
After the op, two ``ppermute``s move activations down and cotangents up the pipe (rings
when a device holds several chunks: the last stage's chunk c feeds stage 0's chunk c+1,
Narayanan et al. 2021).

With data axes (``data``, manual like the pipe axis) a device holds its rows of every
microbatch; ``loss_fn`` is a mean over rows, so each local loss is seeded with
``1 / (m · n_data)`` and the local gradients, accumulated over the whole scan, are ``psum``'d
over data once after it (never per backward op).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from ..mesh import block_shard_map
from .forward import forward
from .schedules import BW, DOWN, EXPLICIT_SCOPE, IDLE, SELF, UP, B, F, W, Schedule, switch_branches
from .split import SplitBackward
from .stage import mean_loss, put, row_spec, take, varying


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _zeros_acc(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, _acc_dtype(a.dtype)), tree)


def _add(acc, d):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, d)


@dataclasses.dataclass(frozen=True)
class _Op:
    """One device's operation at one tick: what its ``lax.switch`` branches read (the chunk's
    weights, the saved stage input ``h``, the output cotangent ``g``) and how they add into the
    accumulators ``(d params, d loss_params, d x rows, loss total)``."""

    chunk: Callable
    loss_fn: Callable
    split: SplitBackward | None
    ring: bool  # several chunks per device: the weight accumulator is selected per chunk
    v: int
    seed: jax.Array  # the local loss's cotangent, 1 / (m · n_data)
    zero_h: jax.Array
    groups: jax.Array
    stage: jax.Array
    c: jax.Array
    mb: jax.Array
    dx: jax.Array  # the row of the input-gradient accumulator (m: discarded)
    w_at: jax.Array
    h: jax.Array
    g: jax.Array
    weights: object  # the chunk's weights as a (1, k, ...) stack
    loss_params: object
    extras_mb: object
    targets_mb: object

    def out(self, Wc, h):
        return self.chunk(Wc, 0, h, self.groups[self.stage, self.c], self.mb, take(self.extras_mb, self.mb))

    def loss(self, Wc, LP, h):
        return self.loss_fn(LP, self.out(Wc, h), take(self.targets_mb, self.mb)).astype(jnp.float32)

    def add_w(self, acc, d_w, d_l=None):
        gp, gl, gx, total = acc
        if d_w is None:
            pass
        elif self.ring:  # an elementwise select over the chunks: updated in place
            def upd(a, d):
                hit = (jnp.arange(self.v) == self.c).reshape((self.v,) + (1,) * (a.ndim - 1))
                return jnp.where(hit, a + d.astype(a.dtype), a)
            gp = jax.tree.map(upd, gp, d_w)
        else:
            gp = _add(gp, d_w)
        return gp, gl if d_l is None else _add(gl, d_l), gx, total

    def add_x(self, acc, d_h):  # only stage 0's first chunk owns dx (row m = discard)
        gp, gl, gx, total = acc
        return gp, gl, put(gx, d_h.astype(gx.dtype), self.dx), total

    def branch(self, op, on_loss):
        """The switch branch of ``op`` (on the loss's chunk or not): ``(acc, w_ring) -> (send
        down, send up, acc, the W ring slot to write back)``."""
        def branch_fn(acc, w_ring):
            if self.split is not None and op in (B, W):
                return self.split_op(op, on_loss, acc, w_ring)
            return (*self.run(op, on_loss, acc), None if w_ring is None else take(w_ring, self.w_at))
        return branch_fn

    def run(self, op, on_loss, acc):
        """Idle, F, or a backward op that recomputes the chunk's forward (B, W, fused BW)."""
        zero_h, weights, h = self.zero_h, self.weights, self.h
        if op == IDLE:
            return zero_h, zero_h, acc
        if op == F and not on_loss:
            return self.out(weights, h), zero_h, acc
        if op == F:
            gp, gl, gx, total = acc
            return zero_h, zero_h, (gp, gl, gx, total + self.loss(weights, self.loss_params, h))
        if op == B:  # input gradient only, sent upstream now
            if on_loss:
                d_h = jax.vjp(lambda h: self.loss(weights, self.loss_params, h), h)[1](self.seed)[0]
            else:
                d_h = jax.vjp(lambda h: self.out(weights, h), h)[1](self.g)[0]
            return zero_h, d_h, self.add_x(acc, d_h)
        if op == W:  # weight gradient, deferred into the bubble by the table
            if on_loss:
                d_w, d_l = jax.vjp(lambda Wc, LP: self.loss(Wc, LP, h), weights, self.loss_params)[1](self.seed)
                return zero_h, zero_h, self.add_w(acc, d_w, d_l)
            d_w = jax.vjp(lambda Wc: self.out(Wc, h), weights)[1](self.g)[0]
            return zero_h, zero_h, self.add_w(acc, d_w)
        if on_loss:  # BW: both at once (1F1B)
            d_w, d_l, d_h = jax.vjp(self.loss, weights, self.loss_params, h)[1](self.seed)
        else:
            (d_w, d_h), d_l = jax.vjp(self.out, weights, h)[1](self.g), None
        return zero_h, d_h, self.add_x(self.add_w(acc, d_w, d_l), d_h)

    def split_op(self, op, on_loss, acc, w_ring):
        """B: the chunk's forward once, its input gradient sent upstream now, what W needs kept
        in the W ring; W: the weight-gradient matmuls from it (``split``)."""
        split, zero_h, mb = self.split, self.zero_h, self.mb
        w_k = jax.tree.map(lambda a: a[0], self.weights)  # (k, ...)
        if op == W:
            slot = take(w_ring, self.w_at)
            d_w = split.weight_grad(w_k, slot)
            return zero_h, zero_h, self.add_w(acc, jax.tree.map(lambda a: a[None], d_w)), slot
        y, kept = split.forward(w_k, self.h, (self.groups[self.stage, self.c], mb, take(self.extras_mb, mb)))
        d_l = None
        if on_loss:  # the head's gradients here: they are the loss's, not the chunk's
            d_l, g_y = jax.vjp(lambda LP, y: self.loss_fn(LP, y, take(self.targets_mb, mb)).astype(jnp.float32),
                               self.loss_params, y)[1](self.seed)
        else:
            g_y = self.g
        d_h, saved = split.input_grad(w_k, kept, g_y.astype(y.dtype))
        acc = self.add_x(acc if d_l is None else self.add_w(acc, None, d_l), d_h)
        return zero_h, d_h, acc, saved


def _routes(p: int, around: bool):
    """The ``ppermute`` pairs (down, up) between the ``p`` stages: around a ring when the last
    stage's chunk c feeds stage 0's chunk c+1 (interleaved), else a line. ZB-V's two
    directions carry both kinds of message; its chunk 0 goes down, chunk 1 comes up."""
    if around:
        return [(s, (s + 1) % p) for s in range(p)], [(s, (s - 1) % p) for s in range(p)]
    return [(s, s + 1) for s in range(p - 1)], [(s + 1, s) for s in range(p - 1)]


def explicit_grads(tab: Schedule, chunk, loss_fn, params_s, loss_params, x_mb, extras_mb, targets_mb,
                   rng, *, mesh, axis, data, split: SplitBackward | None = None):
    """Runs ``tab``; returns (mean loss, (d params_s, d loss_params, d x_mb)). ``split``: the
    B/W ops of a table that has them (``split``)."""
    p, m, v = tab.stages, tab.microbatches, tab.repeats
    pairs, branch = switch_branches(tab)
    dx_row = np.where((np.arange(p)[None, :] == 0) & (tab.chunk == 0) & np.isin(tab.op, (B, BW)), tab.mb, m)
    vee = tab.name == "zb-v"
    # Several chunks per device (ZB-V: two): the weights are sliced per op.
    ring, (down, up) = v > 1 or vee, _routes(p, around=v > 1 and not vee)
    n_data = math.prod(mesh.shape[a] for a in data)
    everywhere = (axis, *data)

    def body(params_l, loss_params, x_mb, extras_mb, targets_mb, rng):
        stage = lax.axis_index(axis)
        # Varying before the switch: the transpose of an implicit invariant->varying cast is a
        # psum, which must not end up inside a branch only some stages take (nor, over data,
        # inside the loop at all: the data reduction is the one psum after the scan).
        params_l, loss_params, x_mb, extras_mb, targets_mb = varying(
            (jax.tree.map(lambda a: a[0], params_l), loss_params, x_mb, extras_mb, targets_mb),
            everywhere)  # params_l: (v, k, ...)
        zero_h = jnp.zeros_like(x_mb[0])
        seed = varying(jnp.float32(1.0 / (m * n_data)), everywhere)
        rows = tuple(jnp.asarray(a) for a in (branch, tab.mb, tab.chunk, tab.act_slot, tab.grad_slot,
                                              tab.recv_act, tab.recv_grad, dx_row, tab.w_slot, tab.send,
                                              tab.recv_act_up, tab.recv_grad_down, tab.recv_act_self,
                                              tab.recv_grad_self))
        groups = jnp.asarray(tab.group)
        ctx0 = (0, 0, take(extras_mb, 0))

        def tick(carry, row):
            (br, mb, c, a_slot, g_slot, r_act, r_grad, dx, w_at, to, r_act_up, r_grad_down, r_act_self,
             r_grad_self) = (r[stage] for r in row)
            (recv_h, recv_g, recv_self), act_ring, grad_ring, acc, w_ring = carry
            act_ring = put(act_ring, recv_h, r_act)
            grad_ring = put(grad_ring, recv_g, r_grad)
            if vee:  # recv_h came from below, recv_g from above: either kind in ZB-V
                act_ring = put(put(act_ring, recv_g, r_act_up), recv_self, r_act_self)
                grad_ring = put(put(grad_ring, recv_h, r_grad_down), recv_self, r_grad_self)
            h = jnp.where(a_slot < 0, take(x_mb, mb), take(act_ring, jnp.maximum(a_slot, 0)))
            g = take(grad_ring, g_slot)
            # The chunk's weights as a (1, k, ...) stack; one chunk: the operand itself (a slice
            # and re-stack of tensor-sharded weights would cost XLA a copy of the stage).
            c = c if ring else 0
            weights = (jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, c, 1, 0), params_l)
                       if ring else params_l)
            op = _Op(chunk, loss_fn, split, ring, v, seed, zero_h, groups, stage, c, mb, dx, w_at, h, g, weights,
                     loss_params, extras_mb, targets_mb)
            # The scope names the switch in the compiled HLO, so explain() can weight its
            # branches by the schedule table (``cost.hlo.pipeline_branch_weights``) and no other.
            with jax.named_scope(EXPLICIT_SCOPE):
                send_h, send_g, acc, saved = lax.switch(br, [op.branch(o, l) for o, l in pairs], acc, w_ring)
            if split is not None:
                # The ring is only read inside the switch and written here, in place: B's new
                # entry, or (every other op) the slot's own content back. Returned from the
                # branches whole, the ring was copied and, in ZB-V, held twice.
                w_ring = put(w_ring, saved, w_at)
            send_self = zero_h
            if vee:  # one message per op, routed by the table
                msg = send_h + send_g
                send_h, send_g, send_self = (jnp.where(to == d, msg, zero_h) for d in (DOWN, UP, SELF))
            if p > 1:
                send_h = lax.ppermute(send_h, axis, down)
                send_g = lax.ppermute(send_g, axis, up)
            return ((send_h, send_g, send_self), act_ring, grad_ring, acc, w_ring), None

        init = varying(_initial_carry(tab, split, params_l, loss_params, zero_h, ctx0), everywhere)
        *_, (gp, gl, gx, total), _ = lax.scan(tick, init, rows)[0]
        if data:  # the one reduction over data per step
            gp, gl, total = lax.psum((gp, gl, total), data)
        # Loss, loss_params grads and dx live on one stage each; psum broadcasts them.
        total, gl, gx = lax.psum((total / (m * n_data), gl, gx[:m]), axis)
        gp = jax.tree.map(lambda a: a[None], gp)
        return total, (gp, gl, gx)

    total, (gp, gl, gx) = _on_stages(body, mesh, axis, data, params_s, loss_params, x_mb, extras_mb, targets_mb, rng)
    cast = lambda d, a: d.astype(jnp.result_type(a))  # noqa: E731
    return total, (jax.tree.map(cast, gp, params_s), jax.tree.map(cast, gl, loss_params), gx.astype(x_mb.dtype))


def _initial_carry(tab: Schedule, split, params_l, loss_params, zero_h, ctx0):
    """The scan's carry before the first tick: the messages in flight, the rings of stage inputs
    and output cotangents, the accumulators (f32 where the values are narrower), and ZB's ring
    of pending W's (per pending W: its chunk's per-layer residuals and cotangents)."""
    acc = (_zeros_acc(params_l), _zeros_acc(loss_params),
           jnp.zeros((tab.microbatches + 1,) + zero_h.shape, _acc_dtype(zero_h.dtype)), jnp.zeros((), jnp.float32))
    w_ring = None
    if split is not None:
        w0 = jax.tree.map(lambda a: a[0], params_l)
        w_ring = jax.tree.map(lambda a: jnp.zeros((tab.w_ring,) + a.shape, a.dtype),
                              split.saved_shapes(w0, zero_h, ctx0))
    return ((zero_h, zero_h, zero_h), jnp.zeros((tab.act_ring + 1,) + zero_h.shape, zero_h.dtype),
            jnp.zeros((tab.grad_ring + 1,) + zero_h.shape, zero_h.dtype), acc, w_ring)


def _on_stages(body, mesh, axis, data, params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
    """``body`` under ``shard_map`` with ``axis`` and the data axes manual: a device gets its
    stage's weights and its rows of every microbatch; the loss and ``loss_params`` are whole."""
    spec, row = P(axis), row_spec(data)
    rep = lambda t: jax.tree.map(lambda _: P(), t)  # noqa: E731
    rows_of = lambda t: jax.tree.map(lambda _: row, t)  # noqa: E731
    return block_shard_map(
        body, mesh=mesh, axis_names={axis, *data},
        in_specs=(jax.tree.map(lambda _: spec, params_s), rep(loss_params), row, rows_of(extras_mb),
                  rows_of(targets_mb), None if rng is None else P()),
        out_specs=(P(), (jax.tree.map(lambda _: spec, params_s), rep(loss_params), row)),
    )(params_s, loss_params, x_mb, extras_mb, targets_mb, rng)


def _zero_cotangent(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def explicit_pipeline(tab: Schedule, chunk, params_s, loss_fn, loss_params, x_mb, extras_mb, targets_mb,
                      rng, *, mesh, axis, data, split: SplitBackward | None = None):
    """The mean loss as a ``jax.custom_vjp``: its forward runs the whole table (forwards, the
    per-microbatch loss, the backward ops) and keeps the gradients as residuals; its backward
    only scales them by the incoming cotangent. Without differentiation the primal runs the
    autodiff forward (GPipe / circular), which computes the same loss."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)),
                         (extras_mb, targets_mb, rng))
    p, m, v = tab.stages, tab.microbatches, tab.repeats

    def primal(params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
        y_mb = forward(chunk, params_s, x_mb, extras_mb, rng, mesh=mesh, axis=axis, data=data, p=p, m=m, v=v)
        return mean_loss(loss_fn, loss_params, y_mb, targets_mb)

    def fwd(params_s, loss_params, x_mb, extras_mb, targets_mb, rng):
        return explicit_grads(tab, chunk, loss_fn, params_s, loss_params, x_mb, extras_mb, targets_mb,
                              rng, mesh=mesh, axis=axis, data=data, split=split)

    def bwd(grads, g):
        scaled = jax.tree.map(lambda d: (d * g).astype(d.dtype), grads)
        return (*scaled, *jax.tree.map(_zero_cotangent, avals))

    run = jax.custom_vjp(primal)
    run.defvjp(fwd, bwd)
    return run(params_s, loss_params, x_mb, extras_mb, targets_mb, rng)
