"""Grain pipelines for the recipes: one global stream of examples, cut into global batches,
each process reading only its rows, through an iterator whose state a checkpoint stores.

Global batch ``s`` is examples ``[s·B, (s+1)·B)`` of the stream; process ``p`` of ``P`` reads
rows ``[p·B/P, (p+1)·B/P)`` of it (``examples.batch(B/P)[p::P]``). The rows a process reads,
and so the global batch the processes assemble, do not depend on how many processes there
are: a run on 2 hosts sees exactly the batches of a run on 1. (Grain's own
``ShardByJaxProcess`` slicing hands each process a contiguous part of the dataset instead, which
changes the batches with the process count.)

The iterator state (``{"next_index": n}`` for these index-based pipelines) is the same on every
process, so the recipes keep one copy, process 0's, in the checkpoint's ``extra`` beside the
train state, under the same checksum record; see ``Loader.position``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import jax


class DataError(ValueError):
    """Data that cannot be used as given; the message names what and the fix."""


def process_share(process_index: int | None = None, process_count: int | None = None) -> tuple[int, int]:
    """``(index, count)`` of this JAX process (Grain's ``ShardByJaxProcess``), or the given ones."""
    shard = grain.sharding.ShardByJaxProcess()
    return (shard.shard_index if process_index is None else process_index,
            shard.shard_count if process_count is None else process_count)


def per_process_batches(examples: grain.MapDataset, global_batch: int, process_index: int,
                        process_count: int) -> grain.MapDataset:
    """This process's rows of each global batch of ``examples`` (an endless, repeated stream).

    Raises:
        DataError: ``global_batch`` is not a positive multiple of ``process_count``.
    """
    if global_batch < 1 or global_batch % process_count:
        raise DataError(f"global batch {global_batch} is not a positive multiple of the "
                        f"{process_count} processes; each process loads an equal share")
    return examples.batch(global_batch // process_count, drop_remainder=True)[process_index::process_count]


class Loader(Iterator[dict]):
    """Iterates a Grain ``MapDataset`` of batches, resumably.

    Args:
        batches: a ``MapDataset`` whose element ``s`` is this process's batch of step ``s``.
        seed: the seed the pipeline was built with; a position saved under another seed is
            refused (resuming it would silently change the data stream).
        position: a ``.position`` to continue from.
        threads: Grain read threads (0: batches are made on the calling thread). The corpora
            sit in memory, so a couple of threads suffice; ``sk.prefetch`` overlaps the rest.
        buffer: batches Grain's threads read ahead.

    Attributes:
        dataset: the ``MapDataset`` (random access: ``dataset[s]`` is step ``s``'s batch).
    """

    def __init__(self, batches: grain.MapDataset, *, seed: int, position: dict | None = None,
                 threads: int = 2, buffer: int = 4):
        self.dataset, self.seed = batches, seed
        self._read = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=buffer)
        self._it = None
        self._start: dict[str, Any] = {"next_index": 0}
        if position is not None:
            self.restore(position)

    def _iterator(self):
        if self._it is None:  # made on first use: Grain starts its read threads then
            self._it = iter(self.dataset.to_iter_dataset(self._read))
            self._it.set_state(self._start)
        return self._it

    @property
    def position(self) -> dict:
        """JSON-able: ``{"seed", "grain"}`` (Grain's iterator state after the last batch
        returned); ``restore`` or ``position=`` continue right after that batch."""
        state = self._it.get_state() if self._it is not None else self._start
        return {"seed": self.seed, "grain": dict(state)}

    def restore(self, position: dict) -> None:
        """Continues from a saved ``position``.

        Raises:
            DataError: ``position`` is not one ``Loader.position`` made, or was saved with
                another seed.
        """
        if not isinstance(position, dict) or not isinstance(position.get("grain"), dict) or "seed" not in position:
            raise DataError(f"data position {position!r} is not one saved by this recipe's Grain loader "
                            "(a dict with 'seed' and 'grain'); a checkpoint from before the Grain loader "
                            "cannot resume its data stream: start a new run")
        if int(position["seed"]) != self.seed:
            raise DataError(f"the checkpoint's data stream was drawn with seed {position['seed']}, this run "
                            f"uses {self.seed}; resume with --seed {position['seed']}")
        self._start = dict(position["grain"])
        if self._it is not None:
            self._it.set_state(self._start)

    def batch_at(self, step: int) -> dict:
        """Step ``step``'s batch, without moving the iterator."""
        return self.dataset[step]

    def __iter__(self) -> "Loader":
        return self

    def __next__(self) -> dict:
        return next(self._iterator())


def global_batch(local: dict, sharding: jax.sharding.Sharding | None) -> dict:
    """Host-local rows → global arrays. One process: the NumPy batch as is (the train step
    places it); several: ``jax.make_array_from_process_local_data`` with ``sharding``."""
    if jax.process_count() == 1 or sharding is None:
        return local
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local)
