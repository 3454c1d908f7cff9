"""What an explicit schedule's F keeps for its chunk-microbatch's backward (``pipeline(keep=)``).

``keep="input"`` keeps the stage input only (it waits in the schedule's activation ring
anyway): every backward op recomputes its chunk's forward from it, 4/3 of the layers' flops,
and one microbatch's residuals are alive at a time. ``keep="all"`` keeps every residual of
the chunk's ``jax.vjp`` (Megatron-LM's 1F1B: no recompute; Narayanan et al. 2021), and a
``jax.checkpoint`` policy (``keep=jax.checkpoint_policies.dots_saveable``, ``"dots"``) keeps
that policy's saved set (selective recompute: Korthikanti et al. 2022 keep the matmul
outputs and recompute the rest). ``keep="lean"`` keeps the values a layer names with
``jax.ad_checkpoint.checkpoint_name`` as one of ``LEAN_RESIDUALS``: what the backward needs
that only a matmul could give again (the residual stream between the attention and the MLP,
q, k, v, the attention's output and its log-sum-exp, which ``sk.attention``'s and
``sk.context_attention``'s flash kernels name so that their backward never reruns their
forward, the MLP's gate and up projections); the norms, the
activation function and the sequence-parallel gathers of a normed input are recomputed from
them and the layer's input (the stage input, kept anyway, or in a chunk of several
layers each layer's input, which the pipeline's layer scan names ``"layer_input"``) — Korthikanti et al. 2022's
selective recompute less the normed inputs, about 19 bytes per token and d_model over the
tensor ranks per layer for Llama-like widths. The kept residuals wait in a ring sized from the schedule
table (``Schedule.res_ring``: the most chunk-microbatches in flight on a stage), the loss's
in a second one (``Schedule.loss_res_ring``: under a policy, the policy's saved set or all of
the loss's own residuals, whichever is smaller, ``Kept.loss_shapes``); a zero-bubble B reads them instead of
recomputing, and its W still reads what B left it (``split``).

A pullback is stored as its residual leaves: ``jax.vjp``'s pullback is a pytree whose leaves
are the residuals and whose structure (the linearized jaxpr) is static. Leaves that are the
op's own inputs (the chunk's weights, its stage input, the loss's parameters) are not
stored: the backward op has them again and puts them back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..kernels.kept import OUTPUT, STATS
from .stage import REMAT

KEEP = ("input", "all", "dots", "lean")

# keep="lean": the values a layer's backward needs that no elementwise op, norm or gather can
# give again — the outputs of its matmuls and of its residual add between the attention and the
# MLP (the layer input is the stage input, or a layer scan's saved carry). A layer names them
# with jax.ad_checkpoint.checkpoint_name(x, name); the same policy works as a plain remat
# (jax.checkpoint(layer, policy=lean_policy())).
# "layer_input" is named by sk.pipeline's own layer scan (a chunk of several layers); the
# attention's output and log-sum-exp by sk.attention's and sk.context_attention's kernels
# (kernels/kept.py: the values their custom VJPs keep, so no kernel forward runs again).
LEAN_RESIDUALS = ("layer_input", "residual", "attention_q", "attention_k", "attention_v", OUTPUT, STATS,
                  "mlp_gate", "mlp_up")


def lean_policy() -> Callable:
    """The ``jax.checkpoint`` policy of ``keep="lean"``: save the values named as one of
    ``LEAN_RESIDUALS``, recompute the rest."""
    return jax.checkpoint_policies.save_only_these_names(*LEAN_RESIDUALS)


def check_named(keep, names) -> None:
    """``keep="lean"`` with a layer that names none of ``LEAN_RESIDUALS`` (``names``: the
    checkpoint names its trace gives) would keep nothing and recompute all: refuse it."""
    if keep == "lean" and not set(names) & set(LEAN_RESIDUALS):
        raise ValueError(f"keep='lean' keeps the values stage_fn names with jax.ad_checkpoint.checkpoint_name "
                         f"as one of {LEAN_RESIDUALS}, but it names none of them (names found: {sorted(names)}); "
                         "name its matmul outputs so, or pass keep='all', 'dots', or a jax.checkpoint policy")


def keep_policy(keep) -> Callable | str | None:
    """The ``with_remat`` setting of the kept forward: ``None`` for ``"input"`` (nothing kept
    beyond the stage input), ``"none"`` (save everything) for ``"all"``, else the policy."""
    if isinstance(keep, str):
        if keep not in KEEP:
            raise ValueError(f"unknown keep {keep!r}; choose one of {KEEP} or pass a jax.checkpoint "
                             "policy (e.g. jax.checkpoint_policies.dots_saveable, or "
                             "jax.checkpoint_policies.save_only_these_names('name', ...))")
        if keep == "lean":
            return lean_policy()
        return None if keep == "input" else "none" if keep == "all" else REMAT[keep]
    if callable(keep):
        return keep
    raise ValueError(f"keep must be one of {KEEP} or a jax.checkpoint policy (a callable), got "
                     f"{type(keep).__name__} {keep!r}")


class Pullbacks:
    """``jax.vjp`` of one function, its pullback stored as the residual leaves that are not
    among ``reuse`` (values the backward op has again) and not the same for every microbatch.
    The structure is recorded by the trace that makes the residuals and read by the traces
    that rebuild them.

    A residual that depends on no per-microbatch value — a constant such as the RoPE tables a
    layer closes over (4 MiB per Llama 3 405B layer at 8K, whole on every tensor rank), or a
    view of the weights such as the layer scan's per-layer slice of them (the layer's bf16
    weights: 760 MiB per slot at 405B under ``keep="all"``, 0.74 of its 1.76 GiB) — is not
    stored: ``shapes`` finds them in its trace, and the backward op computes them again from
    the weights it has and the values they close over."""

    def __init__(self):
        self._structure = None  # (treedef, ((leaf position, reuse leaf index), ...))
        # (jaxpr of the shared leaves, its closed-over values, their positions, the reuse
        # leaf each of its inputs is)
        self._shared = None

    def vjp(self, fn, primals: tuple, reuse) -> tuple:
        """``(fn(*primals), stored residual leaves)``."""
        out, pull = jax.vjp(fn, *primals)
        leaves, treedef = jax.tree.flatten(pull)
        again = {id(a): i for i, a in enumerate(jax.tree.leaves(reuse))}
        fixed = set(self._shared[2]) if self._shared else set()
        self._structure = (treedef, tuple((n, again[id(a)]) for n, a in enumerate(leaves) if id(a) in again))
        return out, [a for n, a in enumerate(leaves) if id(a) not in again and n not in fixed]

    def shapes(self, fn_of, primals: tuple, context, reuse_at, shared_at=(0,)) -> list:
        """Shapes and dtypes of the stored leaves (for the ring): of ``fn_of(context)``'s
        ``vjp`` at ``primals``, ``reuse_at`` the positions of the primals the backward op has
        again, ``shared_at`` those of them that are the same for every microbatch (the
        weights). ``context`` (what the op's function closes over) is traced, as in the op.
        Run before the ops are traced: it settles which leaves are not stored."""
        from jax._src.interpreters.partial_eval import dce_jaxpr

        closed = jax.make_jaxpr(lambda primals, context: jax.tree.leaves(jax.vjp(fn_of(context), *primals)[1]))(
            primals, context)
        # the jaxpr's inputs are the primals' leaves, then the context's
        sizes = [len(jax.tree.leaves(p)) for p in primals]
        starts = [sum(sizes[:i]) for i in range(len(primals))]
        reuse_flat = [starts[i] + j for i in reuse_at for j in range(sizes[i])]
        shared = {starts[i] + j for i in shared_at for j in range(sizes[i])}
        n_out = len(closed.jaxpr.outvars)

        def needs(n):
            return {i for i, u in enumerate(dce_jaxpr(closed.jaxpr, [i == n for i in range(n_out)])[1]) if u}

        fixed = tuple(n for n in range(n_out) if needs(n) <= shared)
        self._shared = None
        if fixed:
            jaxpr, used = dce_jaxpr(closed.jaxpr, [n in fixed for n in range(n_out)])
            at = tuple(reuse_flat.index(i) for i, u in enumerate(used) if u)
            self._shared = (jaxpr, closed.consts, fixed, at)

        def stored(primals, context):
            return self.vjp(fn_of(context), primals, tuple(primals[i] for i in reuse_at))[1]

        return jax.eval_shape(stored, primals, context)

    def pullback(self, stored, reuse):
        """The pullback again, from what ``vjp`` stored and the same ``reuse`` values."""
        from jax._src.core import eval_jaxpr

        if self._structure is None:
            raise RuntimeError("Pullbacks.pullback traced before vjp or shapes")
        treedef, at = self._structure
        again, stored = dict(at), iter(stored)
        reused, shared = jax.tree.leaves(reuse), {}
        if self._shared:
            jaxpr, consts, fixed, args = self._shared
            shared = dict(zip(fixed, eval_jaxpr(jaxpr, consts, *[reused[i] for i in args])))
        leaves = [reused[again[n]] if n in again else shared[n] if n in shared else next(stored)
                  for n in range(treedef.num_leaves)]
        return jax.tree.unflatten(treedef, leaves)


class Kept:
    """An explicit schedule's kept residuals: the chunk's pullbacks, the loss's, and the loss
    function F runs (``loss_shapes``; the chunk is wrapped in the keep policy by its runner)."""

    def __init__(self, loss_fn: Callable, policy, loss_policy=None):
        """``loss_policy``: the loss's policy where it is not the chunk's (``keep="lean"``: a
        loss names no layer residuals, so its matmul outputs, ``dots_saveable``, and never a
        recompute of the head's matmul)."""
        self.policy = policy
        loss_policy = policy if loss_policy is None else loss_policy
        # Under a policy, the loss as it is too: ``loss_shapes`` keeps the one that stores less.
        self._loss_fns = (loss_fn,) if loss_policy == "none" else (jax.checkpoint(loss_fn, policy=loss_policy),
                                                                   loss_fn)
        self.loss_fn = self._loss_fns[0]
        self.chunk, self.loss = Pullbacks(), Pullbacks()

    def loss_shapes(self, loss_params, y, targets) -> list:
        """Shapes and dtypes of what the loss's F stores (one slot of the loss ring), for a
        microbatch's ``y`` and ``targets``; settles the loss F runs, before any op traces it:
        under the policy, or — where that stores more — the loss with all its own residuals.
        A loss with its own VJP keeps less than a policy that reaches into it:
        ``sk.chunked_cross_entropy`` keeps each position's log-sum-exp, and ``dots`` would
        save every chunk's logits there, the (rows, T, V) f32 its chunking exists to avoid."""
        def stored(fn, pulls):
            return pulls.shapes(lambda t: lambda LP, y: fn(LP, y, t).astype(jnp.float32), (loss_params, y),
                                targets, reuse_at=(0,))

        options = [(fn, Pullbacks()) for fn in self._loss_fns]
        shapes = [stored(fn, pulls) for fn, pulls in options]
        nbytes = [sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(s)) for s in shapes]
        best = nbytes.index(min(nbytes))  # the policy's on a tie
        (self.loss_fn, self.loss), kept = options[best], shapes[best]
        return kept
