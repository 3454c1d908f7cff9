"""``Checkpointer``: save and restore ``TrainState`` checkpoints with Orbax, retention, fallback."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding

from ..plan import Plan
from .checksums import RECORD_ITEM, make_record
from .errors import CheckpointError, CorruptCheckpointError
from .reading import StepReader
from ..distributed import barrier
from .tree import abstract_target, nonfinite_leaves

log = logging.getLogger("shardkit.checkpoint")

_TMP_MARK = ".orbax-checkpoint-tmp"


@dataclasses.dataclass(frozen=True)
class RestoreInfo:
    """What the last ``restore``/``resume`` of a ``Checkpointer`` read.

    Attributes:
        step: the step whose state (and extra) was returned.
        verified: True if every array matched its saved checksum; False for a checkpoint written
            before checksums existed (or with ``checksums=False``), restored unverified.
        skipped: ``((step, problems), ...)`` for newer steps that ``fallback=True`` passed over
            because they are corrupt (newest first); empty when the asked-for step was intact.
    """

    step: int
    verified: bool
    skipped: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()


# Orbax splits the write of a replicated array across its replicas ("replica-parallel", its
# default off GPUs): each device copies one slice to the host through a compiled slice program,
# one per device and array shape (~50 ms of compile each, the first time), so that the hosts
# write in parallel. Below a few MiB per slice the copies take far less than those programs:
# such arrays are written from one replica, as on GPUs. Large arrays keep the split.
MIN_REPLICA_SLICE_BYTES = 4 << 20


def _state_type_handlers():
    """Orbax's standard type handlers, the ``jax.Array`` one with ``MIN_REPLICA_SLICE_BYTES``
    (on a copy: Orbax's process-wide registry, which a user's own Orbax code reads, is left as
    it is). Orbax 0.12 exposes the threshold only as an ``ArrayHandler`` constructor argument,
    and its default handler's other settings (its array-metadata store) only on the instance."""
    get = ocp.type_handlers.get_type_handler
    array = copy.copy(get(jax.Array))
    if not hasattr(array, "_min_slice_bytes_for_replica_parallel"):
        raise ImportError("this Orbax version's ArrayHandler has no min_slice_bytes_for_replica_parallel: "
                          "shardkit needs orbax-checkpoint 0.12")
    array._min_slice_bytes_for_replica_parallel = MIN_REPLICA_SLICE_BYTES
    kinds = [int, float, bytes, np.number, np.ndarray, str, type(ocp.PLACEHOLDER)]
    return ocp.type_handlers.create_type_handler_registry(*[(t, get(t)) for t in kinds], (jax.Array, array))


class _StateHandler(ocp.StandardCheckpointHandler):
    """Orbax's standard handler (the same files; plain Orbax reads them), writing replicated
    arrays as ``_state_type_handlers`` says. Its constructor takes no type-handler registry, so
    the PyTree handler it wraps is made again with one."""

    def __init__(self):
        super().__init__()
        self._impl = ocp.PyTreeCheckpointHandler(use_ocdbt=True, type_handler_registry=_state_type_handlers())


class _KeepIntact:
    """Orbax preservation policy: the ``keep`` newest steps not known to be corrupt, plus every
    step known to be corrupt (evidence is never deleted, and it holds no place in ``keep``)."""

    def __init__(self, keep: int | None, corrupt: set[int]):
        self.keep, self.corrupt = keep, corrupt

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        intact = sorted((c.step for c in checkpoints if c.step not in self.corrupt), reverse=True)
        kept = set(intact if self.keep is None else intact[: self.keep])
        return [c.step in kept or c.step in self.corrupt for c in checkpoints]


