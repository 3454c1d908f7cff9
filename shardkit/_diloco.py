"""DiLoCo's parts that are pure functions of their inputs: which leaves (and which layers of a
stacked leaf) each Streaming-DiLoCo fragment owns, how the outer gradients cross the replica
axis (f32 mean, or quantised and all-gathered), and what a program sends over the axis.
``shardkit.diloco`` is the public face."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .cost.steptime import collective_time
from .rules import spec_axes

LEVELS = {"int8": 127, "int4": 7}


def fragment_map(lay, logical: dict, prefix: str, fragments: int, layers: str | None) -> list[list]:
    """Per fragment, per leaf of ``lay``: ``None`` (not in it), ``"all"`` or ``(start, stop)``
    on dim 0. Stacked leaves (logical name ``layers`` on dim 0, or a path matching ``layers``)
    are cut into ``fragments`` blocks of layers; every other leaf goes whole to the fragment
    with the fewest elements so far (tree order, lowest index on ties).

    Raises:
        ValueError: ``fragments`` does not divide a stacked leaf's layers, or (no stacked
            leaf) exceeds the number of leaves, or would leave a fragment empty.
    """
    F = fragments
    if F == 1:
        return [["all"] * len(lay.leaves)]
    pattern = re.compile(layers) if layers else None
    stacked = [bool(l.shape) and bool(pattern.search(l.path) if pattern else
                                      (logical.get(prefix + l.path) or (None,))[0] == "layers")
               for l in lay.leaves]
    bad = [f"{l.path} shape={l.shape}: {l.shape[0]} layers" for l, s in zip(lay.leaves, stacked)
           if s and l.shape[0] % F]
    if bad:
        raise ValueError(f"DiLoCo(fragments={F}) must divide the layer count of every stacked leaf:\n  "
                         + "\n  ".join(bad) + "\nchoose fragments dividing the layers")
    loose = [i for i, s in enumerate(stacked) if not s]
    if not any(stacked) and len(loose) < F:
        raise ValueError(f"DiLoCo(fragments={F}): the model has {len(loose)} parameter leaves and no stacked "
                         "layer dimension (logical name 'layers' or DiLoCo(layers=regex)); use fragments <= "
                         f"{len(loose)}")
    out = [[None] * len(lay.leaves) for _ in range(F)]
    load = [0] * F
    for i, (l, s) in enumerate(zip(lay.leaves, stacked)):
        if s:
            n = l.shape[0] // F
            for f in range(F):
                out[f][i] = (f * n, (f + 1) * n)
                load[f] += math.prod(l.shape) // F
    for i in loose:
        f = min(range(F), key=lambda f: (load[f], f))
        out[f][i] = "all"
        load[f] += math.prod(lay.leaves[i].shape)
    empty = [f for f in range(F) if all(x is None for x in out[f])]
    if empty:
        raise ValueError(f"DiLoCo(fragments={F}): fragments {empty} would hold no parameters; use fewer")
    return out


def replica_mean(delta_r, spec: P, compress: str | None, plan, axis: str):
    """mean_r δ_r of ``delta_r`` (R, ...) sharded over ``axis`` on dim 0, through ``compress``
    (see ``DiLoCo``); ``spec``: the inner layout of one replica's δ_r."""
    if compress is None:
        return delta_r.mean(axis=0)
    if compress == "bf16":
        # Sent as its bits: XLA:CPU widens a bf16 collective to f32.
        bits = jax.lax.bitcast_convert_type(delta_r.astype(jnp.bfloat16), jnp.uint16)
        gathered = jax.lax.bitcast_convert_type(gather_replicas(bits, spec, plan, axis), jnp.bfloat16)
        return gathered.astype(jnp.float32).mean(axis=0)
    dims = tuple(range(1, delta_r.ndim))
    scale = jnp.max(jnp.abs(delta_r), axis=dims, keepdims=True) / LEVELS[compress]
    q = jnp.round(delta_r / jnp.where(scale > 0, scale, 1.0)).astype(jnp.int8)
    if compress == "int4" and q.ndim > 1:  # a scalar parameter's δ_r is (R,): nothing to pair up
        n = q.shape[-1]
        u = (q + 8).astype(jnp.uint8)  # [-7, 7] -> [1, 15]: one nibble
        if n % 2:
            u = jnp.pad(u, [(0, 0)] * (u.ndim - 1) + [(0, 1)])
        pairs = u.reshape(u.shape[:-1] + (u.shape[-1] // 2, 2))
        packed = gather_replicas(pairs[..., 0] | (pairs[..., 1] << 4), spec, plan, axis)
        u = jnp.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (-1,))[..., :n]
        q = u.astype(jnp.int8) - 8
    else:
        q = gather_replicas(q, spec, plan, axis)
    scale = gather_replicas(scale, P(), plan, axis)
    return (q.astype(jnp.float32) * scale).mean(axis=0)


def gather_replicas(x, spec: P, plan, axis: str):
    """``x`` (R, ...) sharded over ``axis`` on dim 0 → every replica holds all R rows (an
    all-gather over it); the other dims keep ``spec`` where it still divides."""
    sizes = dict(plan.mesh.shape)
    entries = list(spec) + [None] * (x.ndim - 1 - len(spec))
    keep = [e if x.shape[d + 1] % math.prod(sizes[a] for a in spec_axes(P(e))) == 0 else None
            for d, e in enumerate(entries[:x.ndim - 1])]
    # Pinned to the replica layout first: otherwise sharding propagation may gather the f32
    # value the quantised one was made from, and send that over the slow link.
    x = jax.lax.with_sharding_constraint(x, plan.sharding(P(axis, *keep)))
    return jax.lax.with_sharding_constraint(x, plan.sharding(P(None, *keep)))


def sent_bytes(traffic, axis: str) -> int:
    """Bytes one device sends over ``axis`` per execution of a program whose ``Traffic`` rows
    are given: ring collectives (all-reduce 2(g−1)/g·V, gathers (g−1)/g·result), as
    ``cost.steptime.collective_time`` times them at one byte per second."""
    total = 0.0
    for t in traffic:
        if axis in t.axes:
            kind = "permute" if t.kind == "collective-permute" else t.kind
            nbytes = t.bytes if kind in ("all-gather", "permute") else t.operand_bytes
            total += collective_time(kind, nbytes, t.group, 1.0, 0.0)
    return round(total)
