"""Stage-major layer storage: the stacked layer weights kept in the order the pipeline reads
them, so a step moves no weights.

``sk.pipeline`` splits the leading layer axis over the pipe axis in contiguous blocks. With
one chunk per device that is already what the schedule reads; with several (circular,
interleaved 1F1B: device s runs layer groups s, s+p, ...; ZB-V: s and 2p-1-s) the natural
order must be reordered stage-major every step — an all-to-all of the weights forward and of
their gradients backward on GPUs — unless the weights are *stored* that way:
``pipeline(..., layer_order="stage-major")`` takes them so, and the optimizer state, built
from the stored params, follows. Checkpoints then hold the stored order:
``pipeline_layers_natural`` converts back (and ``pipeline_layers_stage_major`` forward).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .schedules import layer_groups

LAYER_ORDERS = ("natural", "stage-major")


def pipeline_layer_order(layers: int, stages: int, schedule: str, repeats: int = 1) -> np.ndarray:
    """The natural layer index at each stored position of a stage-major stack.

    Args:
        layers: ``L``, the stack's leading dimension (a multiple of ``stages × chunks``).
        stages: ``p``, the pipe axis size.
        schedule: the pipeline schedule (``"zb-v"`` has 2 chunks per device, whatever
            ``repeats``).
        repeats: chunks per device for ``"circular"`` / ``"interleaved-1f1b"``.

    Returns:
        int array ``order`` of length ``L``: stored row ``i`` holds natural layer ``order[i]``
        (``stored = natural[order]``).

    Raises:
        ValueError: ``layers`` does not split into ``stages × chunks`` equal groups.
    """
    v = 2 if schedule == "zb-v" else repeats
    if layers % (stages * v):
        raise ValueError(f"{layers} layers do not split into {stages} stages x {v} chunks; use a multiple "
                         f"of {stages * v}")
    k = layers // (stages * v)
    groups = layer_groups(schedule, stages, v)
    return np.array([g * k + j for s in range(stages) for g in groups[s] for j in range(k)])


def pipeline_layers_stage_major(tree: Any, stages: int, schedule: str, repeats: int = 1) -> Any:
    """A stacked layer tree (leading dim ``L``, natural order) in stage-major storage order."""
    def reorder(a):
        return a[pipeline_layer_order(a.shape[0], stages, schedule, repeats)]
    return jax.tree.map(reorder, tree)


def pipeline_layers_natural(tree: Any, stages: int, schedule: str, repeats: int = 1) -> Any:
    """The inverse of ``pipeline_layers_stage_major``: stored order back to layers 0..L-1."""
    def restore(a):
        return a[np.argsort(pipeline_layer_order(a.shape[0], stages, schedule, repeats))]
    return jax.tree.map(restore, tree)
