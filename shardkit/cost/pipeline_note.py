"""What ``sk.pipeline`` did inside a step's loss, as the cost model reads it: its trace note as
a typed record (``PipelineNote``), the schedule table it executes (``schedule_table``: the one
builder, for the analytic model and the compiled reader alike) and how often each branch of the
explicit executor's per-tick switch runs (``pipeline_branch_weights``: what the compiled HLO
reader weights that conditional by).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..pipeline import schedules as sched


@dataclasses.dataclass(frozen=True)
class PipelineNote:
    """What ``sk.pipeline`` did inside a step's loss, as its trace note says
    (``plan.note("pipeline", ...)``), or what a ``Layout``'s pipeline would do.

    Attributes:
        stages, microbatches, repeats, schedule: the pipeline's (``sk.pipeline``'s arguments).
        axis: the mesh axis of the stages.
        data_axes: the data axes its shard_map made manual (``()``: they stayed with the
            compiler, a pipeline with ``rng``); None where unknown (an override, a layout),
            taken as manual.
        keep: what a chunk's forward keeps for its backward (``"input"``, else a policy).
        stage_residuals, w_saved: ``(shape, dtype)`` of what a chunk's forward saves and of
            ZB's pending W's, on a GPU/TPU target's trace (``plan.detailed_notes``), else None.
        w_forwarded: per ``w_saved`` value, whether it is a residual of the layers' forward
            (``SplitBackward.forwarded``), else None.
        chunk_backward: the jaxpr of one explicit backward op (same condition), else None.
        kept, loss_kept: ``(shape, dtype)`` of one slot of the kept-residual rings
            (``sk.pipeline(keep=...)``: the chunk's, ZB's per-layer linearizations; the
            loss's), where F keeps residuals, else None.
    """

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1
    axis: str = "pipe"
    data_axes: tuple[str, ...] | None = None
    keep: str = "input"
    stage_residuals: tuple | None = None
    w_saved: tuple | None = None
    w_forwarded: tuple | None = None
    chunk_backward: Any = None
    kept: tuple | None = None
    loss_kept: tuple | None = None

    @classmethod
    def of(cls, note: "PipelineNote | Mapping[str, Any]") -> "PipelineNote":
        """A note as the record (a trace note's dict, or a dict naming some of the fields)."""
        if isinstance(note, cls):
            return note
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(note) - fields)
        if unknown:
            raise ValueError(f"a pipeline note has no field(s) {unknown}; its fields are {sorted(fields)}")
        kw = dict(note)
        if kw.get("data_axes") is not None:
            kw["data_axes"] = tuple(kw["data_axes"])
        return cls(**kw)

    @property
    def manual_data(self) -> bool:
        """The data axes are manual inside the pipeline (unknown counts as manual)."""
        return self.data_axes is None or bool(self.data_axes)


def schedule_table(note: PipelineNote) -> sched.Schedule:
    """The table ``sk.pipeline`` executes for this note (GPipe/circular: forward + mirror)."""
    return sched.pipeline_schedule(note.schedule, note.stages, note.microbatches, note.repeats)


def is_explicit(note: PipelineNote) -> bool:
    """The schedule runs its backward inside the pipeline (1F1B, interleaved 1F1B, ZB-H1):
    one ``lax.switch`` branch per tick, stage inputs in rings, the forward recomputed."""
    return note.schedule in sched.EXPLICIT


def pipeline_branch_weights(note: Mapping[str, Any]) -> dict[int, list[float]] | None:
    """The explicit pipeline executor's per-tick ``lax.switch`` (1F1B, interleaved 1F1B,
    ZB-H1): the fraction of (tick, stage) cells of the schedule table taking each branch, for
    the conditional inside ``sched.EXPLICIT_SCOPE`` only (``note``: the trace note's dict, or a
    dict naming some of ``PipelineNote``'s fields)."""
    if note.get("schedule") not in sched.EXPLICIT:
        return None
    pairs, index = sched.switch_branches(schedule_table(PipelineNote.of(note)))
    return {sched.EXPLICIT_SCOPE: [float(np.mean(index == k)) for k in range(len(pairs))]}
