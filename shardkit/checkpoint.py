"""Checkpoints on Orbax: save a sharded ``TrainState`` from every host, restore it onto any plan.

A checkpoint is a plain Orbax ``CheckpointManager`` directory: one subdirectory per step with two
items, ``state`` (the whole ``TrainState`` as a ``StandardSave`` pytree: every host writes its own
shards, nothing is gathered) and ``extra`` (a JSON dict: data-iterator position, config). Restores
always go through an abstract target carrying the *new* plan's shardings, so a checkpoint saved on
``data=8`` ZeRO-0 loads onto ``fsdp=4,tensor=2`` ZeRO-3 (Orbax reads each device's slice), and
never silently onto the mesh it was saved with.

Safety comes from Orbax's atomic commit (a save is written to ``<step>.orbax-checkpoint-tmp-*``
and renamed when complete; ``max_to_keep`` deletes old steps only after that), plus checks here:
non-finite states are refused, and a checkpoint whose tree or shapes differ from the target is
reported leaf by leaf before anything is read.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from .plan import Plan

log = logging.getLogger("shardkit.checkpoint")

_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked (the message says why and what to do)."""


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_paths(tree) -> dict[str, Any]:
    """``{"params/w": leaf, ...}``: leaves by slash-joined path, as Orbax names them on disk.

    Dataclass fields, dict keys, named-tuple fields and sequence indices all become path parts,
    so a ``TrainState`` and the nested dicts/lists Orbax's metadata returns line up.
    """
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_str(k) for k in path): leaf for path, leaf in flat}


def _flags_fn(xs):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs])


