"""Preemption: a SIGTERM (or JAX's multi-host notice) becomes "save and stop at the next step"."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable
from typing import Any

import jax

log = logging.getLogger("shardkit.checkpoint")


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
