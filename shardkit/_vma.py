"""Varying-manual-axes casts inside ``shard_map``: a scan carry, a switch input or an
accumulator must have one type through the loop, so a value that starts replicated over a
manual axis (a zeros init) is cast to vary over the axes the loop's values vary over."""
from __future__ import annotations

import jax
from jax import lax


def varying(tree, axes):
    """``tree`` marked as varying over ``axes`` (each leaf cast only over those it lacks)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def cast(a):
        missing = tuple(x for x in axes if x not in jax.typeof(a).mat.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def vary_like(tree, like):
    """``tree`` marked as varying over every manual axis any leaf of ``like`` varies over."""
    axes = frozenset().union(*(jax.typeof(a).mat.varying for a in jax.tree.leaves(like)))
    return varying(tree, tuple(sorted(axes)))
