"""Reproducer: XLA's SPMD partitioner aborts the process on a gather inside a shard_map that
is manual over one mesh axis ("pipe") when the gather's operand is split over two other,
compiler-owned axes ("context" on a batch dim, "tensor" on the gathered dim).

    python docs/upstream/xla_partitioner_gather_two_auto_axes.py            # aborts
    python docs/upstream/xla_partitioner_gather_two_auto_axes.py --one      # tensor only: runs
    python docs/upstream/xla_partitioner_gather_two_auto_axes.py --no-manual  # plain jit: runs
    python docs/upstream/xla_partitioner_gather_two_auto_axes.py --masked   # masked sum: runs

jax 0.10.2, jaxlib 0.10.2, XLA:CPU with 8 host devices, 2026-11-28 (XLA:GPU aborts the same
way: the check is in the target-independent partitioner). The gather is
``jnp.take_along_axis`` (a cross-entropy's pick of the label's logit); XLA tries the
"trivially sliced operand dimensions" strategy, whose all-reduce over the gathered dim's
shards builds device groups that do not account for the manual axis:

    F spmd_partitioner_util.cc:497] Check failed: partition_group_list.num_replica_groups() *
    partition_group_list.num_devices_per_group() == device_groups.num_devices_per_group()
    *** Check failure stack trace: ***
        xla::spmd::(anonymous namespace)::ExpandDeviceGroupsWithIota()
        xla::spmd::SpmdPartitioner::AllReduceAlongShardingDimsInternal()
        xla::spmd::(anonymous namespace)::PartitionGatherTrivialSlicedOperandDimensions()
        xla::spmd::EvaluatePartitionCost<>()
        xla::spmd::(anonymous namespace)::PartitionGather()
        xla::spmd::(anonymous namespace)::PartitionGatherExplicitBatchDimensions()
        xla::spmd::SpmdPartitioningVisitor::HandleGather()

The same program compiles with one compiler-owned axis ("--one": pipe=2, tensor=4), without
the manual axis ("--no-manual": all three axes auto), and the mesh's axis order does not
matter. It needs no loop and no collective of its own. A gather of rows from a buffer split
over "expert" (with its indices split too) and "tensor" beside it aborts in the same function
(through PartitionGatherIndexPassthroughDimensions): the two ways ``sk.pipeline``'s explicit
schedules (1F1B, ZB; their stages run in a shard_map manual over pipe) met it, in a
cross-entropy and in a mixture of experts' combine. shardkit avoids the gather
(``sk.kernels.cross_entropy`` picks the label's logit as a masked sum, "--masked" here;
``sk.moe`` nested in a pipeline keeps its slot buffers whole when two compiler-owned axes are
there). Plain JAX, no shardkit.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

one = "--one" in sys.argv
shape, names = ((2, 4), ("pipe", "tensor")) if one else ((2, 2, 2), ("pipe", "context", "tensor"))
mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
split = P(None, None, "tensor") if one else P(None, "context", "tensor")


def picked(logits, labels):  # logits (B, T, V): T over context, V over tensor
    logits = jax.lax.with_sharding_constraint(logits, split)
    if "--masked" in sys.argv:
        hit = jnp.arange(logits.shape[-1]) == labels[..., None]
        return jnp.sum(jnp.where(hit, logits, 0.0), axis=-1).sum()[None]
    return jnp.take_along_axis(logits, labels[..., None], axis=-1).sum()[None]


if "--no-manual" in sys.argv:
    split = P("pipe", *split[1:])
    f = jax.jit(picked)
else:
    f = jax.jit(jax.shard_map(picked, mesh=mesh, in_specs=(P("pipe"), P("pipe")), out_specs=P("pipe"),
                              axis_names={"pipe"}))
logits = jnp.arange(4 * 8 * 16, dtype=jnp.float32).reshape(4, 8, 16)
labels = jnp.ones((4, 8), jnp.int32)
with jax.set_mesh(mesh):
    print(f.lower(logits, labels).compile() is not None and "compiled", jax.__version__)
    print(f(logits, labels), "ran")
