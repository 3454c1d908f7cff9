"""Reading one saved step: its index scanned for missing or short files, its metadata and
checksum record checked against each other, its arrays read into the target and verified; any
damage becomes a ``CorruptCheckpointError`` naming each array and what is wrong."""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..distributed import barrier
from .checksums import RECORD_FORMAT, RECORD_ITEM, extra_digest, in_saved_dtypes, record_vs_metadata, verify
from .convert import conversion
from .damage import read_problems, scan_files
from .errors import CheckpointError, CorruptCheckpointError, first_line
from .tree import leaf_paths, tree_mismatches

log = logging.getLogger("shardkit.checkpoint")


def _agree(flag: bool) -> list[int]:
    """Processes whose ``flag`` is set: all processes must take the same branch after a read."""
    if jax.process_count() == 1:
        return [0] if flag else []
    from jax.experimental import multihost_utils

    barrier("checkpoint-agree")  # after each process's own reads, which take uneven time
    flags = np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32))).reshape(-1)
    return [int(p) for p in np.flatnonzero(flags)]


def _cast_to(x, t):
    """``x`` in ``t``'s dtype, placed with ``t``'s sharding (no copy if the dtype matches)."""
    if x.dtype == t.dtype:
        return x
    return jax.jit(lambda a: a.astype(t.dtype), out_shardings=t.sharding)(x)


class StepReader:
    """Reads and verifies the steps of one checkpoint directory through its Orbax manager.

    Attributes:
        mngr: the directory's ``CheckpointManager`` (every process must read the same steps).
        directory: the absolute checkpoint directory.
    """

    def __init__(self, mngr: ocp.CheckpointManager, directory: str):
        self.mngr, self.directory = mngr, directory

    def damaged(self, step: int, problems: list[tuple[str, str]]) -> CorruptCheckpointError:
        """The error for ``step`` with ``problems``, listing the directory's other steps."""
        return CorruptCheckpointError(self.directory, step, problems, sorted(self.mngr.all_steps()))

    def read_record(self, step: int) -> dict | None:
        """The step's checksum record; None for a step saved without one (it says which)."""
        step_dir = os.path.join(self.directory, str(step))
        try:
            meta = (self.mngr.metadata(step).custom_metadata or {}).get("shardkit", {})
        except Exception:  # noqa: BLE001 - unreadable step metadata: the item itself decides
            meta = {}
        if not os.path.isdir(os.path.join(step_dir, RECORD_ITEM)):
            if meta.get("checksums"):
                raise self.damaged(step, [("", f"missing file: its checksum record ({RECORD_ITEM}/) is gone")])
            return None
        try:
            record = self.mngr.restore(step, args=ocp.args.Composite(**{RECORD_ITEM: ocp.args.JsonRestore()}))[RECORD_ITEM]
        except Exception as e:  # noqa: BLE001 - any Orbax/JSON failure: the record is damaged
            raise self.damaged(step, [("", f"its checksum record is unreadable ({first_line(e)})")]) from e
        if not (isinstance(record, dict) and record.get("format") == RECORD_FORMAT and isinstance(record.get("leaves"), dict)):
            raise self.damaged(step, [("", f"its checksum record is not a {RECORD_FORMAT} record")])
        return record

    def read_extra(self, step: int, record: dict | None) -> dict:
        """The step's ``extra``, checked against ``record``'s digest when there is a record."""
        try:
            out = self.mngr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise self.damaged(step, [("extra", f"unreadable ({first_line(e)})")]) from e
        extra = dict(out.extra or {})
        if record is not None and record.get("extra") not in (None, extra_digest(extra)):
            raise self.damaged(step, [("extra", "checksum mismatch")])
        return extra

    def load(self, step: int, target, with_extra: bool, like=None) -> tuple[Any, dict | None, bool]:
        """Reads one step into ``target`` and verifies it; CorruptCheckpointError if damaged. A
        data-parallel step restored into a DiLoCo ``target`` or the reverse is converted
        (``convert``); ``like`` is the concrete state ``target`` was made from."""
        record = self.read_record(step)
        expected = leaf_paths(target)
        names = {name.replace("/", "."): name for name in expected}
        # Missing or short files (and a damaged index) are found from the index alone, before
        # Orbax reads anything through it.
        item = os.path.join(self.directory, str(step), "state")
        try:
            problems = scan_files(item, names)
        except Exception as e:  # noqa: BLE001 - the scan is a diagnosis; the reads below decide
            log.info("could not scan %s for damaged files: %s", item, e)
            problems = []
        failed = _agree(bool(problems))
        if failed:
            raise self.damaged(step, problems or [("", f"process(es) {failed} found damaged files (see their error)")])
        try:
            saved = self.mngr.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any Orbax/tensorstore failure means unreadable
            raise self.damaged(step, read_problems(e, names, "its state metadata is unreadable")) from e
        if saved is None:
            raise self.damaged(step, [("", "missing file: its state item has no metadata")])
        saved_tree = getattr(saved, "tree", saved)
        saved = leaf_paths(saved_tree)
        conv = conversion(saved_tree, target, like)
        target = conv.source if conv else target
        expected = leaf_paths(target)
        if record is not None:
            lost = record_vs_metadata(record["leaves"], saved)
            if lost:
                raise self.damaged(step, lost)
        diff = tree_mismatches(saved, expected)
        if diff:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match the model being restored "
                f"({len(diff)} leaves differ):\n" + "\n".join(diff)
                + (f"\n(this is {conv.describe()})" if conv else "") +
                "\nRestore with the model/optimizer config it was saved with, or start a new directory.")
        read = target if record is None else in_saved_dtypes(target, record["leaves"])
        error = None
        try:
            state = self.mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(read))).state
        except Exception as e:  # noqa: BLE001 - diagnosed below
            error = e
        failed = _agree(error is not None)
        if failed:
            problems = (read_problems(error, names, "unreadable") if error is not None
                        else [("", f"process(es) {failed} could not read it (see their error)")])
            raise self.damaged(step, problems) from error
        if record is None:
            log.warning("checkpoint step %d in %s has no checksums (saved before shardkit wrote them, or with "
                        "checksums=False): restored unverified", step, self.directory)
        else:
            problems = verify(state, record["leaves"])
            failed = _agree(bool(problems))
            if failed and not problems:
                problems = [("", f"process(es) {failed} read arrays that differ from their checksums (see their error)")]
            if problems:
                raise self.damaged(step, problems)
            state = jax.tree.map(_cast_to, state, target)
        if conv:
            state = conv.finish(state)
        extra = self.read_extra(step, record) if with_extra else None
        return state, extra, record is not None
