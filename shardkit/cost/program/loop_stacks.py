"""Stacked layers' weights and gradients that a loop holds one layer at a time.

A model whose layers run in a ``lax.scan`` keeps its weights as stacks (layers, ...) and gets
its gradients back as stacks. Where ZeRO-3 (or FSDP) stores the weights sharded over the data
axes, XLA gathers each layer's slice inside the loop, right before its use: the stack itself,
and its cast to the compute dtype outside the loop, stay in the stored layout. Where the
gradients are reduced into ZeRO's shard (``roles.grads_on_shard``), XLA reduce-scatters each
layer's slice inside the backward loop and writes only the shard into the stacked output.
Sizing those stacks at the gathered compute layout counted a whole unsharded copy of the
model twice (the recipe's 7B on 64 H100s at ZeRO-3: 35 GiB of activations estimated, 13 GiB
compiled; BENCHMARKS.md, "The 7B against sequence length").

``loop_held`` names those values of the top-level jaxpr and by how much each is smaller than
its compute layout says.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax._src import core as jcore

from .op_kinds import VIEW

_LOOPS = ("scan", "while")


def loop_held(jaxpr: jcore.Jaxpr, n_params: int, stored_split: Sequence[float],
              grad_split: Sequence[float]) -> dict:
    """``{var: factor}``: top-level values a loop reads or writes one layer at a time, and how
    many times smaller than their compute layout they are per device.

    Args:
        jaxpr: a loss's ``value_and_grad`` jaxpr: parameters first, ``(loss, *grads)`` out.
        n_params: the number of parameter leaves.
        stored_split: per leaf, compute-layout bytes over stored-layout bytes (ZeRO-3's gather).
        grad_split: per leaf, compute-layout bytes over the bytes of the gradient a loop
            writes (ZeRO's shard where gradients are reduced into it, else 1).
    """
    consumers: dict = {}
    producer: dict = {}
    for e in jaxpr.eqns:
        for u in e.invars:
            if not isinstance(u, jcore.Literal):
                consumers.setdefault(u, []).append(e)
        for v in e.outvars:
            producer[v] = e
    outputs = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}

    def loop_only(v) -> bool:
        uses = consumers.get(v, ())
        return bool(uses) and v not in outputs and all(
            e.primitive.name in _LOOPS or (e.primitive.name in VIEW and all(map(loop_only, e.outvars)))
            for e in uses)

    held: dict = {}
    for leaf, v in enumerate(jaxpr.invars[:n_params]):
        if stored_split[leaf] <= 1:
            continue
        views = [e.outvars[0] for e in consumers.get(v, ()) if e.primitive.name in VIEW]
        while views:
            w = views.pop()
            if loop_only(w):
                held[w] = stored_split[leaf]
                views += [e.outvars[0] for e in consumers.get(w, ()) if e.primitive.name in VIEW]
    for leaf, g in enumerate(jaxpr.outvars[1:1 + n_params]):
        if grad_split[leaf] <= 1 or isinstance(g, jcore.Literal):
            continue
        chain = []
        while g in producer and producer[g].primitive.name in VIEW:
            chain.append(g)
            g = producer[g].invars[0]
        if g in producer and producer[g].primitive.name in _LOOPS:
            for w in chain + [g]:
                held[w] = grad_split[leaf]
    return held
