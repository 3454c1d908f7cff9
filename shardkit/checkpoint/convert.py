"""Restoring a checkpoint into the other kind of run: a data-parallel ``TrainState`` into a
DiLoCo run (warm start, Douillard et al. 2023 §3: DiLoCo from a pretrained model) and a DiLoCo
one into a data-parallel run.

Which way is read off the checkpoint's own tree (its Orbax metadata: a DiLoCo state has
``outer/...`` leaves) against the target state (``like.outer`` set or not); nothing is asked of
the caller. Orbax reads every byte, into a source tree shaped like the checkpoint with
shardings on the target's mesh; the conversion is then a few array ops on the devices.

DP → DiLoCo: every replica starts from the checkpoint (parameters, inner optimizer state, model
state and skip counters broadcast over the replica dimension), θ_outer is its parameters
(fragment pieces cut along the layer dimension as the target's fragments are), the outer
optimizer state is the target's own (fresh, as ``step.init`` made it), and the step counter
carries on, so learning-rate schedules continue.

DiLoCo → DP: the parameters are θ_outer, the consensus (fragments put back together). They equal
every replica's after a sync of all fragments; replicas' progress since their last sync is
dropped. The optimizer state is the replicas' mean (integer leaves, e.g. Adam's count, from
replica 0, where they are all equal), the model state replica 0's, the skip counters the worst
replica's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from ..rules import path_str
from .errors import CheckpointError
from .tree import leaf_paths

# TrainState fields that carry a leading replica dimension under DiLoCo.
PER_REPLICA = ("params", "opt_state", "model_state", "skipped", "streak", "loss_scale")


def _field(name: str) -> str:
    return name.split("/", 1)[0]


class _put:
    """``fn(*args)``, to be computed on the devices straight into ``t``'s dtype and sharding;
    ``_computed`` runs every one of a tree in one compiled program."""

    def __init__(self, fn, t, *args):
        self.fn, self.t, self.args = fn, t, args


def _computed(tree):
    jobs = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _put)) if isinstance(x, _put)]
    if not jobs:
        return tree

    def body(args):
        return [j.fn(*a).astype(j.t.dtype) for j, a in zip(jobs, args)]
    out = iter(jax.jit(body, out_shardings=[j.t.sharding for j in jobs])([j.args for j in jobs]))
    return jax.tree.map(lambda x: next(out) if isinstance(x, _put) else x, tree, is_leaf=lambda x: isinstance(x, _put))


class Conversion:
    """How one saved step becomes the target state.

    Attributes:
        kind: ``"dp->diloco"`` or ``"diloco->dp"``.
        source: the abstract tree Orbax reads the checkpoint into (its own structure, shardings
            on the target's mesh).
    """

    def __init__(self, kind: str, source, target, like):
        self.kind, self.source, self.target, self.like = kind, source, target, like

    def describe(self) -> str:
        return ("a data-parallel checkpoint restored into a DiLoCo run (compared against the target without "
                "its replica dimension)" if self.kind == "dp->diloco" else
                "a DiLoCo checkpoint restored into a data-parallel run (its consensus parameters)")

    def finish(self, source):
        """The restored ``source`` → a state with the target's structure, dtypes and shardings."""
        return _to_diloco(source, self.target, self.like) if self.kind == "dp->diloco" else \
            _to_dp(source, self.target)


def conversion(saved_tree, target, like) -> Conversion | None:
    """The conversion from a step whose metadata tree is ``saved_tree`` to ``target`` (an abstract
    state with shardings), or None when both are the same kind of run."""
    saved_diloco = any(n.split("/", 1)[0] == "outer" for n in leaf_paths(saved_tree))
    target_diloco = getattr(target, "outer", None) is not None
    if saved_diloco == target_diloco or not hasattr(target, "params"):
        return None
    if target_diloco:
        return Conversion("dp->diloco", _dp_source(target), target, like)
    return Conversion("diloco->dp", _diloco_source(saved_tree, target), target, like)


def _dp_source(target):
    """The data-parallel state a DiLoCo ``target`` starts from: per-replica fields without the
    replica dimension (replicated over that axis), no outer state."""
    def strip(t):
        spec = tuple(t.sharding.spec)[1:]
        return jax.ShapeDtypeStruct(t.shape[1:], t.dtype, sharding=NamedSharding(t.sharding.mesh, P(*spec)))
    return target.replace(outer=None, **{f: jax.tree.map(strip, getattr(target, f)) for f in PER_REPLICA})


def _diloco_source(saved_tree, target):
    """The saved DiLoCo tree as an abstract target on ``target``'s mesh: leaves the DP state has
    (with or without a replica dimension) keep its layout; the rest (outer pieces) are replicated."""
    want = leaf_paths(target)
    mesh = next(t.sharding.mesh for t in want.values())

    def one(path, m):
        if m is None:
            return None
        t, shape = want.get(path_str(path)), tuple(m.shape)
        if t is not None and shape == t.shape:
            sharding = t.sharding
        elif t is not None and shape[1:] == t.shape:
            sharding = NamedSharding(mesh, P(None, *t.sharding.spec))
        else:
            sharding = NamedSharding(mesh, P())
        return jax.ShapeDtypeStruct(shape, m.dtype, sharding=sharding)
    return jax.tree_util.tree_map_with_path(one, saved_tree, is_leaf=lambda x: x is None)


def _to_diloco(dp, target, like):
    src = leaf_paths(dp)
    fresh = leaf_paths(like)
    targets = leaf_paths(target)
    offsets: dict[str, int] = {}  # per parameter path: rows taken by the fragments before
    stale = [n for n in targets if n.startswith("outer/opt_state/") and not isinstance(fresh.get(n), jax.Array)]
    if stale:
        raise CheckpointError(
            "restoring a data-parallel checkpoint into a DiLoCo run takes the outer optimizer's fresh state from "
            "`like`, but these leaves of it are abstract:\n  " + "\n  ".join(stale) +
            "\nPass like=step.init(...) (concrete arrays), not an abstract state.")

    def one(path, t):
        name = path_str(path)
        if name.startswith("outer/opt_state/"):
            return fresh[name]
        if name.startswith("outer/params/"):
            p = "params/" + name.split("/", 3)[3]
            x = src[p]
            if t.shape == x.shape:
                return _put(lambda a: a, t, x)
            start = offsets.get(p, 0)
            offsets[p] = start + t.shape[0]
            return _put(lambda a: jax.lax.slice_in_dim(a, start, start + t.shape[0], axis=0), t, x)
        x = src[name]
        if _field(name) in PER_REPLICA:
            return _put(lambda a: jnp.broadcast_to(a, t.shape), t, x)
        return x
    return _computed(jax.tree_util.tree_map_with_path(one, target))


def _to_dp(dl, target):
    src = leaf_paths(dl)
    fragments = sorted({int(n.split("/")[2]) for n in src if n.startswith("outer/params/")})
    wrong = []

    def one(path, t):
        name = path_str(path)
        if _field(name) == "params":
            pieces = [src[k] for k in (f"outer/params/{f}/{name[len('params/'):]}" for f in fragments)
                      if src.get(k) is not None]
            if not pieces:
                wrong.append(f"  {name}: in no fragment of the checkpoint's outer parameters")
                return None
            shape = (sum(x.shape[0] for x in pieces),) + tuple(pieces[0].shape[1:])
            if shape != t.shape:
                wrong.append(f"  {name}: saved {shape} (its fragments put together), expected {t.shape}")
                return None
            return _put(lambda *a: jnp.concatenate(a, axis=0), t, *pieces)
        else:
            x = src.get(name)
            if x is None:
                wrong.append(f"  {name}: expected {t.shape}, not in the checkpoint")
                return None
            if x.shape == (x.shape[:1] + t.shape) and x.shape != t.shape:  # a replica dimension
                if _field(name) in ("skipped", "streak"):
                    return _put(lambda a: a.max(axis=0), t, x)
                if _field(name) == "opt_state" and jnp.issubdtype(x.dtype, jnp.inexact):
                    return _put(lambda a: a.astype(jnp.float32).mean(axis=0), t, x)
                return _put(lambda a: a[0], t, x)
        if x.shape != t.shape:
            wrong.append(f"  {name}: saved {tuple(x.shape)}, expected {t.shape}")
            return None
        return _put(lambda a: a, t, x)
    out = jax.tree_util.tree_map_with_path(one, target)
    if wrong:
        raise CheckpointError("a DiLoCo checkpoint does not fit the data-parallel state being restored "
                              f"({len(wrong)} leaves differ):\n" + "\n".join(wrong) +
                              "\nRestore with the model/optimizer config it was saved with.")
    return _computed(out)
