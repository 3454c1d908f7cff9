"""The table-driven explicit-backward executor: 1F1B, interleaved 1F1B and ZB-H1.

One ``lax.scan`` over the rows of a ``schedules.Schedule``; per tick a device reads its own
column and runs one ``lax.switch`` branch — idle, F (forward; on the last layer group the
per-microbatch loss), BW (fused backward: 1F1B, interleaved 1F1B), or, split for zero bubble
(Qi et al., ICLR 2024), B (input gradient: ``jax.vjp`` of the stage w.r.t. its input only,
sent upstream at once) and W (weight gradient: ``jax.vjp`` w.r.t. the chunk's weights only,
from the saved stage input and the saved output cotangent, run later where the table put it).
With ``keep="input"`` every backward op recomputes its chunk's forward from the saved input,
so the per-microbatch state is two rings (stage inputs, output cotangents) sized from the
table, whatever ``m``; with residuals kept (``keep``) F also leaves its chunk's (and the
loss's) ``jax.vjp`` residuals in rings the B/BW reads instead of recomputing.
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

from .._branches import branching_over
from ..mesh import block_shard_map
from .forward import forward
from .schedules import BW, DOWN, EXPLICIT_SCOPE, IDLE, SELF, UP, B, F, W, Schedule, switch_branches
from .keep import Kept
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
    weights, the saved stage input ``h``, the output cotangent ``g``) and what they hand back
    to add into the accumulators: the op's *delta* ``(d chunk weights, d loss_params, loss)``,
    zeros where the op makes none (the input gradient is the cotangent it sends up)."""

    chunk: Callable
    loss_fn: Callable
    split: SplitBackward | None
    seed: jax.Array  # the local loss's cotangent, 1 / (m · n_data)
    zero_h: jax.Array
    groups: jax.Array
    stage: jax.Array
    c: jax.Array
    mb: jax.Array
    w_at: jax.Array
    h: jax.Array
    g: jax.Array
    weights: object  # the chunk's weights as a (1, k, ...) stack
    loss_params: object
    extras_mb: object
    targets_mb: object
    keep: Kept | None  # what F keeps for the backward op (``keep``); None: the stage input only
    res_at: jax.Array  # the op's slot in the kept-residual rings (chunk, loss)
    loss_at: jax.Array
    axes: tuple  # the manual axes (pipe, data): what the rings vary over

    def out(self, Wc, h):
        return self.chunk(Wc, 0, h, self.groups[self.stage, self.c], self.mb, take(self.extras_mb, self.mb))

    def loss(self, Wc, LP, h):
        return self.loss_fn(LP, self.out(Wc, h), take(self.targets_mb, self.mb)).astype(jnp.float32)

    def delta(self, d_w=None, d_l=None, loss=None):
        """The op's contribution, typed alike in every branch: the weight and loss-params
        gradients in their own (compute) dtype, the loss in f32. (The f32 accumulators are
        added to after the switch: handed through a branch whole, XLA held each twice — the
        switch's operand and its result.)"""
        zeros = lambda t: jax.tree.map(lambda a: jnp.zeros(jnp.shape(a), jnp.result_type(a)), t)  # noqa: E731
        cast = lambda d, a: jax.tree.map(lambda d, a: d.astype(jnp.result_type(a)), d, a)  # noqa: E731
        d_w = zeros(self.weights) if d_w is None else cast(d_w, self.weights)
        d_l = zeros(self.loss_params) if d_l is None else cast(d_l, self.loss_params)
        return varying((d_w, d_l, jnp.float32(0) if loss is None else loss), self.axes)

    def branch(self, op, on_loss):
        """The switch branch of ``op`` (on the loss's chunk or not): ``rings -> (send down,
        send up, the op's delta, the op's slot of each ring to write back)``; the rings are
        ZB's pending W's and the kept residuals (chunk, loss), each None where unused."""
        def branch_fn(rings):
            own = [None if r is None else take(r, at) for r, at in zip(rings, (self.w_at, self.res_at, self.loss_at))]
            if self.keep is not None and op in (F, B, BW):
                return self.kept_op(op, on_loss, own)
            if self.split is not None and op in (B, W):
                send_h, send_g, delta, own[0] = self.split_op(op, on_loss, own[0])
                return send_h, send_g, delta, tuple(own)
            return (*self.run(op, on_loss), tuple(own))
        return branch_fn

    def kept_op(self, op, on_loss, own):
        """F keeping its residuals (``keep``), or the B/BW that reads them: no recompute of
        the forward beyond what the keep policy left out."""
        keep, zero_h, weights, h = self.keep, self.zero_h, self.weights, self.h
        w_slot, res, loss_res = own
        if op == F:
            if self.split is not None:
                y, res = self.split.forward(jax.tree.map(lambda a: a[0], weights), h, self.ctx())
            else:
                y, res = keep.chunk.vjp(self.out, (weights, h), reuse=(weights, h))
            res = varying(res, self.axes)
            if not on_loss:
                return y, zero_h, self.delta(), (w_slot, res, loss_res)
            l, loss_res = keep.loss.vjp(self.loss_of_y(keep.loss_fn), (self.loss_params, y),
                                        reuse=(self.loss_params,))
            return zero_h, zero_h, self.delta(loss=l), (w_slot, res, varying(loss_res, self.axes))
        d_l, g_y = None, self.g
        if on_loss:
            d_l, g_y = keep.loss.pullback(loss_res, (self.loss_params,))(self.seed)
        g_y = g_y.astype(zero_h.dtype)
        if op == B:  # ZB's input gradient from the kept linearizations; W's share into its ring
            w_k = jax.tree.map(lambda a: a[0], weights)
            d_h, w_slot = self.split.input_grad(w_k, res, g_y)
            # What W reads is typed as the ring (varying over the manual axes) even where B
            # makes it from constants alone (a policy's recompute of a value from the layer's
            # tables, a zero cotangent): the switch's branches must agree on the slot's type.
            w_slot = varying(w_slot, self.axes)
            return zero_h, d_h, self.delta(d_l=d_l), (w_slot, res, loss_res)
        d_w, d_h = keep.chunk.pullback(res, (weights, h))(g_y)
        return zero_h, d_h, self.delta(d_w, d_l), tuple(own)

    def ctx(self):
        return self.groups[self.stage, self.c], self.mb, take(self.extras_mb, self.mb)

    def loss_of_y(self, loss_fn):
        targets = take(self.targets_mb, self.mb)
        return lambda LP, y: loss_fn(LP, y, targets).astype(jnp.float32)

    def run(self, op, on_loss):
        """Idle, F, or a backward op that recomputes the chunk's forward (B, W, fused BW)."""
        zero_h, weights, h = self.zero_h, self.weights, self.h
        if op == IDLE:
            return zero_h, zero_h, self.delta()
        if op == F and not on_loss:
            return self.out(weights, h), zero_h, self.delta()
        if op == F:
            return zero_h, zero_h, self.delta(loss=self.loss(weights, self.loss_params, h))
        if op == B:  # input gradient only, sent upstream now
            if on_loss:
                d_h = jax.vjp(lambda h: self.loss(weights, self.loss_params, h), h)[1](self.seed)[0]
            else:
                d_h = jax.vjp(lambda h: self.out(weights, h), h)[1](self.g)[0]
            return zero_h, d_h, self.delta()
        if op == W:  # weight gradient, deferred into the bubble by the table
            if on_loss:
                d_w, d_l = jax.vjp(lambda Wc, LP: self.loss(Wc, LP, h), weights, self.loss_params)[1](self.seed)
                return zero_h, zero_h, self.delta(d_w, d_l)
            d_w = jax.vjp(lambda Wc: self.out(Wc, h), weights)[1](self.g)[0]
            return zero_h, zero_h, self.delta(d_w)
        if on_loss:  # BW: both at once (1F1B)
            d_w, d_l, d_h = jax.vjp(self.loss, weights, self.loss_params, h)[1](self.seed)
        else:
            (d_w, d_h), d_l = jax.vjp(self.out, weights, h)[1](self.g), None
        return zero_h, d_h, self.delta(d_w, d_l)

    def split_op(self, op, on_loss, slot):
        """B: the chunk's forward once, its input gradient sent upstream now, what W needs kept
        in the W ring; W: the weight-gradient matmuls from it (``split``). ``slot``: the op's
        W ring slot."""
        split, zero_h = self.split, self.zero_h
        w_k = jax.tree.map(lambda a: a[0], self.weights)  # (k, ...)
        if op == W:
            d_w = split.weight_grad(w_k, slot)
            return zero_h, zero_h, self.delta(jax.tree.map(lambda a: a[None], d_w)), slot
        y, kept = split.forward(w_k, self.h, self.ctx())
        d_l = None
        if on_loss:  # the head's gradients here: they are the loss's, not the chunk's
            d_l, g_y = jax.vjp(self.loss_of_y(self.loss_fn), self.loss_params, y)[1](self.seed)
        else:
            g_y = self.g
        d_h, saved = split.input_grad(w_k, kept, g_y.astype(y.dtype))
        return zero_h, d_h, self.delta(d_l=d_l), saved