class Checkpointer:
    """Saves and restores ``TrainState`` checkpoints with Orbax (multi-host, async, any mesh).

    Every process must call ``save``/``restore``/``wait`` (they are collective); the directory
    must be visible to all hosts (a shared filesystem or a bucket Orbax supports).

    Attributes:
        directory: the absolute checkpoint directory (one subdirectory per step).
        keep: how many complete checkpoints to keep (None: all). The newest complete one is
            never deleted: old steps go only after a new save has committed. Steps a restore
            found corrupt are never deleted and do not count (so they cannot push the last
            intact step out).
        every: ``save`` writes only when ``step % every == 0`` (None: every call); ``force=True``
            overrides (preemption and final saves).
        async_save: write in a background thread; ``save`` returns once the arrays are copied
            off the devices, so the state may be donated to the next step right away.
        checksums: record a checksum per array with every save (restores verify them whenever
            present, whatever this is set to).
        last_restore: a ``RestoreInfo`` (step, verified, corrupt steps skipped) for the last
            ``restore``/``resume``, or None.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, every: int | None = None,
                 async_save: bool = True, checksums: bool = True):
        for name, v in (("keep", keep), ("every", every)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Checkpointer({name}={v!r}): use a positive integer, or None")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep, self.every, self.async_save = keep, every, bool(async_save)
        self.checksums = bool(checksums)
        self.last_restore: RestoreInfo | None = None
        self._corrupt: set[int] = set()  # steps a restore found damaged: kept, never counted in `keep`
        self._mngr: ocp.CheckpointManager | None = None
        self._writer = False

    # ---- the Orbax manager -----------------------------------------------------------------

    def _manager(self, create: bool) -> ocp.CheckpointManager | None:
        """The manager, made on first use; ``None`` if the directory is absent and not ``create``.

        Interrupted saves are removed only by a writer (``create``): a reader (an evaluation job
        following a live run) must not delete the temporary directory of a save in progress.
        """
        if self._mngr is not None and (not create or self._writer):
            return self._mngr
        if not os.path.isdir(self.directory):
            if not create:
                return None
            if os.path.exists(self.directory):
                raise CheckpointError(f"checkpoint directory {self.directory} exists and is not a directory")
        if self._mngr is not None:
            self._mngr.close()
        partial = self._partial_saves() if create else []
        if partial and jax.process_index() == 0:
            log.warning("removing %d interrupted save(s) in %s: %s", len(partial), self.directory, ", ".join(partial))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=_KeepIntact(self.keep, self._corrupt), create=create,
            cleanup_tmp_directories=create, enable_async_checkpointing=self.async_save)
        registry = ocp.DefaultCheckpointHandlerRegistry()
        for item, handler, save, restore in (
                ("state", _StateHandler(), ocp.args.StandardSave, ocp.args.StandardRestore),
                ("extra", ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore),
                (RECORD_ITEM, ocp.JsonCheckpointHandler(), ocp.args.JsonSave, ocp.args.JsonRestore)):
            registry.add(item, save, handler)
            registry.add(item, restore, handler)
        self._mngr = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        self._writer = create
        return self._mngr

    def _reader(self) -> ocp.CheckpointManager | None:
        """The manager with a fresh view of the directory (another job may be writing to it)."""
        m = self._manager(create=False)
        if m is not None and not self._writer:
            m.reload()
        return m

    def _partial_saves(self) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(n for n in os.listdir(self.directory) if _TMP_MARK in n)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None (no directory or no complete save)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, oldest first (interrupted saves are not listed;
        complete steps a restore found corrupt are, since they are still on disk)."""
        m = self._reader()
        return [] if m is None else sorted(m.all_steps())

    def wait(self) -> None:
        """Blocks until every pending async save has committed (call before exiting)."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's threads."""
        if self._mngr is not None:
            self._mngr.wait_until_finished()
            self._mngr.close()
            self._mngr = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- save ------------------------------------------------------------------------------

    def save(self, state, step: int | None = None, extra: dict | None = None, *, force: bool = False,
             allow_nonfinite: bool = False) -> bool:
        """Saves ``state`` (and ``extra``) as checkpoint ``step``; every process must call it.

        Args:
            state: a ``TrainState`` (or any pytree of arrays). Each host writes only the shards
                it holds; with ``async_save`` it may be donated to the next step as soon as this
                returns.
            step: the checkpoint's step (default: ``int(state.step)``, which waits for the step
                that produced ``state``; pass it to keep the host running ahead).
            extra: a JSON-serialisable dict stored beside the state (data position, config).
            force: save even if ``step`` is not a multiple of ``every``.
            allow_nonfinite: write even if a float leaf holds NaN/inf (refused by default so a
                diverged run never replaces a good checkpoint).

        Returns:
            True if a checkpoint was written (started, if async); False if ``every`` skips this
            step or ``step`` is already saved (an existing checkpoint is never overwritten, a
            corrupt one included: a warning says so).

        Raises:
            CheckpointError: non-finite values (each leaf named), or ``extra`` is not JSON.
        """
        if step is None:
            if not hasattr(state, "step"):
                raise ValueError("save(state) without step= needs a state with a .step (an sk.TrainState)")
            step = int(jax.device_get(state.step))
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative integer, got {step!r}")
        step = int(step)
        if not force and self.every is not None and step % self.every:
            return False
        extra = {} if extra is None else extra
        try:
            extra = json.loads(json.dumps(extra))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"save(extra=...) must be JSON-serialisable (dicts, lists, str, numbers): {e}") from None
        mngr = self._manager(create=True)
        if step in mngr.all_steps():
            if step in self._corrupt:
                log.warning("not saving step %d: %s holds a corrupt checkpoint of that step, kept for inspection "
                            "(never overwritten); move it away to save this step", step,
                            os.path.join(self.directory, str(step)))
            return False
        barrier("checkpoint-save")  # processes arrive at the collectives below together
        if not allow_nonfinite:
            bad = nonfinite_leaves(state)
            if bad:
                latest = self.latest_step()
                keep_txt = (f"checkpoint step {latest} is left as it was" if latest is not None
                            else "nothing was written")
                raise CheckpointError(
                    f"refusing to save step {step}: non-finite values (NaN/inf) in\n  " + "\n  ".join(bad) +
                    f"\n{keep_txt}. Restore it and lower the learning rate / enable clip_norm or "
                    "skip_nonfinite, or pass allow_nonfinite=True to save anyway (e.g. to debug).")
        items = {"state": ocp.args.StandardSave(state), "extra": ocp.args.JsonSave(extra)}
        if self.checksums:
            items[RECORD_ITEM] = ocp.args.JsonSave(make_record(state, extra))
        meta = _describe_layout(state)
        meta["shardkit"]["checksums"] = self.checksums
        barrier("checkpoint-write")  # Orbax's first barrier is a device collective (30 s rendezvous)
        saved = mngr.save(step, args=ocp.args.Composite(**items), force=True, custom_metadata=meta)
        if not self.async_save:
            mngr.wait_until_finished()
        return bool(saved)

    # ---- restore ---------------------------------------------------------------------------

    def _require_step(self, step: int | None) -> tuple[ocp.CheckpointManager, int]:
        mngr = self._reader()
        if mngr is None:
            raise CheckpointError(
                f"no checkpoint directory {self.directory}: check the path (and that every host "
                "sees it), or start without resuming")
        if self._writer:
            mngr.wait_until_finished()  # never read a step that is still being written
        steps = sorted(mngr.all_steps())
        if not steps:
            partial = self._partial_saves()
            why = f" (only interrupted saves: {', '.join(partial)})" if partial else ""
            raise CheckpointError(f"no complete checkpoint in {self.directory}{why}; start without resuming")
        if step is None:
            return mngr, steps[-1]
        if step not in steps:
            raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; complete steps: {steps}")
        return mngr, int(step)

    def restore(self, plan: Plan, like, step: int | None = None, *, shardings=None, fallback: bool = False):
        """Restores checkpoint ``step`` (default: the latest) onto ``plan``, verified.

        The layout comes only from ``like``/``plan``, never from the checkpoint, so any saved mesh
        and ZeRO stage restore onto any new one (each device reads just its slice). Dtypes follow
        ``like`` (values are cast if the precision changed, after verification). Every array is
        checked against the checksum saved with it before anything is returned; a checkpoint
        written without checksums restores unverified, with a logged warning.

        Args:
            plan: the plan of the run being resumed; ``like``'s shardings must be on its mesh.
            like: a ``TrainState`` made on ``plan`` (the new run's ``step.init(...)``) or an
                abstract one (``ShapeDtypeStruct`` leaves with shardings).
            step: which checkpoint (default: the newest complete one).
            shardings: optional ``NamedSharding`` tree (``step.state_shardings(like)``) used
                instead of ``like``'s own.
            fallback: if ``step`` is corrupt, log a warning and try the next older step, and so
                on, until one is intact. Damaged steps are left as they are on disk.
                ``self.last_restore`` tells which step came back and which were skipped.

        A data-parallel checkpoint restores into a DiLoCo ``like`` (every replica and θ_outer
        start from it, the outer optimizer state is ``like``'s, fresh) and a DiLoCo checkpoint
        into a data-parallel ``like`` (θ_outer, the consensus parameters; the replicas' mean
        optimizer state): which way is read off the checkpoint's own tree (see
        ``shardkit.checkpoint.convert``).

        Returns:
            The restored state, with ``like``'s tree structure and shardings.

        Raises:
            CorruptCheckpointError: the step is damaged (each array and what is wrong listed).
            CheckpointError: with ``fallback``, no step is intact (every step's problems listed);
                no such directory or step, the checkpoint's tree/shapes do not match ``like``
                (every differing leaf listed), or ``like`` is not on ``plan.mesh``.
        """
        if not isinstance(plan, Plan):
            raise ValueError(f"restore(plan, ...) needs an sk.Plan, got {type(plan).__name__}")
        target = abstract_target(plan, like, shardings)
        mngr, step = self._require_step(step)
        return self._first_intact(mngr, step, target, fallback, with_extra=False, like=like)[0]

    def resume(self, plan: Plan, like, *, shardings=None, fallback: bool = False) -> tuple[Any, dict | None]:
        """The newest checkpoint restored onto ``plan`` and its ``extra``, read from the same
        step; ``(like, None)`` when the directory holds none yet (a first run).

        With ``fallback=True`` a corrupt newest step is skipped (warning logged) for the newest
        intact one, whose state *and* extra are returned; ``self.last_restore.step`` is that step.

        Raises:
            CheckpointError: as ``restore``.
        """
        if self.latest_step() is None:
            return like, None
        if not isinstance(plan, Plan):
            raise ValueError(f"resume(plan, ...) needs an sk.Plan, got {type(plan).__name__}")
        target = abstract_target(plan, like, shardings)
        mngr, step = self._require_step(None)
        return self._first_intact(mngr, step, target, fallback, with_extra=True, like=like)

    def extra(self, step: int | None = None) -> dict:
        """The ``extra`` dict saved with checkpoint ``step`` (default: the latest), verified
        against its checksum when the step has one.

        Raises:
            CorruptCheckpointError: it is unreadable or differs from what was saved.
        """
        mngr, step = self._require_step(step)
        reader = StepReader(mngr, self.directory)
        return reader.read_extra(step, reader.read_record(step))

    def _first_intact(self, mngr, step: int, target, fallback: bool, with_extra: bool, like=None):
        candidates = [step] + ([s for s in sorted(mngr.all_steps(), reverse=True) if s < step] if fallback else [])
        skipped: list[CorruptCheckpointError] = []
        reader = StepReader(mngr, self.directory)
        for s in candidates:
            try:
                state, extra, verified = reader.load(s, target, with_extra, like)
            except CorruptCheckpointError as e:
                self._corrupt.add(s)
                if not fallback:
                    raise
                log.warning("%s\nfalling back to an older step.", e)
                skipped.append(e)
                continue
            self.last_restore = RestoreInfo(s, verified, tuple((e.step, e.problems) for e in skipped))
            if skipped:
                log.warning("restored checkpoint step %d of %s; corrupt newer step(s) %s skipped and left untouched",
                            s, self.directory, [e.step for e in skipped])
            return state, extra
        raise CheckpointError(
            f"no intact checkpoint in {self.directory}: every complete step is corrupt "
            f"(each is left as it is on disk):\n" + "\n".join(
                f"  step {e.step}: " + "; ".join(f"{leaf or '(the whole step)'}: {what}" for leaf, what in e.problems)
                for e in skipped) + "\nStart without resuming, or point --checkpoint-dir elsewhere.")


def _describe_layout(state) -> dict:
    """Informational metadata: the mesh the state was saved from (restores never use it)."""
    for x in jax.tree.leaves(state):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return {"shardkit": {"mesh": {k: int(v) for k, v in s.mesh.shape.items()},
                                 "process_count": jax.process_count()}}
    return {"shardkit": {"process_count": jax.process_count()}}
