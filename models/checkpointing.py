"""Checkpoint glue shared by the recipes: open the directory and resume from it."""

from __future__ import annotations

import shardkit as sk


def open_and_resume(directory: str | None, resume: bool, plan: sk.Plan, state: sk.TrainState, console):
    """Opens ``directory`` (None: no checkpoints) and, with ``resume``, restores its newest
    checkpoint onto ``plan`` — whatever mesh and ZeRO stage it was saved with.

    Returns:
        ``(checkpointer or None, state, first step, data position or None)``; the position is
        the ``extra["data"]`` the recipe saved beside the state.
    """
    ckpt = sk.Checkpointer(directory, keep=3) if directory else None
    if not resume:
        return ckpt, state, 0, None
    state, extra = ckpt.resume(plan, like=state)
    if extra is None:
        console.print(f"no checkpoint in {directory} yet: starting from step 0")
        return ckpt, state, 0, None
    console.print(f"resumed from step {extra['step']} of {ckpt.directory}")
    return ckpt, state, extra["step"], extra["data"]