def _accumulate(acc, delta, d_h, c, dx, ring):
    """``acc`` with the op's ``delta`` and input gradient ``d_h`` added, in place: the weight
    gradient into its chunk's row (``ring``: several chunks per device), ``d_h`` into
    microbatch row ``dx`` (row m, discarded, except on stage 0's first chunk's B/BW)."""
    gp, gl, gx, total = acc
    d_w, d_l, loss = delta
    if ring:
        gp = jax.tree.map(lambda a, d: lax.dynamic_update_slice_in_dim(
            a, lax.dynamic_slice_in_dim(a, c, 1, 0) + d.astype(a.dtype), c, 0), gp, d_w)
    else:
        gp = _add(gp, d_w)
    return gp, _add(gl, d_l), put(gx, d_h.astype(gx.dtype), dx), total + loss


def _routes(p: int, around: bool):
    """The ``ppermute`` pairs (down, up) between the ``p`` stages: around a ring when the last
    stage's chunk c feeds stage 0's chunk c+1 (interleaved), else a line. ZB-V's two
    directions carry both kinds of message; its chunk 0 goes down, chunk 1 comes up."""
    if around:
        return [(s, (s + 1) % p) for s in range(p)], [(s, (s - 1) % p) for s in range(p)]
    return [(s, s + 1) for s in range(p - 1)], [(s + 1, s) for s in range(p - 1)]


