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


def stage(w, h):  # (T, D) @ (D, D): D split over tensor, T over context (auto axes)
    h = lax.with_sharding_constraint(h, P("context" if two else None, None))
    return jnp.tanh(h @ w)


def body(w, x):  # manual over "pipe" only
    w = w[0]

    def tick(h, i):
        y = lax.switch(i % 2, [lambda h: stage(w, h), lambda h: h], h)
        return lax.ppermute(y, "pipe", [(0, 1), (1, 0)]), None

    return lax.scan(tick, x, jnp.arange(4))[0]


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P(), axis_names={"pipe"},
                          check_vma=False))
w = jax.device_put(jnp.ones((2, 64, 64)), NamedSharding(mesh, P("pipe", None, "tensor")))
x = jnp.ones((16, 64))
print(f.lower(w, x).compile() is not None and "compiled", jax.__version__)
