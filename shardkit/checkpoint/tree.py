"""Pytrees as checkpoints see them: leaves by slash-joined path, non-finite leaves, how a saved
tree differs from an expected one, and the abstract target a restore reads into."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from ..plan import Plan
from ..rules import path_str
from .errors import CheckpointError


def leaf_paths(tree) -> dict[str, Any]:
    """``{"params/w": leaf, ...}``: leaves by slash-joined path, as Orbax names them on disk.

    Dataclass fields, dict keys, named-tuple fields and sequence indices all become path parts,
    so a ``TrainState`` and the nested dicts/lists Orbax's metadata returns line up.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(path): leaf for path, leaf in flat}


def _flags_fn(xs):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])


_finite_flags = jax.jit(_flags_fn)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` holding a NaN or an infinity.

    One jitted reduction over the (possibly sharded, multi-host) arrays; every process must call
    it, as with any computation on global arrays.
    """
    leaves = leaf_paths(tree)
    names, arrays, bad = [], [], []
    for name, x in leaves.items():
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            continue
        if isinstance(x, jax.Array):
            names.append(name)
            arrays.append(x)
        elif not np.all(np.isfinite(np.asarray(x))):
            bad.append(name)
    if arrays:
        flags = np.asarray(_finite_flags(arrays))
        bad += [n for n, ok in zip(names, flags) if not ok]
    return bad


def _describe(x) -> str:
    return f"{tuple(x.shape)} {np.dtype(x.dtype).name}" if hasattr(x, "shape") else type(x).__name__


def tree_mismatches(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """One line per leaf that is missing, unexpected, or shaped differently (saved vs expected)."""
    lines = []
    for name in sorted(set(saved) | set(expected)):
        if name not in saved:
            lines.append(f"  {name}: expected {_describe(expected[name])}, not in the checkpoint")
        elif name not in expected:
            lines.append(f"  {name}: in the checkpoint ({_describe(saved[name])}), not in the target")
        elif tuple(saved[name].shape) != tuple(expected[name].shape):
            lines.append(f"  {name}: saved {tuple(saved[name].shape)}, expected {tuple(expected[name].shape)}")
    return lines


def abstract_target(plan: Plan, like, shardings=None):
    """``like`` as a tree of ``jax.ShapeDtypeStruct`` with shardings on ``plan.mesh``.

    Args:
        plan: the plan to restore onto; every sharding must be on its mesh.
        like: a ``TrainState`` (or any pytree) of ``jax.Array`` or ``ShapeDtypeStruct`` leaves,
            e.g. what the new run's ``step.init`` returned.
        shardings: optional tree of ``NamedSharding`` matching ``like`` (e.g.
            ``step.state_shardings(like)``); overrides the leaves' own shardings.

    Raises:
        CheckpointError: a leaf has no sharding, or one on another mesh than the plan's.
    """
    if shardings is not None:
        like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)
    missing, foreign = [], []

    def one(path, x):
        name = path_str(path)
        s = getattr(x, "sharding", None)
        if s is None and getattr(x, "ndim", None) == 0:
            s = NamedSharding(plan.mesh, P())  # a bare scalar: replicate it, nothing to choose
        if s is None or not hasattr(x, "shape"):
            missing.append(f"  {name}: {type(x).__name__} {_describe(x)}")
            return None
        if not isinstance(s, NamedSharding) or s.mesh != plan.mesh:
            where = f"mesh {dict(s.mesh.shape)}" if isinstance(s, NamedSharding) else type(s).__name__
            foreign.append(f"  {name}: on {where}")
            return None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    target = jax.tree_util.tree_map_with_path(one, like)
    if missing:
        raise CheckpointError(
            "restore(like=...) needs a sharding for every leaf; these have none:\n" + "\n".join(missing) +
            "\nPass the TrainState from the new run's step.init(...), or shardings=step.state_shardings(like).")
    if foreign:
        raise CheckpointError(
            f"restore(plan, like=...): these leaves of `like` are not on the plan's mesh {dict(plan.mesh.shape)}:\n"
            + "\n".join(foreign) + "\nCreate `like` with a train step built on this plan (step.init), "
            "or pass shardings=step.state_shardings(like).")
    return target