def explicit_grads(tab: Schedule, chunk, loss_fn, params_s, loss_params, x_mb, extras_mb, targets_mb,
                   rng, *, mesh, axis, data, split: SplitBackward | None = None, keep: Kept | None = None):
    """Runs ``tab``; returns (mean loss, (d params_s, d loss_params, d x_mb)). ``split``: the
    B/W ops of a table that has them (``split``); ``keep``: F keeps its residuals (``keep``)
    — ``chunk`` (or ``split``'s layer) then runs under the keep policy."""
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
                                              tab.recv_grad_self, tab.res_slot, tab.loss_res_slot))
        groups = jnp.asarray(tab.group)
        ctx0 = (0, 0, take(extras_mb, 0))

        def tick(carry, row):
            (br, mb, c, a_slot, g_slot, r_act, r_grad, dx, w_at, to, r_act_up, r_grad_down, r_act_self,
             r_grad_self, res_at, loss_at) = (r[stage] for r in row)
            (recv_h, recv_g, recv_self), act_ring, grad_ring, acc, rings = carry
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
            op = _Op(chunk, loss_fn, split, seed, zero_h, groups, stage, c, mb, w_at, h, g, weights,
                     loss_params, extras_mb, targets_mb, keep, res_at, loss_at, everywhere)
            # The scope names the switch in the compiled HLO, so explain() can weight its
            # branches by the schedule table (``cost.pipeline_note.pipeline_branch_weights``) and no other.
            # The branch is the stage's: a permute traced in it stays in the stage (``_branches``).
            with jax.named_scope(EXPLICIT_SCOPE), branching_over(axis, p):
                send_h, send_g, delta, slots = lax.switch(br, [op.branch(o, l) for o, l in pairs], rings)
            acc = _accumulate(acc, delta, send_g, c, dx, ring)
            # The rings are only read inside the switch and written here, in place: the op's
            # new entry (B: W's share; F: the kept residuals), or (every other op) the slot's
            # own content back. Returned from the branches whole, a ring was copied and, in
            # ZB-V, held twice.
            rings = tuple(None if r is None else put(r, new, at)
                          for r, new, at in zip(rings, slots, (w_at, res_at, loss_at)))
            send_self = zero_h
            if vee:  # one message per op, routed by the table
                msg = send_h + send_g
                send_h, send_g, send_self = (jnp.where(to == d, msg, zero_h) for d in (DOWN, UP, SELF))
            if p > 1:
                send_h = lax.ppermute(send_h, axis, down)
                send_g = lax.ppermute(send_g, axis, up)
            return ((send_h, send_g, send_self), act_ring, grad_ring, acc, rings), None

        init = varying(_initial_carry(tab, chunk, split, keep, params_l, loss_params, zero_h, ctx0,
                                      take(targets_mb, 0)), everywhere)
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


