"""Checkpoints on Orbax: save a sharded ``TrainState`` from every host, restore it onto any plan.

A checkpoint is a plain Orbax ``CheckpointManager`` directory: one subdirectory per step with three
items, ``state`` (the whole ``TrainState`` as a ``StandardSave`` pytree: every host writes its own
shards, nothing is gathered), ``extra`` (a JSON dict: data-iterator position, config) and
``checksums`` (JSON: one checksum per array, and one of ``extra``). Restores always go through an
abstract target carrying the *new* plan's shardings, so a checkpoint saved on ``data=8`` ZeRO-0
loads onto ``fsdp=4,tensor=2`` ZeRO-3 (Orbax reads each device's slice), and never silently onto
the mesh it was saved with.

Safety comes from Orbax's atomic commit (a save is written to ``<step>.orbax-checkpoint-tmp-*``
and renamed when complete; old steps are deleted only after that), plus checks here: non-finite
states are refused, a checkpoint whose tree or shapes differ from the target is reported leaf by
leaf before anything is read, and every array read back is checked against its checksum before
``restore`` returns (Orbax and TensorStore verify their index, not array data: a flipped bit in a
chunk would otherwise come back as a wrong number). ``fallback=True`` goes back to the newest
intact step and never touches the damaged one.

Modules: ``checkpointer`` (``Checkpointer``, ``RestoreInfo``, retention), ``reading`` (reading and
verifying one step), ``checksums`` (the layout-independent per-array checksum and its record),
``damage`` (missing/truncated files from the index, what a read error names), ``tree`` (leaf paths,
non-finite leaves, tree mismatches, the abstract restore target), ``errors``, ``preemption``
(``PreemptionGuard``).
"""

from .checkpointer import Checkpointer as Checkpointer
from .checkpointer import RestoreInfo as RestoreInfo
from .checksums import array_checksums as array_checksums
from .errors import CheckpointError as CheckpointError
from .errors import CorruptCheckpointError as CorruptCheckpointError
from .preemption import PreemptionGuard as PreemptionGuard
from .tree import abstract_target as abstract_target
from .tree import leaf_paths as leaf_paths
from .tree import nonfinite_leaves as nonfinite_leaves
from .tree import tree_mismatches as tree_mismatches

__all__ = ["Checkpointer", "CheckpointError", "CorruptCheckpointError", "PreemptionGuard", "RestoreInfo",
           "abstract_target", "array_checksums", "leaf_paths", "nonfinite_leaves", "tree_mismatches"]
