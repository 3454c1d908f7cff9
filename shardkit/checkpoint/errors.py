"""What checkpoint operations raise, and the one-line form of an error that their messages quote."""

from __future__ import annotations

import os


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked (the message says why and what to do)."""


class CorruptCheckpointError(CheckpointError):
    """A saved step is damaged: an array's checksum differs, a file is missing or truncated, an
    array is missing, or its metadata is unreadable.

    Attributes:
        directory: the checkpoint directory.
        step: the damaged step (left exactly as it is on disk).
        problems: ``((leaf path, what is wrong), ...)``; the path is ``""`` when the damage is to
            something all arrays share (the step's index or metadata).
    """

    def __init__(self, directory: str, step: int, problems: list[tuple[str, str]], steps: list[int]):
        self.directory, self.step, self.problems = directory, step, tuple(problems)
        lines = "\n".join(f"  {leaf or '(the whole step)'}: {what}" for leaf, what in problems)
        older = [s for s in steps if s < step]
        alt = (f"restore(..., fallback=True) / resume(..., fallback=True) go back to the newest intact step "
               f"(older complete steps: {older})" if older else "no older step to fall back to: start without resuming")
        super().__init__(
            f"checkpoint step {step} in {directory} is corrupt:\n{lines}\n{alt}. shardkit never deletes or "
            f"changes a damaged step: inspect {os.path.join(directory, str(step))}, then delete it yourself.")


def first_line(e: BaseException | str) -> str:
    """The first line of an error (or of a text), at most 500 characters, to quote in a report."""
    text = e if isinstance(e, str) else (str(e) or repr(e))
    return text.strip().splitlines()[0][:500] if text.strip() else type(e).__name__
