"""Reproducer: XLA's SPMD partitioner aborts on a shard_map manual over one axis ("pipe") with
two auto axes ("tensor", "context") inside, around a scan whose body runs a lax.switch.

    python docs/upstream/xla_partitioner_two_auto_axes.py          # aborts (see below)
    python docs/upstream/xla_partitioner_two_auto_axes.py --one    # tensor only: compiles

jax / jaxlib: VERSIONS (filled in below when run). XLA:CPU, 8 host devices; XLA:GPU aborts the
same way (compiled deviceless for H100). Message:

ABORT

Plain JAX, no shardkit: this is what shardkit's explicit pipeline schedules (1F1B, ZB) build
(a per-tick lax.switch choosing the stage's op, ppermute between stages) with the stage's
weights split over "tensor" and its activations over "context", both left to the compiler.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

two = "--one" not in sys.argv
shape, names = ((2, 2, 2), ("pipe", "context", "tensor")) if two else ((2, 4), ("pipe", "tensor"))
mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def stage(w, h):  # (T, D) @ (D, D): D split over tensor (an auto axis)
    return jnp.tanh(h @ w)


# 1F1B on 2 stages, 2 microbatches: 0 idle, 1 forward, 2 backward (as a per-tick table).
TABLE = jnp.array([[1, 0], [1, 1], [0, 2], [0, 1], [2, 2], [2, 0]], jnp.int32)


def body(w, x):  # manual over "pipe" only; per tick: idle, forward, or a stage's backward
    w = w[0]
    stage_i = lax.axis_index("pipe")

    def idle(h, g, acc):
        return jnp.zeros_like(h), jnp.zeros_like(g), acc

    def fwd(h, g, acc):
        return stage(w, h), jnp.zeros_like(g), acc

    def bwd(h, g, acc):
        dw, dh = jax.vjp(stage, w, h)[1](g)
        return jnp.zeros_like(h), dh, acc + dw

    def tick(carry, row):
        h, g, acc = carry
        down, up, acc = lax.switch(row[stage_i], [idle, fwd, bwd], h, g, acc)
        return (lax.ppermute(down, "pipe", [(0, 1)]), lax.ppermute(up, "pipe", [(1, 0)]), acc), None

    return lax.scan(tick, (x, x, jnp.zeros_like(w)), TABLE)[0][2][None]


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P("pipe"), axis_names={"pipe"},
                          check_vma=False))
w = jax.device_put(jnp.ones((2, 64, 64)), NamedSharding(mesh, P("pipe", None, "tensor")))
x = jnp.ones((16, 64))
print(f.lower(w, x).compile() is not None and "compiled", jax.__version__)
print(f(w, x).sum(), "ran")
