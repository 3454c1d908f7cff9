"""Reproducer: the gradient of a ``lax.scan`` whose body calls a ``jax.shard_map`` fails in the
compiler's import of the program (Shardy) when the shard_map's body writes two arrays with
``x.at[:].set(...)``.

    python docs/upstream/shardy_scan_shard_map_empty_operands.py              # fails
    python docs/upstream/shardy_scan_shard_map_empty_operands.py --remat      # fails (checkpointed body)
    python docs/upstream/shardy_scan_shard_map_empty_operands.py --one        # one .at[].set: runs
    python docs/upstream/shardy_scan_shard_map_empty_operands.py --no-scan    # a Python loop: runs
    python docs/upstream/shardy_scan_shard_map_empty_operands.py --gspmd      # Shardy off: runs

jax 0.10.2, jaxlib 0.10.2, XLA:CPU with 8 host devices, 2026-11-28 (XLA:GPU fails the same way,
deviceless for H100s: the import is target-independent). The error:

    jax.errors.JaxRuntimeError: UNKNOWN: ...: error: 'func.call' op expected at least one
    operand of @xla.sdy.manual_computation_body.1 to be produced by a xla.sdy.GlobalToLocalShape
    CustomCallOp

What happens (``jax.make_jaxpr(jax.grad(loss))`` shows it): linearizing the scan
partially evaluates its body with the loop-invariant values known, and the shard_map's
partial-evaluation rule splits the body: the part that depends on none of its inputs (the
zeros, and the two empty ``int32[0]`` index arrays ``x.at[:].set`` closes over) becomes a new
``shard_map`` hoisted out of the loop, whose only operands are those two empty constants
(``in_specs=(P(), P())``). The import then finds no operand of that manual computation
produced by a ``GlobalToLocalShape`` call and rejects the program. With one such constant, or
none, it compiles. Even where the split compiles it saves every input-free value of the body
for the whole loop (for ring attention: each block's causal mask and masked scores).

shardkit met it as ``sk.context_attention``'s ring under any remat policy (``jax.checkpoint``
around a transformer layer, in the layer scan): the ring's custom VJP (``optimize_remat=True``)
is replaced by its plain primal once the policy recomputes the forward, and the scan splits
that shard_map. shardkit now binds the ring's forward as one primitive without a
partial-evaluation rule (``shardkit/_opaque.py``), which partial evaluation keeps whole. Plain
JAX, no shardkit.
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if "--gspmd" in sys.argv:
    jax.config.update("jax_use_shardy_partitioner", False)
mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))


def body(v):  # this device's block
    writes = 1 if "--one" in sys.argv else 2
    return sum(jnp.zeros_like(v).at[:].set(v) for _ in range(writes))


f = jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
layer = jax.checkpoint(lambda v, w: f(v * w)) if "--remat" in sys.argv else (lambda v, w: f(v * w))


def loss(ws, v):
    if "--no-scan" in sys.argv:
        for w in ws:
            v = layer(v, w)
        return v.sum()
    return lax.scan(lambda v, w: (layer(v, w), None), v, ws)[0].sum()


ws, v = jnp.ones((2, 8)), jnp.ones(8)
with jax.set_mesh(mesh):
    grad = jax.jit(jax.grad(loss))
    print(grad.lower(ws, v).compile() is not None and "compiled", jax.__version__)
    print(grad(ws, v), "ran")