def _initial_carry(tab: Schedule, chunk, split, keep, params_l, loss_params, zero_h, ctx0, targets0):
    """The scan's carry before the first tick: the messages in flight, the rings of stage inputs
    and output cotangents, the accumulators (f32 where the values are narrower), ZB's ring of
    pending W's (per pending W: its chunk's per-layer residuals and cotangents) and, with
    ``keep``, the rings of kept residuals (chunk, loss)."""
    acc = (_zeros_acc(params_l), _zeros_acc(loss_params),
           jnp.zeros((tab.microbatches + 1,) + zero_h.shape, _acc_dtype(zero_h.dtype)), jnp.zeros((), jnp.float32))
    ring = lambda n, shapes: jax.tree.map(lambda a: jnp.zeros((n,) + a.shape, a.dtype), shapes)  # noqa: E731
    w_ring = res_ring = loss_ring = None
    w0 = jax.tree.map(lambda a: a[0], params_l)
    if split is not None:
        w_ring = ring(tab.w_ring, split.saved_shapes(w0, zero_h, ctx0))
    if keep is not None:
        kept, loss_kept = kept_shapes(chunk, split, keep, jax.tree.map(lambda a: a[:1], params_l), loss_params,
                                      zero_h, ctx0[2], targets0)
        res_ring, loss_ring = ring(tab.res_ring, kept), ring(tab.loss_res_ring, loss_kept)
    return ((zero_h, zero_h, zero_h), jnp.zeros((tab.act_ring + 1,) + zero_h.shape, zero_h.dtype),
            jnp.zeros((tab.grad_ring + 1,) + zero_h.shape, zero_h.dtype), acc, (w_ring, res_ring, loss_ring))


def kept_shapes(chunk, split, keep: Kept, weights, loss_params, h, extras, targets):
    """Shapes and dtypes of one slot of each kept-residual ring (``keep``): what F keeps of
    its chunk (``split``: every layer's linearization) and of the loss, for one microbatch's
    ``h`` rows (``extras``, ``targets``: its rows of those); ``weights``: a chunk's as a
    ``(1, k, ...)`` stack. The executor sizes its rings with it, the estimate reads it."""
    ctx = (jnp.int32(0), jnp.int32(0), extras)  # traced (as in the ops): the same leaves
    if split is not None:
        kept = jax.eval_shape(lambda W, h, ctx: split.forward(jax.tree.map(lambda a: a[0], W), h, ctx)[1],
                              weights, h, ctx)
    else:
        kept = keep.chunk.shapes(lambda ctx: lambda W, h: chunk(W, 0, h, *ctx), (weights, h), ctx, reuse_at=(0, 1))
    loss_kept = keep.loss_shapes(loss_params, h, targets)
    return kept, loss_kept


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
                      rng, *, mesh, axis, data, split: SplitBackward | None = None, keep: Kept | None = None):
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
                              rng, mesh=mesh, axis=axis, data=data, split=split, keep=keep)

    def bwd(grads, g):
        scaled = jax.tree.map(lambda d: (d * g).astype(d.dtype), grads)
        return (*scaled, *jax.tree.map(_zero_cotangent, avals))

    run = jax.custom_vjp(primal)
    run.defvjp(fwd, bwd)
    return run(params_s, loss_params, x_mb, extras_mb, targets_mb, rng)
