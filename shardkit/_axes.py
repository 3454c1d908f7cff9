"""Which mesh axes a training run uses, and the error for one that nothing uses.

A mesh axis of size > 1 that no rule, batch axis (the ZeRO data axes are the batch axes) or
building block uses makes its devices repeat each other's work: ``--mesh data=2,tensr=4``
trains on 2 devices' worth of work with 8. What uses an axis:

* the plan, statically: an axis in a ``PathRules`` spec or an ``AxisRules`` entry, a batch
  axis, or an axis the plan is told is left unused on purpose (``Plan(unused_axes=...)``);
* the step, while it is traced: an axis in a parameter's or model-state leaf's resolved spec
  (Flax metadata may name mesh axes directly), in an ``sk.constrain`` spec, or claimed by a
  building block that owns it (``sk.pipeline``, ``sk.context_attention``, ``sk.moe``,
  ``sk.DiLoCo``), each of which calls ``claim_axes``.

``checking_axes(plan)`` wraps a traced step: on leaving it, every axis must be used, else a
``ShardingError`` names it, before anything is compiled.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable

from .rules import ShardingError, spec_axes

# Names the building blocks and recipes use; quoted when an axis nothing uses may be a typo.
STANDARD = ("replica", "data", "fsdp", "tensor", "sequence", "pipe", "expert", "context")
_CLAIMED: contextvars.ContextVar["set | None"] = contextvars.ContextVar("shardkit_claimed_axes", default=None)


def claim_axes(*axes: str) -> None:
    """Records that the program being traced uses these mesh axes (a building block's axis,
    an activation constraint's); a no-op outside a checked trace."""
    claimed = _CLAIMED.get()
    if claimed is not None:
        claimed.update(a for a in axes if a)


def plan_axes(plan, unused: bool = True) -> set[str]:
    """Axes the plan itself uses: its rules' specs, its AxisRules entries (those the mesh has),
    its batch (= ZeRO data) axes and (``unused``) the axes it leaves unused on purpose."""
    names = set(plan.mesh.axis_names)
    used = set(plan.batch_axes) | (set(plan.unused_axes) if unused else set())
    if plan.rules is not None:
        used.update(a for _, spec in plan.rules.rules for a in spec_axes(spec))
    if plan.axis_rules is not None:
        used.update(a for _, axes in plan.axis_rules.entries for a in axes)
    return used & names


def unused(plan, also: Iterable[str] = ()) -> list[str]:
    """The mesh axes of size > 1 nothing uses (``also``: axes the traced step used)."""
    used = plan_axes(plan) | set(also)
    return [a for a, n in plan.mesh.shape.items() if n > 1 and a not in used]


def check(plan, also: Iterable[str] = ()) -> None:
    """Raises ``ShardingError`` naming every mesh axis of size > 1 nothing uses.

    Raises:
        ShardingError: such an axis, with its size, what could use it, and the fix.
    """
    idle = unused(plan, also)
    if not idle:
        return
    sizes = dict(plan.mesh.shape)
    mesh = ",".join(f"{a}={n}" for a, n in sizes.items())
    named = ", ".join(f"{a!r} (size {sizes[a]})" for a in idle)
    problems = [f"mesh axis {a!r} (size {sizes[a]}): no PathRules spec, AxisRules entry, batch axis "
                f"{tuple(plan.batch_axes)}, parameter spec, sk.constrain or building block "
                "(sk.pipeline, sk.context_attention, sk.moe, sk.DiLoCo) uses it" for a in idle]
    raise ShardingError(
        f"mesh {mesh}: {named} used by nothing, so its devices would repeat each other's work "
        f"(is it a misspelt standard axis: {', '.join(STANDARD)}?):", problems,
        fix=f"use {idle[0]!r} in a rule (e.g. AxisRules({{'mlp': {idle[0]!r}}})) or the batch axes "
            "(Plan(batch_axes=...)), fix its spelling, drop it from the mesh, or keep it on purpose (or for "
            f"your own shard_map, which the plan cannot see) with Plan(..., unused_axes=({idle[0]!r},))")


@contextlib.contextmanager
def checking_axes(plan, also: Iterable[str] = ()):
    """Inside, ``claim_axes`` calls are collected; on a normal exit ``check(plan)`` runs with
    them and ``also``. Nested inside another ``checking_axes`` (``sk.DiLoCo``'s replicas run
    the step's body), it adds to the outer collection and leaves the check to it."""
    claimed = _CLAIMED.get()
    if claimed is not None:
        claimed.update(also)
        yield
        return
    claimed = set(also)
    token = _CLAIMED.set(claimed)
    try:
        yield
    finally:
        _CLAIMED.reset(token)
    check(plan, claimed)
