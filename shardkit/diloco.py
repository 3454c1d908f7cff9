"""DiLoCo: data parallelism that talks over a slow mesh axis once every ``every`` steps.

Douillard et al. 2023 (DiLoCo, arXiv:2311.08105): M replicas each take H inner optimizer steps
on their own rows, then the averaged parameter change θ_outer − mean_r θ_r is applied to the
shared θ_outer as an *outer gradient* by an outer optimizer (Nesterov SGD), and every replica
restarts from θ_outer. Douillard et al. 2025 (Streaming DiLoCo, arXiv:2501.18512) split the
parameters into fragments synced at staggered steps (each sync moves ≈ 1/F of them) and
quantise the exchanged outer gradients.

Layout. The replica axis is a batch axis (the batch is split over it) but no parameter's: every
inner array (parameters, inner optimizer state, model state, skip counters) carries a leading
replica dimension sharded over ``axis``, and the inner step is the ordinary shardkit step
``jax.vmap``-ed over it with ``spmd_axis_name=axis`` — each replica's DP/ZeRO/TP layout over the
other axes is what the plan without ``axis`` gives, and the compiled inner program has no
collective over ``axis`` at all (``DiLoCoStep.traffic`` reads that off the HLO). Building blocks
that open their own ``shard_map`` (``sk.pipeline``, ``sk.moe``, ``sk.context_attention``) run
inside the replicas too: the vmap is traced under ``mesh.vmapping_over(axis)``, which tells them
to make ``axis`` manual in their shard_maps as well (jax 0.10.2 rejects a shard_map that leaves
a vmap's spmd axis to the compiler).

The sync is a separate compiled program per fragment, run by the step right after the inner
step that completes an interval, rather than a ``lax.cond`` inside one program: a conditional
would put the replica all-reduce into the every-step program (in a branch, but in its HLO and
its buffer plan), while two programs keep the inner one provably free of replica traffic and
let each be measured on its own. With ``overlap`` (Streaming DiLoCo's overlapped exchange) the
replicas do not wait: a fragment's outer step is part of the next inner step's program, reading
only the parameters that step starts from, so XLA may run the all-reduce beside the step's
compute; its result waits in ``state.outer`` until the program τ steps later merges it (one
program per combination of sends and merges, ``DiLoCoStep.program_name``). The host knows when to sync from a step counter it reads
once from the state (after ``init`` or a restore) and then counts itself, so deciding never
waits for the device.

The outer parameters and outer optimizer state (one per fragment) live in ``TrainState.outer``
in the ZeRO *update* layout of the plan without ``axis`` (sharded over the inner data axes
from ZeRO-1 on): they are optimizer-side state, touched once per interval.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from . import _axes
from ._diloco import COMPRESSIONS, DiLoCo, fragment_map, replica_mean, sent_bytes
from .cost.compiled.hlo import traffic_from_hlo
from .mesh import vmapping_over
from .plan import Plan
from .rules import AxisRules, ShardingError, spec_axes

@struct.dataclass
class OuterState:
    """DiLoCo's part of the ``TrainState``.

    Attributes:
        params: per fragment, the parameter tree with that fragment's pieces (``None`` elsewhere).
        opt_state: per fragment, the outer optimizer's state for those pieces.
    """

    params: tuple
    opt_state: tuple


def inner_plan(plan: Plan, axis: str) -> Plan:
    """The plan each replica runs: ``plan`` without ``axis`` among its batch axes or in its
    AxisRules (activations named ``batch`` map to the inner data axes only)."""
    ar = plan.axis_rules
    if ar is not None:
        ar = AxisRules([(name, tuple(a for a in axes if a != axis)) for name, axes in ar.entries],
                       drop_missing=ar.drop_missing)
    return Plan(plan.mesh, rules=plan.rules, axis_rules=ar, zero=plan.zero, precision=plan.precision,
                batch_axes=tuple(a for a in plan.batch_axes if a != axis), strict=plan.strict,
                unused_axes=tuple(a for a in plan.unused_axes if a != axis))


def _with_axis(spec: P, axis: str) -> P:
    return P(axis, *spec)


class DiLoCoStep:
    """The DiLoCo machinery of one ``TrainStep`` (``step.diloco``): state layout, the inner and
    sync programs, and their traffic over the replica axis."""

    def __init__(self, step, outer: DiLoCo):
        plan = step.plan
        if not isinstance(outer, DiLoCo):
            raise ValueError(f"train_step(outer=...) takes an sk.DiLoCo, got {type(outer).__name__}")
        names = dict(plan.mesh.shape)
        if outer.axis not in names:
            raise ValueError(f"DiLoCo(axis={outer.axis!r}) is not a mesh axis; the mesh has {names}. Add it "
                             f"(sk.make_mesh('{outer.axis}=2,data=4'), or dcn='{outer.axis}=2' for the slow link)")
        if outer.axis not in plan.batch_axes:
            raise ValueError(f"DiLoCo(axis={outer.axis!r}) must split the batch, but the plan's batch_axes are "
                             f"{plan.batch_axes}; add it to Plan(batch_axes=...)")
        self.outer, self.axis, self.step = outer, outer.axis, step
        self.replicas = names[outer.axis]
        self.plan = inner_plan(plan, outer.axis)
        self.inner = None  # the TrainStep each replica runs, made once the model is known
        self._programs: dict = {}
        self._bytes: dict = {}
        self._shardings = None
        self._host_step: int | None = None
        self._last_step = None

    # ---- layout ----------------------------------------------------------------------------

    def setup(self) -> None:
        """Checks the rules against the axis and builds the per-replica step (after ``_setup``)."""
        step, axis = self.step, self.axis
        used = [f"{l.path} shape={l.shape} spec={l.spec} ({l.source})"
                for l in step._layout.leaves if axis in spec_axes(l.spec)]
        if used:
            raise ShardingError(
                f"DiLoCo's replica axis {axis!r} is also used by the rules for {len(used)} parameter(s):", used,
                fix=f"keep {axis!r} out of PathRules/AxisRules for parameters (each replica holds whole "
                    "parameters; shard them over the inner axes), or pick another DiLoCo axis")
        # The replica's step is this step on the plan without the axis (with_plan refuses a
        # DiLoCo step, so detach while copying).
        step._diloco = None
        try:
            inner = step.with_plan(self.plan)
        finally:
            step._diloco = self
        self.inner = inner
        self.fragment_of = fragment_map(inner._layout, inner._logical, inner._adapter.param_prefix,
                                        self.outer.fragments, self.outer.layers)

    def pieces(self, params, f: int, batched: bool):
        """Fragment ``f`` of ``params`` (a tree with ``None`` where a leaf is not in it)."""
        lay = self.inner._layout
        leaves = jax.tree_util.tree_leaves(params)
        out = []
        for x, where in zip(leaves, self.fragment_of[f]):
            if where is None or where == "all":
                out.append(None if where is None else x)
            else:
                d = 1 if batched else 0
                if isinstance(x, jax.ShapeDtypeStruct):
                    shape = x.shape[:d] + (where[1] - where[0],) + x.shape[d + 1:]
                    out.append(jax.ShapeDtypeStruct(shape, x.dtype))
                else:
                    out.append(jax.lax.slice_in_dim(x, where[0], where[1], axis=d))
        return jax.tree_util.tree_unflatten(lay.treedef, out)

    def _piece_layout(self, f: int):
        lay = self.inner._layout
        shapes = self.pieces(lay.tree([jax.ShapeDtypeStruct(l.shape, l.dtype) for l in lay.leaves]), f, False)
        return shapes, self.plan._layout(shapes, self.inner._logical, self.inner._adapter.param_prefix)

    def _piece_specs(self, f: int):
        """Specs of fragment ``f`` in the outer (ZeRO update) layout, and the inner params' specs."""
        _, play = self._piece_layout(f)
        outer = play.zero_specs if self.plan.zero >= 1 else [l.spec for l in play.leaves]
        return play.tree(outer), play.tree([l.spec if self.plan.zero < 3 else z
                                            for l, z in zip(play.leaves, play.zero_specs)])

    def wrap_make(self, make):
        """``make`` (building an unreplicated ``TrainState``) → one building DiLoCo's state."""
        R, tx = self.replicas, self.outer.optimizer
        prec = self.plan.precision

        def made(*a):
            s = make(*a)
            rep = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (R,) + x.shape), t)  # noqa: E731
            frags = tuple(self.pieces(s.params, f, False) for f in range(self.outer.fragments))
            opt = tuple(jax.tree.map(lambda x: x.astype(prec.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)
                                     and x.ndim else x, tx.init(p)) for p in frags)
            return s.replace(params=rep(s.params), opt_state=rep(s.opt_state), model_state=rep(s.model_state),
                             skipped=rep(s.skipped), streak=rep(s.streak), loss_scale=rep(s.loss_scale),
                             outer=OuterState(frags, opt))
        return made

    def state_shardings(self, state):
        """Shardings of a DiLoCo ``TrainState``: inner arrays over ``axis`` + the inner layout."""
        inner, axis, plan = self.inner, self.axis, self.plan
        lay = inner._layout
        params = lay.tree([jax.ShapeDtypeStruct(l.shape, l.dtype) for l in lay.leaves])
        unrep = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), t)  # noqa: E731
        add = lambda specs: jax.tree.map(lambda s: _with_axis(s, axis), specs,  # noqa: E731
                                         is_leaf=lambda x: isinstance(x, P))
        opt_specs = plan.opt_state_specs(jax.eval_shape(inner.tx.init, params), params, lay)
        ms_specs = plan.state_specs(unrep(state.model_state), inner._logical)
        outer_p, outer_o = [], []
        for f in range(self.outer.fragments):
            shapes, play = self._piece_layout(f)
            ospec, _ = self._piece_specs(f)
            outer_p.append(ospec)
            outer_o.append(plan.opt_state_specs(jax.eval_shape(self.outer.optimizer.init, shapes), shapes, play))
        rep, per = P(), P(axis)
        sh = plan.shardings
        return state.replace(
            step=plan.sharding(rep), rng=plan.sharding(rep),
            params=sh(add(inner._specs("params"))), opt_state=sh(add(opt_specs)),
            model_state=sh(add(ms_specs)), skipped=plan.sharding(per), streak=plan.sharding(per),
            loss_scale=None if state.loss_scale is None else jax.tree.map(lambda _: plan.sharding(per), state.loss_scale),
            outer=OuterState(tuple(sh(p) for p in outer_p), tuple(sh(o) for o in outer_o)))

    def consensus(self, state):
        """The state a step without DiLoCo would evaluate: θ_outer as the parameters (fragments
        put back together), replica 0's model state, no optimizer state. Right after a sync of
        every fragment it equals each replica's parameters. A state that is one already (no
        ``outer``) is returned as it is."""
        if state.outer is None:
            return state
        lay = self.inner._layout
        frags = [iter(jax.tree_util.tree_leaves(p)) for p in state.outer.params]
        leaves = []
        for i in range(len(lay.leaves)):
            parts = sorted((w[0] if isinstance(w, tuple) else 0, next(frags[f]))
                           for f, w in ((f, self.fragment_of[f][i]) for f in range(len(frags))) if w is not None)
            leaves.append(parts[0][1] if len(parts) == 1 else jnp.concatenate([x for _, x in parts], axis=0))
        return state.replace(params=jax.tree_util.tree_unflatten(lay.treedef, leaves), opt_state=None,
                             model_state=jax.tree.map(lambda x: x[0], state.model_state), outer=None)

    # ---- the programs ----------------------------------------------------------------------

    def _split_rows(self, x):
        """(B, ...) split over the plan's batch axes → (R, B/R, ...): replica r's rows, moved
        nowhere (the rows a device holds stay on it)."""
        if not x.ndim:
            return x
        batch_axes, sizes = self.step.plan.batch_axes, dict(self.step.plan.mesh.shape)
        before = math.prod(sizes[a] for a in batch_axes[:batch_axes.index(self.axis)])
        R = self.replicas
        y = x.reshape((before, R, x.shape[0] // (before * R)) + x.shape[1:])
        y = jnp.moveaxis(y, 1, 0).reshape((R, x.shape[0] // R) + x.shape[1:])
        inner = self.plan.batch_axes
        spec = P(self.axis, (inner if len(inner) != 1 else inner[0]) if inner else None)
        return jax.lax.with_sharding_constraint(y, self.plan.sharding(spec))

    def _inner_fn(self, state, batch):
        inner = self.inner
        # The replicas' vmap owns the DiLoCo axis; the whole program is checked against the
        # outer plan (the inner one leaves the axis out).
        with _axes.checking_axes(self.step.plan, (self.axis,)), self.plan.active():
            rows = jax.tree.map(self._split_rows, batch)

            def one(params, opt_state, model_state, skipped, streak, loss_scale, b):
                s = state.replace(params=params, opt_state=opt_state, model_state=model_state, skipped=skipped,
                                  streak=streak, loss_scale=loss_scale, outer=None)
                new, metrics = inner._step(s, b)
                return (new.params, new.opt_state, new.model_state, new.skipped, new.streak, new.loss_scale), metrics

            b_axes = jax.tree.map(lambda x: 0 if x.ndim else None, rows)
            with vmapping_over(self.axis):  # building blocks make the replica axis manual too
                outs, metrics = jax.vmap(one, in_axes=(0, 0, 0, 0, 0, 0, b_axes), spmd_axis_name=self.axis)(
                    state.params, state.opt_state, state.model_state, state.skipped, state.streak,
                    state.loss_scale, rows)
        params, opt_state, model_state, skipped, streak, loss_scale = outs
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state, model_state=model_state,
                             skipped=skipped, streak=streak, loss_scale=loss_scale), metrics

    def _outer_update(self, f: int, state):
        """Fragment ``f``'s outer step from the replicas' ``state.params``: the all-reduced
        Δ = θ_outer − mean_r θ_r through the outer optimizer → (new θ_outer pieces, its state)."""
        ospecs, ispecs = self._piece_specs(f)
        o_sh = self.plan.shardings(ospecs)
        theta_r = self.pieces(state.params, f, batched=True)
        out_p = state.outer.params[f]
        constrain = jax.lax.with_sharding_constraint

        def delta(o, x, s, spec):
            d_r = o.astype(jnp.float32)[None] - x.astype(jnp.float32)
            return constrain(replica_mean(d_r, spec, self.outer.compress, self.plan, self.axis), s)
        deltas = jax.tree.map(delta, out_p, theta_r, o_sh, ispecs, is_leaf=lambda x: isinstance(x, P))
        updates, opt = self.outer.optimizer.update(deltas, state.outer.opt_state[f], out_p)
        new_out = jax.tree.map(lambda p, u: (p.astype(jnp.float32) + u.astype(jnp.float32)).astype(p.dtype),
                               out_p, updates)
        new_out = constrain(new_out, o_sh)
        opt = jax.tree.map(lambda new, old: new.astype(old.dtype), opt, state.outer.opt_state[f])
        return new_out, opt

    def _write(self, f: int, params, pieces, mix: float = 0.0):
        """``params`` (leading replica dim) with fragment ``f``'s pieces set to θ_outer's
        ``pieces`` (``mix`` = α: α·θ_r + (1−α)·θ_outer)."""
        leaves = jax.tree_util.tree_leaves(params)
        it = iter(jax.tree_util.tree_leaves(pieces))
        out = []
        for x, w in zip(leaves, self.fragment_of[f]):
            if w is None:
                out.append(x)
                continue
            p = next(it)
            old = x if w == "all" else x[:, w[0]:w[1]]
            new = jnp.broadcast_to(p.astype(x.dtype)[None], old.shape)
            if mix:
                new = (mix * old.astype(jnp.float32) + (1 - mix) * new.astype(jnp.float32)).astype(x.dtype)
            out.append(new if w == "all" else x.at[:, w[0]:w[1]].set(new))
        return jax.lax.with_sharding_constraint(jax.tree_util.tree_unflatten(self.inner._layout.treedef, out),
                                                self._shardings.params)

    @staticmethod
    def _set_outer(outer, f: int, new_out, opt):
        return OuterState(tuple(new_out if g == f else p for g, p in enumerate(outer.params)),
                          tuple(opt if g == f else o for g, o in enumerate(outer.opt_state)))

    def _sync_fn(self, f: int, state):
        new_out, opt = self._outer_update(f, state)
        return state.replace(params=self._write(f, state.params, new_out),
                             outer=self._set_outer(state.outer, f, new_out, opt))

    def _overlapped_fn(self, sends, applies, state, batch):
        """One inner step with fragments ``sends``' outer all-reduce beside it (from the
        parameters the step starts from: no data dependency either way) and ``applies``'
        θ_outer (sent τ steps before, kept in ``state.outer``) merged in after it."""
        outer = state.outer
        for f in sends:
            outer = self._set_outer(outer, f, *self._outer_update(f, state))
        new, metrics = self._inner_fn(state, batch)
        params = new.params
        for f in applies:
            params = self._write(f, params, outer.params[f], self.outer.mix)
        return new.replace(params=params, outer=outer), metrics

    @staticmethod
    def program_name(sends, applies) -> str:
        """``"inner"``, ``"inner+send/0"``, ``"inner+apply/1"``, ``"inner+send/0+apply/0"``..."""
        return "+".join(["inner"] + [f"send/{f}" for f in sends] + [f"apply/{f}" for f in applies])

    def _reduce_metrics(self, metrics):
        """Per-replica metrics (leading dim R) → the run's: means, and the worst skip counts."""
        out = {}
        for k, v in metrics.items():
            if k in ("skipped", "nonfinite_streak"):
                out[k] = v.max(axis=0)
            elif k == "finite":
                out[k] = v.all(axis=0)
            else:
                out[k] = jax.tree.map(lambda x: x.mean(axis=0) if jnp.issubdtype(x.dtype, jnp.floating)
                                      else x.sum(axis=0), v)
        out["replica_loss"] = metrics["loss"]
        return out

    def programs(self, state, batch, batch_shardings):
        """The compiled programs for a placed ``batch``: ``"inner"`` (every step), ``"sync/f"``
        (per fragment), ``"metrics"`` (the replicas' metrics → the run's, a few scalars). With
        ``overlap`` the syncs are parts of inner programs instead, one per combination of sends
        and merges that a step can have (``program_name``)."""
        key = jax.tree.structure(batch_shardings)
        if key in self._programs:
            return self._programs[key]
        self._shardings = sh = self.step._state_shardings or self.step.state_shardings(state)
        donate = (0,) if self.step.donate else ()
        abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, sh)
        per = self.plan.sharding(P(self.axis))
        progs = {}
        with self.step.plan.active():
            inner = jax.jit(self._inner_fn, in_shardings=(sh, batch_shardings), donate_argnums=donate,
                            out_shardings=(sh, per))
            progs["inner"] = inner.lower(abstract, batch).compile()
            _, metrics = jax.eval_shape(self._inner_fn, abstract, batch)
            if self.outer.overlap:
                for sends, applies in sorted({self.outer.phase(n) for n in range(2 * self.outer.every)}):
                    name = self.program_name(sends, applies)
                    if name not in progs:
                        progs[name] = jax.jit(
                            functools.partial(self._overlapped_fn, sends, applies),
                            in_shardings=(sh, batch_shardings), donate_argnums=donate,
                            out_shardings=(sh, per)).lower(abstract, batch).compile()
            for f in range(0 if self.outer.overlap else self.outer.fragments):
                progs[f"sync/{f}"] = jax.jit(
                    lambda s, f=f: self._sync_fn(f, s), in_shardings=(sh,), out_shardings=sh,
                    donate_argnums=donate).lower(abstract).compile()
            rep = self.plan.sharding(P())
            m_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=per), metrics)
            progs["metrics"] = jax.jit(self._reduce_metrics, out_shardings=rep).lower(m_abs).compile()
        shape = dict(self.step.plan.mesh.shape)
        self._bytes[key] = {k: sent_bytes(traffic_from_hlo(c.as_text(), shape), self.axis) for k, c in progs.items()}
        self._programs[key] = progs
        return progs

    def traffic(self, state, batch) -> dict[str, int]:
        """Bytes one device sends over the replica axis per run of each compiled program
        (``"inner"``, ``"sync/f"``, ``"metrics"``), read off their HLO; and
        ``"per_step"``: the average per training step (syncs amortised over ``every``)."""
        batch, shardings = self.step.place_batch(batch)
        self.programs(state, batch, shardings)
        b = dict(self._bytes[jax.tree.structure(shardings)])
        H = self.outer.every
        if self.outer.overlap:  # the steady state: one interval's programs
            b["per_step"] = b["metrics"] + sum(b[self.program_name(*self.outer.phase(n))] for n in range(H, 2 * H)) / H
        else:
            b["per_step"] = (b["inner"] + b["metrics"]
                             + sum(b[f"sync/{f}"] for f in range(self.outer.fragments)) / H)
        return b

    def hlo(self, state, batch) -> dict[str, str]:
        """The compiled programs' HLO text, by name (as ``programs``)."""
        batch, shardings = self.step.place_batch(batch)
        return {k: c.as_text() for k, c in self.programs(state, batch, shardings).items()}

    def run(self, state, batch, batch_shardings):
        """One training step: the inner program, then any sync due; returns ``(state, metrics)``."""
        progs = self.programs(state, batch, batch_shardings)
        sent = self._bytes[jax.tree.structure(batch_shardings)]
        s = self._host_step if state.step is self._last_step else int(state.step)
        synced = -1
        if self.outer.overlap:
            sends, applies = self.outer.phase(s)
            name = self.program_name(sends, applies)
            state, metrics = progs[name](state, batch)
            nbytes = sent[name] + sent["metrics"]
            synced = sends[0] if sends else -1
        else:
            state, metrics = progs["inner"](state, batch)
            nbytes = sent["inner"] + sent["metrics"]
        s += 1
        for f in range(0 if self.outer.overlap else self.outer.fragments):
            if s % self.outer.every == self.outer.offset(f):
                state = progs[f"sync/{f}"](state)
                nbytes += sent[f"sync/{f}"]
                synced = f
        metrics = progs["metrics"](metrics)
        metrics["diloco/synced_fragment"] = synced
        metrics["diloco/steps_to_sync"] = self.outer.steps_to_sync(s)
        metrics["diloco/replica_bytes"] = nbytes
        self._host_step, self._last_step = s, state.step
        return state, metrics


__all__ = ["COMPRESSIONS", "DiLoCo", "DiLoCoStep", "OuterState", "inner_plan", "replica_mean", "sent_bytes"]
