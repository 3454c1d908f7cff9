"""The zero-bubble backward split without recompute: B keeps what W needs.

Zero-bubble schedules (Qi et al., ICLR 2024; their V-shaped variant, Qi et al. 2024,
"Pipeline Parallelism with Controllable Memory") split a chunk's backward into B, the input
gradient (on the critical path: it is sent upstream at once), and W, the weight gradient (run
later, in what would be the bubble). Done as two ``jax.vjp``s of the chunk, each recomputes
the chunk's forward, and W also carries the input cotangent through the layer scan again:
twice the layers' flops where 1F1B does 4/3.

Here B runs the chunk's forward once, layer by layer, keeping each layer's linearization (the
residual leaves of its ``jax.vjp``, without the layer's weights, which W reads from the stage
again), then walks the layers backwards taking only the input part of each layer's transpose
and keeping every layer's output cotangent. W then applies the weight part of the same
per-layer transposes to those cotangents: only the weight-gradient matmuls (XLA drops the
unused half of each transpose). Flops per microbatch: F (the F op) + F + B (the B op) + W =
1F1B's. The price is memory: a pending W holds its chunk's per-layer residuals and output
cotangents from its B to its W; the schedule bounds how many are pending at once
(``Schedule.pending_w``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


class SplitBackward:
    """``input_grad`` (B) and ``weight_grad`` (W) of a chunk of ``k`` layers.

    ``layer(lp, h, j, group, mb, extras_mb)`` applies layer ``j`` of the chunk; a layer's
    linearization is stored as the leaves of its ``jax.vjp`` pullback minus the weights. Its
    tree structure (static, free of tracers) is recorded when B or ``saved_shapes`` traces it.
    """

    def __init__(self, layer, k: int):
        self.layer, self.k = layer, k
        self._structure = None  # (treedef, ((leaf position, weight leaf index), ...))

    def _linearize(self, lp, h, j, ctx):
        y, pull = jax.vjp(lambda lp, h: self.layer(lp, h, j, *ctx), lp, h)
        leaves, treedef = jax.tree.flatten(pull)
        weight = {id(a): i for i, a in enumerate(jax.tree.leaves(lp))}
        self._structure = (treedef, tuple((n, weight[id(a)]) for n, a in enumerate(leaves) if id(a) in weight))
        return y, [a for a in leaves if id(a) not in weight]

    def _pullback(self, lp, kept):
        if self._structure is None:
            raise RuntimeError("SplitBackward: weight_grad traced before input_grad or saved_shapes")
        treedef, at = self._structure
        leaves, weights = list(kept), jax.tree.leaves(lp)
        for n, i in at:
            leaves.insert(n, weights[i])
        return jax.tree.unflatten(treedef, leaves)

    def forward(self, weights, h, ctx):
        """The chunk's output and what W needs of it: per-layer residuals stacked (k, ...)."""
        def step(h, xs):
            lp, j = xs
            return self._linearize(lp, h, j, ctx)

        return lax.scan(step, h, (weights, jnp.arange(self.k)))

    def input_grad(self, weights, kept, g):
        """B after ``forward``: the input cotangent of the chunk, and what W needs (the per-layer
        residuals, each layer's output cotangent)."""
        def step(g, xs):
            lp, res = xs
            return self._pullback(lp, res)(g)[1], g  # the input half only; keep g for W

        d_h, gs = lax.scan(step, g, (weights, kept), reverse=True)
        return d_h, (kept, gs)

    def weight_grad(self, weights, saved):
        """W: the chunk's weight gradient from B's saved residuals and cotangents."""
        kept, gs = saved

        def step(_, xs):
            lp, res, g = xs
            return None, self._pullback(lp, res)(g)[0]  # the weight half only

        return lax.scan(step, None, (weights, kept, gs))[1]

    def saved_shapes(self, weights, h, ctx):
        """Shapes and dtypes of what one pending W holds (for its ring buffer)."""
        def saved(weights, h):
            return self.forward(weights, h, ctx)[1], jnp.zeros((self.k,) + h.shape, h.dtype)

        return jax.eval_shape(saved, weights, h)
