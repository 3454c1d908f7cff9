"""Reproducer: a shard_map manual over one axis ("pipe") with two auto axes ("context",
"tensor") beside it, around a scan whose per-tick lax.switch runs a stage's forward or its
backward (jax.vjp) and whose carry is passed between stages by ppermute, is partitioned into
a wrong program: with the weights split over "tensor" the compiled program deadlocks.

    python docs/upstream/xla_partitioner_two_auto_axes.py          # compiles, then hangs
    python docs/upstream/xla_partitioner_two_auto_axes.py --one    # tensor only: runs

jax 0.10.2, jaxlib 0.10.2, XLA:CPU with 8 host devices, on 2026-11-27. With two auto axes it
prints "compiled", then every device waits in a collective-permute that only half of them
reach, and XLA aborts the process:

    F rendezvous.cc:161] [id=2] Termination timeout for `collective permute RendezvousKey{...,
    global_devices=[0, 1, 2, 3, 4, 5, 6, 7], num_local_participants=8, collective_op_kind=
    cross_module, op_id=1}` of 40 seconds exceeded. Exiting to ensure a consistent program
    state. Expected 8 threads to join the rendezvous, but only 4 of them arrived on time.

With one auto axis ("--one": pipe=2, tensor=4) the same program compiles and runs. Why it
hangs: with two auto axes the partitioner reshards the stage's operands between "context" and
"tensor" with collective-permutes inside the switch's forward and backward branches (each
names all 8 devices in its source-target pairs); a stage that takes another branch at that tick
never reaches them. With one auto axis the branches hold only all-reduces and all-gathers whose
groups stay inside a stage. shardkit's explicit pipeline schedules (1F1B, ZB) build this
program; its recipe's stages constrain their activations (batch, sequence over "context",
heads over "tensor"), and their compiled branches hold no collective-permute (XLA:CPU and
XLA:GPU, pipe=2,context=2,tensor=2 and data=2,pipe=2,context=2,tensor=2, 2026-11-28). The
abort XLA's partitioner met on that recipe was a gather:
``docs/upstream/xla_partitioner_gather_two_auto_axes.py``. Plain JAX, no shardkit.
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