_finite_flags = jax.jit(_flags_fn)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` holding a NaN or an infinity.

    One jitted reduction over the (possibly sharded, multi-host) arrays; every process must call
    it, as with any computation on global arrays.
    """
    leaves = leaf_paths(tree)
    names, arrays, bad = [], [], []
    for name, x in leaves.items():
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            continue
        if isinstance(x, jax.Array):
            names.append(name)
            arrays.append(x)
        elif not np.all(np.isfinite(np.asarray(x))):
            bad.append(name)
    if arrays:
        flags = np.asarray(_finite_flags(arrays))
        bad += [n for n, ok in zip(names, flags) if not ok]
    return bad


def _describe(x) -> str:
    return f"{tuple(x.shape)} {np.dtype(x.dtype).name}" if hasattr(x, "shape") else type(x).__name__


def tree_mismatches(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """One line per leaf that is missing, unexpected, or shaped differently (saved vs expected)."""
    lines = []
    for name in sorted(set(saved) | set(expected)):
        if name not in saved:
            lines.append(f"  {name}: expected {_describe(expected[name])}, not in the checkpoint")
        elif name not in expected:
            lines.append(f"  {name}: in the checkpoint ({_describe(saved[name])}), not in the target")
        elif tuple(saved[name].shape) != tuple(expected[name].shape):
            lines.append(f"  {name}: saved {tuple(saved[name].shape)}, expected {tuple(expected[name].shape)}")
    return lines


def abstract_target(plan: Plan, like, shardings=None):
    """``like`` as a tree of ``jax.ShapeDtypeStruct`` with shardings on ``plan.mesh``.

    Args:
        plan: the plan to restore onto; every sharding must be on its mesh.
        like: a ``TrainState`` (or any pytree) of ``jax.Array`` or ``ShapeDtypeStruct`` leaves,
            e.g. what the new run's ``step.init`` returned.
        shardings: optional tree of ``NamedSharding`` matching ``like`` (e.g.
            ``step.state_shardings(like)``); overrides the leaves' own shardings.

    Raises:
        CheckpointError: a leaf has no sharding, or one on another mesh than the plan's.
    """
    if shardings is not None:
        like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), like, shardings)
    missing, foreign = [], []

    def one(path, x):
        name = "/".join(_key_str(k) for k in path)
        s = getattr(x, "sharding", None)
        if s is None and getattr(x, "ndim", None) == 0:
            s = NamedSharding(plan.mesh, P())  # a bare scalar: replicate it, nothing to choose
        if s is None or not hasattr(x, "shape"):
            missing.append(f"  {name}: {type(x).__name__} {_describe(x)}")
            return None
        if not isinstance(s, NamedSharding) or s.mesh != plan.mesh:
            where = f"mesh {dict(s.mesh.shape)}" if isinstance(s, NamedSharding) else type(s).__name__
            foreign.append(f"  {name}: on {where}")
            return None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    target = jax.tree_util.tree_map_with_path(one, like)
    if missing:
        raise CheckpointError(
            "restore(like=...) needs a sharding for every leaf; these have none:\n" + "\n".join(missing) +
            "\nPass the TrainState from the new run's step.init(...), or shardings=step.state_shardings(like).")
    if foreign:
        raise CheckpointError(
            f"restore(plan, like=...): these leaves of `like` are not on the plan's mesh {dict(plan.mesh.shape)}:\n"
            + "\n".join(foreign) + "\nCreate `like` with a train step built on this plan (step.init), "
            "or pass shardings=step.state_shardings(like).")
    return target


class Checkpointer:
    """Saves and restores ``TrainState`` checkpoints with Orbax (multi-host, async, any mesh).

    Every process must call ``save``/``restore``/``wait`` (they are collective); the directory
    must be visible to all hosts (a shared filesystem or a bucket Orbax supports).

    Attributes:
        directory: the absolute checkpoint directory (one subdirectory per step).
        keep: how many complete checkpoints to keep (None: all). The newest complete one is
            never deleted: old steps go only after a new save has committed.
        every: ``save`` writes only when ``step % every == 0`` (None: every call); ``force=True``
            overrides (preemption and final saves).
        async_save: write in a background thread; ``save`` returns once the arrays are copied
            off the devices, so the state may be donated to the next step right away.
    """

    def __init__(self, directory: str | os.PathLike, keep: int | None = 3, every: int | None = None,
                 async_save: bool = True):
        for name, v in (("keep", keep), ("every", every)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"Checkpointer({name}={v!r}): use a positive integer, or None")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep, self.every, self.async_save = keep, every, bool(async_save)
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
            max_to_keep=self.keep, create=create, cleanup_tmp_directories=create,
            enable_async_checkpointing=self.async_save)
        handlers = {"state": ocp.StandardCheckpointHandler(), "extra": ocp.JsonCheckpointHandler()}
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
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
        m = self._reader()
        return None if m is None else m.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all complete checkpoints, oldest first (interrupted saves are not listed)."""
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
            step or ``step`` is already saved (an existing checkpoint is never overwritten).

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
            return False
        if not allow_nonfinite:
            bad = nonfinite_leaves(state)
            if bad:
                latest = mngr.latest_step()
                keep_txt = (f"checkpoint step {latest} is left as it was" if latest is not None
                            else "nothing was written")
                raise CheckpointError(
                    f"refusing to save step {step}: non-finite values (NaN/inf) in\n  " + "\n  ".join(bad) +
                    f"\n{keep_txt}. Restore it and lower the learning rate / enable clip_norm or "
                    "skip_nonfinite, or pass allow_nonfinite=True to save anyway (e.g. to debug).")
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra))
        saved = mngr.save(step, args=args, force=True, custom_metadata=_describe_layout(state))
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

    def restore(self, plan: Plan, like, step: int | None = None, *, shardings=None):
        """Restores checkpoint ``step`` (default: the latest) onto ``plan``.

        The layout comes only from ``like``/``plan``, never from the checkpoint, so any saved mesh
        and ZeRO stage restore onto any new one (each device reads just its slice). Dtypes follow
        ``like`` (values are cast if the precision changed).

        Args:
            plan: the plan of the run being resumed; ``like``'s shardings must be on its mesh.
            like: a ``TrainState`` made on ``plan`` (the new run's ``step.init(...)``) or an
                abstract one (``ShapeDtypeStruct`` leaves with shardings).
            step: which checkpoint (default: the newest complete one).
            shardings: optional ``NamedSharding`` tree (``step.state_shardings(like)``) used
                instead of ``like``'s own.

        Returns:
            The restored state, with ``like``'s tree structure and shardings.

        Raises:
            CheckpointError: no such directory or step, the checkpoint's tree/shapes do not match
                ``like`` (every differing leaf listed), ``like`` is not on ``plan.mesh``, or the
                checkpoint is unreadable.
        """
        if not isinstance(plan, Plan):
            raise ValueError(f"restore(plan, ...) needs an sk.Plan, got {type(plan).__name__}")
        target = abstract_target(plan, like, shardings)
        mngr, step = self._require_step(step)
        try:
            saved = mngr.item_metadata(step)["state"]
        except Exception as e:  # noqa: BLE001 - any Orbax/tensorstore failure means unreadable
            raise self._corrupt(step, e) from e
        if saved is None:
            raise self._corrupt(step, "its 'state' item has no metadata")
        saved_tree = getattr(saved, "tree", saved)
        diff = tree_mismatches(leaf_paths(saved_tree), leaf_paths(target))
        if diff:
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory} does not match the model being restored "
                f"({len(diff)} leaves differ):\n" + "\n".join(diff) +
                "\nRestore with the model/optimizer config it was saved with, or start a new directory.")
        try:
            out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        except Exception as e:  # noqa: BLE001
            raise self._corrupt(step, e) from e
        return out.state

    def resume(self, plan: Plan, like, *, shardings=None) -> tuple[Any, dict | None]:
        """The newest checkpoint restored onto ``plan`` and its ``extra``, read from the same
        step; ``(like, None)`` when the directory holds none yet (a first run).

        Raises:
            CheckpointError: as ``restore``.
        """
        step = self.latest_step()
        if step is None:
            return like, None
        return self.restore(plan, like, step, shardings=shardings), self.extra(step)

    def extra(self, step: int | None = None) -> dict:
        """The ``extra`` dict saved with checkpoint ``step`` (default: the latest)."""
        mngr, step = self._require_step(step)
        try:
            out = mngr.restore(step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001
            raise self._corrupt(step, e) from e
        return dict(out.extra or {})

    def _corrupt(self, step: int, cause) -> CheckpointError:
        others = [s for s in self.all_steps() if s != step]
        alt = f"restore another step (step={others[-1]}; complete: {others})" if others else "start without resuming"
        if not isinstance(cause, str):
            cause = f"{type(cause).__name__}: {(str(cause) or repr(cause)).splitlines()[0]}"
        return CheckpointError(
            f"checkpoint step {step} in {self.directory} is unreadable ({cause}); {alt}, or delete that step directory")


def _describe_layout(state) -> dict:
    """Informational metadata: the mesh the state was saved from (restores never use it)."""
    for x in jax.tree.leaves(state):
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding):
            return {"shardkit": {"mesh": {k: int(v) for k, v in s.mesh.shape.items()},
                                 "process_count": jax.process_count()}}
    return {"shardkit": {"process_count": jax.process_count()}}


class PreemptionGuard:
    """Turns a preemption notice (SIGTERM) into "stop at the next step boundary".

    On one process it installs a handler for ``signals`` that only sets a flag (the current
    step finishes normally). On several processes the notice may reach one host only, so it
    asks JAX's preemption sync manager instead (``reached_preemption_sync_point``), which
    agrees on the same step on every host; JAX installs its own SIGTERM notifier there.

    Call ``should_stop(step)`` once per step on every process, then save (``force=True``) and
    exit 0. Usable as a context manager; ``close()`` restores the previous handlers.
    """

    def __init__(self, signals: Iterable[int] = (signal.SIGTERM,)):
        self._event = threading.Event()
        self._old: dict[int, Any] = {}
        self.multiprocess = jax.process_count() > 1
        if self.multiprocess:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionGuard must be created in the main thread (Python delivers signals there)")
        for sig in signals:
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self._event.set()
        log.warning("received signal %d: will checkpoint and stop at the next step boundary", signum)
        # A second signal takes the default action (e.g. terminate) if saving hangs.
        signal.signal(signum, self._old.get(signum, signal.SIG_DFL))

    @property
    def requested(self) -> bool:
        """True once a preemption signal reached this process."""
        return self._event.is_set()

    def request(self) -> None:
        """Asks to stop at the next boundary, as a signal would (single-process runs only)."""
        self._event.set()

    def should_stop(self, step: int) -> bool:
        """True when the run should save and exit after ``step`` (call it every step, all hosts)."""
        if self.multiprocess:
            from jax.experimental import multihost_utils

            # Never mix in this host's own flag: hosts must agree on the step or they deadlock.
            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return self._event.is_set()

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def __enter__(self) -> PreemptionGuard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Checkpointer", "CheckpointError", "PreemptionGuard", "abstract_target", "leaf_paths",
           "nonfinite_leaves", "tree_mismatches"]
