"""A model written elsewhere through every pipeline schedule: flaxmodels' GPT-2 blocks
(``pip install flaxmodels``; random init, nothing downloaded) stacked for ``sk.pipeline``.

The recipe for any Flax Linen block ``block`` with ``block.apply(variables, x) -> x``:

1. initialise one block per layer and stack their parameter trees on a new leading axis
   (``stack_blocks``): ``sk.pipeline`` splits that axis over the ``pipe`` mesh axis;
2. the stage function applies ONE block to a microbatch: ``lambda lp, h: block.apply({"params":
   lp}, h)`` (GPT-2's block returns ``(x, present)``: keep ``x``);
3. whatever changes the width (embedding, final norm and head) runs outside the pipeline, or in
   ``loss_fn`` with its weights as ``loss_params`` (the explicit schedules need the loss inside).

    python examples/third_party_gpt2_pipeline.py        # 2 stages, every schedule vs one device
"""

from __future__ import annotations

import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))


def config(d: int = 16, heads: int = 2, seq: int = 8) -> types.SimpleNamespace:
    """A tiny GPT-2 configuration (the fields flaxmodels' blocks read); no dropout."""
    return types.SimpleNamespace(n_embd=d, n_head=heads, n_positions=seq, n_inner=None, attn_pdrop=0.0,
                                 resid_pdrop=0.0, embd_pdrop=0.0, scale_attn_weights=True,
                                 activation_function="gelu_new", layer_norm_epsilon=1e-5)


def stack_blocks(block, layers: int, x, seed: int = 0):
    """``layers`` independently initialised blocks' params stacked on a leading layer axis
    (one ``init`` per key, vmapped: the same as stacking ``layers`` separate inits)."""
    keys = jax.random.split(jax.random.key(seed), layers)
    return jax.jit(jax.vmap(lambda k: block.init(k, x)["params"]))(keys)


def problem(layers: int = 4, batch: int = 8, seed: int = 0):
    """(block, stacked params, head params, x, targets) of a regression on GPT-2 blocks."""
    from flaxmodels.gpt2.gpt2 import GPT2Block

    cfg = config()
    block = GPT2Block(cfg)
    k = jax.random.split(jax.random.key(seed + 1), 3)
    x = jax.random.normal(k[0], (batch, cfg.n_positions, cfg.n_embd))
    params = stack_blocks(block, layers, x[:1], seed)
    head = {"w": jax.random.normal(k[1], (cfg.n_embd, 2)) / np.sqrt(cfg.n_embd)}
    targets = jax.random.normal(k[2], (batch, cfg.n_positions, 2))
    return block, params, head, x, targets


def head_loss(hp, y, t):
    return jnp.mean((y @ hp["w"] - t) ** 2)


def stage_fn(block):
    return lambda lp, h: block.apply({"params": lp}, h)[0]


def sequential_loss(block, params, head, x, t):
    """The one-device model: the stacked blocks in a scan."""
    layer = stage_fn(block)
    return head_loss(head, jax.lax.scan(lambda h, lp: (layer(lp, h), None), x, params)[0], t)


def pipelined_loss(block, schedule: str, repeats: int, mesh, microbatches: int = 4):
    import shardkit as sk

    def loss(params, head, x, t):
        return sk.pipeline(stage_fn(block), params, x, microbatches=microbatches, schedule=schedule,
                           repeats=repeats, loss_fn=head_loss, loss_params=head, targets=t, mesh=mesh)
    return loss


def train(block, loss, params, head, x, t, steps: int = 2, lr: float = 0.01):
    """``steps`` of SGD on (params, head); returns the losses and the final params. The steps
    are one compiled program (a scan over them): a step's updated parameters come back sharded
    as the pipeline left them, so a Python loop would compile the step twice."""
    def one(carry, _):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1))(*carry, x, t)
        return jax.tree.map(lambda a, g: a - lr * g, carry, grads), value

    @jax.jit
    def run(params, head):
        (params, _), losses = jax.lax.scan(one, (params, head), length=steps)
        return losses, params

    losses, params = run(params, head)
    return [float(v) for v in losses], params


def main(argv=None) -> int:
    import shardkit as sk

    block, params, head, x, t = problem()
    mesh = sk.make_mesh("pipe=2", devices=jax.devices()[:2])
    want, _ = train(block, lambda *a: sequential_loss(block, *a), params, head, x, t)
    print(f"one device: losses {want}")
    for schedule, v in SCHEDULES:
        got, _ = train(block, pipelined_loss(block, schedule, v, mesh), params, head, x, t)
        print(f"{schedule:17s} losses {got}  max |diff| {np.max(np.abs(np.subtract(got, want))):.2e}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", 8)
    sys.exit(main(sys.argv[1:]))
