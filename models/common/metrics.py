"""What a training run writes while it runs: JSON lines and TensorBoard scalars side by side,
and a ``jax.profiler`` trace of a window of steps.

TensorBoard event files are written through ``tensorboardX`` (no TensorFlow needed), one scalar
per numeric metric, tagged by its JSON key; ``read_scalars`` reads them back without
TensorFlow or TensorBoard. The profiler trace (``--profile-steps A:B``) lands under
``<dir>/plugins/profile/<run>/``: ``*.xplane.pb`` for TensorBoard's profile plugin / XProf and
``perfetto_trace.json.gz`` for ui.perfetto.dev.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import jax


class MetricsWriter:
    """JSON lines (``jsonl``) and TensorBoard scalars (``tensorboard`` directory); either may be
    None. Only process 0 writes (``enabled``).

    Args:
        jsonl: path of the JSON-lines file, or None.
        tensorboard: TensorBoard log directory, or None.
        enabled: False on the other processes of a multi-host job: nothing is written.
    """

    def __init__(self, jsonl: str | None, tensorboard: str | None, enabled: bool = True):
        self._out = open(jsonl, "w") if jsonl and enabled else None
        self._tb = None
        if tensorboard and enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(tensorboard, flush_secs=10)

    @property
    def active(self) -> bool:
        """Whether anything is written at all."""
        return self._out is not None or self._tb is not None

    def write(self, record: dict, *, flush: bool = False) -> None:
        """One record: ``{"step": n, name: value, ...}``. Every number becomes the scalar
        ``name`` at step ``n``; lists (per-expert counts) go to the JSON lines only."""
        if self._out:
            self._out.write(json.dumps(record) + "\n")
            if flush:
                self._out.flush()
        if self._tb and "step" in record:  # run-level records (no step) stay in the JSON lines
            step = int(record["step"])
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(name, value, step)

    def close(self) -> None:
        if self._out:
            self._out.close()
        if self._tb:
            self._tb.close()


def read_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard log directory: ``{tag: [(step, value), ...]}``, read with
    tensorboardX's ``Event`` protocol buffer from the TFRecord framing (length, CRC, payload,
    CRC), so no TensorFlow is needed."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for name in sorted(os.listdir(directory)):
        if "tfevents" not in name:
            continue
        for payload in _records(os.path.join(directory, name)):
            event = Event.FromString(payload)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def _records(path: str) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while header := f.read(12):
            (length,) = struct.unpack("<Q", header[:8])
            payload = f.read(length)
            f.read(4)
            if len(payload) < length:  # a record still being written
                return
            yield payload


class Profiler:
    """Traces steps ``[start, stop)`` with ``jax.profiler`` into ``directory``.

    Run each step ``i`` under ``step(i)`` (it opens the window and marks the step for the
    trace viewer's step view), call ``after(i, outputs)`` once it returns (the window's last
    step closes it) and ``close()`` after the loop.

    Args:
        window: ``"A:B"`` (steps A to B-1) or None (no trace).
        directory: where the trace goes (``plugins/profile/<run>/`` under it).

    Raises:
        ValueError: ``window`` is not ``A:B`` with ``0 <= A < B``.
    """

    def __init__(self, window: str | None, directory: str):
        self.start = self.stop = None
        self.directory, self._active = directory, False
        if window:
            try:
                a, b = (int(x) for x in window.split(":"))
            except ValueError:
                a = b = -1
            if not 0 <= a < b:
                raise ValueError(f"--profile-steps {window!r} is not A:B with 0 <= A < B (e.g. 10:13 traces "
                                 "steps 10, 11 and 12)")
            self.start, self.stop = a, b

    def step(self, i: int):
        """Before step ``i``: starts the trace at the window's first step. Returns a context
        manager to run step ``i`` under (the trace viewer's step mark inside the window)."""
        if self.start is not None and i == self.start and not self._active:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self._active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=i) if self._active else _nothing()

    def after(self, i: int, outputs=None) -> None:
        """After step ``i``: a window whose last step this was stops here, once ``outputs``
        are computed, not at the next ``step`` (which a run ending with the window never
        calls: its final evaluation's and checkpoint's compiles would land in the trace)."""
        if self._active and i + 1 == self.stop:
            self._finish(outputs)

    def close(self, last=None) -> None:
        """Stops a trace still open (the run ended inside the window)."""
        if self._active:
            self._finish(last)

    def _finish(self, outputs) -> None:
        if outputs is not None:
            jax.block_until_ready(outputs)
        jax.profiler.stop_trace()
        self._active = False


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def add_flags(parser) -> None:
    """``--tensorboard DIR`` and ``--profile-steps A:B`` / ``--profile-dir DIR``."""
    a = parser.add_argument
    a("--tensorboard", metavar="DIR", help="write TensorBoard scalars (every metric of --metrics-out) here")
    a("--profile-steps", metavar="A:B", help="capture a jax.profiler trace of steps A..B-1 (TensorBoard "
      "profile plugin / XProf / Perfetto)")
    a("--profile-dir", metavar="DIR", help="where the trace goes (default: --tensorboard, else ./profile)")


def profiler_from(args) -> Profiler:
    """The ``Profiler`` the flags ask for.

    Raises:
        ValueError: a malformed ``--profile-steps``.
    """
    return Profiler(args.profile_steps, args.profile_dir or args.tensorboard or "profile")
