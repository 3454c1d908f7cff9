"""Checkpoint glue shared by the recipes: open the directory and resume from it."""

from __future__ import annotations

import shardkit as sk


def open_and_resume(directory: str | None, resume: bool, plan: sk.Plan, state: sk.TrainState, console):
    """Opens ``directory`` (None: no checkpoints) and, with ``resume``, restores its newest
    intact checkpoint onto ``plan`` — whatever mesh and ZeRO stage it was saved with.

    A newest step that fails verification (a flipped bit, a truncated or missing file) is
    skipped for the one before it, and the console says which steps were skipped and why; the
    damaged steps stay on disk untouched for inspection.

    Returns:
        ``(checkpointer or None, state, first step, data position or None)``; the position is
        the ``extra["data"]`` the recipe saved beside the state.
    """
    ckpt = sk.Checkpointer(directory, keep=3) if directory else None
    if not resume:
        return ckpt, state, 0, None
    state, extra = ckpt.resume(plan, like=state, fallback=True)
    if extra is None:
        console.print(f"no checkpoint in {directory} yet: starting from step 0")
        return ckpt, state, 0, None
    info = ckpt.last_restore
    for step, problems in info.skipped:
        console.print(f"checkpoint step {step} is corrupt, skipped (left on disk): "
                      + "; ".join(f"{leaf or 'the whole step'}: {what}" for leaf, what in problems))
    note = "" if info.verified else " (unverified: saved without checksums)"
    console.print(f"resumed from step {extra['step']} of {ckpt.directory}{note}")
    return ckpt, state, extra["step"], extra["data"]


def init_from(directory: str, plan: sk.Plan, state: sk.TrainState, console):
    """The newest checkpoint of ``directory`` restored as this run's start (``--init-from``): a
    data-parallel checkpoint warm-starts a DiLoCo run and a DiLoCo one resumes as DP
    (``Checkpointer.restore`` converts). Returns ``(state, its step, data position)``."""
    with sk.Checkpointer(directory) as src:
        state, extra = src.resume(plan, like=state)
    if extra is None:
        raise sk.checkpoint.CheckpointError(f"--init-from {directory}: no checkpoint there")
    console.print(f"initialised from step {extra['step']} of {src.directory}")
    return state, extra["step"], extra["data"]
