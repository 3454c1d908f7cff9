"""Conditionals whose branch differs between devices, and collectives safe inside them.

An SPMD program runs one conditional on every device, but each device evaluates the branch
index itself. ``sk.pipeline``'s explicit schedules run one ``lax.switch`` per tick whose index
is the device's stage's operation: the stages take different branches, every device of one
stage the same. A collective in such a branch must not wait for a device of another stage. A
collective with replica groups (an all-reduce or all-gather over ``context`` or ``tensor``)
has groups inside a stage; a ``ppermute`` does not: it lowers to ONE collective-permute whose
pairs name every stage's devices, which ``cost.compiled.branches`` reads as one rendezvous of
all of them: a device of another stage that took another branch never arrives (a hang).
``ppermute`` here is the one that stays in the stage: under ``branching_over(axis)`` (set by
the executor while it traces its branches) it switches on the device's coordinate on that
axis among one permute per coordinate, each naming that stage's devices only. XLA:CPU meets
every permute of a program in one rendezvous whatever its pairs (``_gathered``), so there
the block is read off an all-gather; XLA:TPU cannot partition the context ring in such a
branch at all (``_context_tpu_nested``).

The readers of a compiled program (``cost.compiled``) find these conditionals by their named
scopes: ``STAGE_SCOPE`` (the branch is the stage: each device of a stage takes the same one)
and ``EVEN_SCOPE`` (a building block's switch whose branches run equally often over the
devices and calls, e.g. the context ring's two kinds of off-diagonal block), weighting each
branch ``1/n`` instead of counting every branch once per call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .xla import target_platform

STAGE_SCOPE = "shardkit_stage_branch"
EVEN_SCOPE = "shardkit_even_branches"

_BRANCHING: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "shardkit_branching_axis", default=None)


@contextlib.contextmanager
def branching_over(axis: str, size: int) -> Iterator[None]:
    """Declares that what is traced inside runs in a conditional whose branch each device
    picks by its coordinate on the manual mesh axis ``axis`` (of ``size``)."""
    token = _BRANCHING.set((axis, int(size)))
    try:
        yield
    finally:
        _BRANCHING.reset(token)


def branching_axis() -> tuple[str, int] | None:
    """``(axis, size)`` of the enclosing ``branching_over``, or None."""
    return _BRANCHING.get()


def ppermute(x, axis: str, perm: Sequence[tuple[int, int]]):
    """``lax.ppermute(x, axis, perm)``, kept inside the devices that take the same branch of
    the enclosing ``branching_over`` conditional (see the module docstring): ``perm`` is
    applied within each coordinate of that axis by a permute per coordinate."""
    branching = _BRANCHING.get()
    if branching is None or branching[1] == 1 or branching[0] == axis:
        return lax.ppermute(x, axis, perm)
    outer, p = branching
    n = lax.axis_size(axis)
    if target_platform() == "cpu":
        return _gathered(x, axis, perm, n)
    names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    # A permute over two axes numbers the devices in the mesh's axis order.
    first = names.index(outer) < names.index(axis)
    both = (outer, axis) if first else (axis, outer)

    def within(s: int) -> Callable:
        at = (lambda d: s * n + d) if first else (lambda d: d * p + s)  # noqa: E731
        pairs = [(at(a), at(b)) for a, b in perm]
        return lambda x: lax.ppermute(x, both, pairs)

    with jax.named_scope(STAGE_SCOPE):
        return lax.switch(lax.axis_index(outer), [within(s) for s in range(p)], x)


def _gathered(x, axis: str, perm, n: int):
    """The permute's result read off an all-gather over ``axis`` (groups inside the stage).
    XLA:CPU meets every collective-permute of a program in one rendezvous of all its devices
    keyed by channel (jax gives them all channel 1), whatever the pairs: stages in different
    branches then matched different permutes and exchanged the wrong blocks. Its all-gathers
    meet per replica group. ``n``× the bytes of a permute: XLA:CPU only."""
    src = np.full(n, -1, np.int32)
    for a, b in perm:
        src[b] = a
    mine = jnp.asarray(src)[lax.axis_index(axis)]

    def one(a):
        got = lax.dynamic_index_in_dim(lax.all_gather(a, axis), jnp.maximum(mine, 0), 0, keepdims=False)
        return jnp.where(mine >= 0, got, jnp.zeros_like(a))

    return jax.tree.map(one, x)


def even_switch(index, branches: Sequence[Callable], *operands):
    """``lax.switch`` for branches taken equally often over the devices and calls (the
    readers weight each ``1/len(branches)``; see the module docstring)."""
    with jax.named_scope(EVEN_SCOPE):
        return lax.switch(index, list(branches), *operands)
