"""``sk.prefetch``: input batches placed on the devices a step or two before they are used.

A double buffer, not a data pipeline: it draws from any iterator of host batches and puts each
on the devices with the plan's batch shardings as soon as it is drawn. No thread: placing an
array (``jax.device_put``, or ``make_array_from_process_local_data`` on several hosts) returns
at once and the host-to-device copy runs in the background, so by the time the loop asks for
batch ``n`` its copy was started ``size`` steps earlier, behind the steps still running. What
stays on the host thread is making the batch (NumPy), which overlaps the device as long as the
training loop does not wait for every step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax

from .plan import Plan
from .precision import cast_input
from .step import TrainStep


class Prefetch(Iterator):
    """The iterator ``sk.prefetch`` returns: placed batches, in the source's order.

    Attributes:
        size: batches placed ahead of the one last returned.
    """

    def __init__(self, batches: Iterable, place: Callable[[Any], Any], size: int,
                 position: Callable[[], Any] | None):
        self.size = size
        self._source, self._place, self._position_fn = iter(batches), place, position
        self._queue: collections.deque = collections.deque()
        self._exhausted = False
        # Where the stream stood before anything was drawn: what a checkpoint saved before the
        # first step must record.
        self._position = position() if position is not None else None
        for _ in range(size):
            self._draw()

    def _draw(self) -> None:
        if self._exhausted:
            return
        try:
            batch = next(self._source)
        except StopIteration:
            self._exhausted = True
            return
        after = self._position_fn() if self._position_fn is not None else None
        self._queue.append((self._place(batch), after))

    def __iter__(self) -> "Prefetch":
        return self

    def __next__(self):
        if not self._queue:
            raise StopIteration
        batch, self._position = self._queue.popleft()
        self._draw()  # keep `size` batches in flight behind this one
        return batch

    @property
    def position(self) -> Any:
        """The source's position right after it produced the batch last returned (before any
        batch was returned: its position at the start) — what a checkpoint saved after that
        batch's step records to resume the stream there, although the source has been drawn
        ``size`` batches further. ``None`` without ``position=``."""
        return self._position


def prefetch(batches: Iterable, step_or_plan: TrainStep | Plan, size: int = 2, *,
             position: Callable[[], Any] | None = None) -> Prefetch:
    """Iterates ``batches`` with each one placed on the devices ``size`` steps ahead.

    Args:
        batches: an iterable of host batches (pytrees of NumPy arrays; on several hosts each
            process's rows, as ``TrainStep`` takes them).
        step_or_plan: the ``TrainStep`` that will consume them (its ``place_batch``: the
            plan's batch shardings, each host's slice under multi-host), or a ``Plan`` (one
            process only).
        size: batches placed ahead (1 or more); device memory holds ``size + 1`` batches.
        position: a function returning the source's current position (e.g. a data
            iterator's ``position``), called after each batch is drawn; ``.position`` then
            gives the position to checkpoint after a step (see ``Prefetch.position``).

    Returns:
        A ``Prefetch`` iterator; it ends when ``batches`` does, after the buffered batches.

    Raises:
        ValueError: ``size`` is not a positive integer, ``step_or_plan`` is neither a
            ``TrainStep`` nor a ``Plan``, or a ``Plan`` is given on several processes.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"prefetch: size must be a positive integer (batches placed ahead), got {size!r}")
    if isinstance(step_or_plan, TrainStep):
        def place(batch):
            return step_or_plan.place_batch(batch)[0]
    elif isinstance(step_or_plan, Plan):
        plan = step_or_plan
        if jax.process_count() > 1:
            raise ValueError("prefetch: with several processes pass the TrainStep (it assembles each host's "
                             "rows into global arrays), not the Plan")

        def place(batch):
            batch = jax.tree.map(cast_input, batch)
            return jax.device_put(batch, plan.batch_shardings(batch))
    else:
        raise ValueError(f"prefetch: step_or_plan must be an sk.TrainStep or sk.Plan, got {type(step_or_plan).__name__}")
    return Prefetch(batches, place, size, position)
