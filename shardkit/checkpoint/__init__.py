"""Checkpoints on Orbax (moved here from ``shardkit/checkpoint.py``; split into modules next)."""

from .checkpointer import (Checkpointer as Checkpointer, CheckpointError as CheckpointError,
                           CorruptCheckpointError as CorruptCheckpointError, PreemptionGuard as PreemptionGuard,
                           RestoreInfo as RestoreInfo, abstract_target as abstract_target,
                           array_checksums as array_checksums, leaf_paths as leaf_paths,
                           nonfinite_leaves as nonfinite_leaves, tree_mismatches as tree_mismatches)

__all__ = ["Checkpointer", "CheckpointError", "CorruptCheckpointError", "PreemptionGuard", "RestoreInfo",
           "abstract_target", "array_checksums", "leaf_paths", "nonfinite_leaves", "tree_mismatches"]
