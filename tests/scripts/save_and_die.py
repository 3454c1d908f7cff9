"""Commits checkpoint 1, then starts saving checkpoint 2 and stops at ``--moment`` (printing
``at <moment> <pid>``) so the test can ``kill -9`` it there.

Moments (Orbax internals, patched here only): ``created`` (the step's temporary directory
exists, nothing written), ``writing`` (the state is written, the ``extra`` item is not),
``committing`` (everything written, the atomic rename not yet done).

Several ``--dir DIR --moment M`` pairs: one interpreter imports JAX, Orbax and shardkit once and
forks a process per pair before JAX starts (no backend, no device yet: each child starts its
own), so the test pays one interpreter's start-up for every moment. Each child stops at its
moment until it is killed (or this process ends); this process prints ``reaped <pid> <signal>``
as each child ends and exits once all have.
"""

import argparse
import asyncio
import os
import signal
import sys
import time
import traceback

import shardkit as sk
from shardkit.checkpoint import Checkpointer

sk.use_cpu_devices(8)

from orbax.checkpoint import JsonCheckpointHandler  # noqa: E402
from orbax.checkpoint._src.path import atomicity  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import tiny  # noqa: E402

MOMENTS = ("created", "writing", "committing")


def say(line: str) -> None:
    """One line to stdout in one write: the forked processes share the test's pipe, and print()
    under PYTHONUNBUFFERED writes the text and its newline apart, so two processes' lines could
    interleave ("at writing 17398at committing ...", seen in a suite run)."""
    os.write(1, (line + "\n").encode())


def pause(moment, parent):
    say(f"at {moment} {os.getpid()}")
    deadline = time.monotonic() + 600
    while os.getppid() == parent and time.monotonic() < deadline:  # ends with the test's watchdog
        time.sleep(0.2)
    os._exit(3)


def save_and_stop(directory: str, moment: str, parent: int) -> int:
    plan, step = tiny.make_step("data=8")
    ckpt = Checkpointer(directory, keep=1)
    state = step.init(tiny.init_params, seed=0)
    state, _ = step(state, tiny.batch(0))
    ckpt.save(state, extra={"data_position": 1})
    ckpt.wait()
    say(f"committed 1 {moment}")
    state, _ = step(state, tiny.batch(1))

    cls = atomicity.AtomicRenameTemporaryPath
    create, finalize, json_save = cls.create, cls.finalize, JsonCheckpointHandler._save_fn

    async def patched_create(self):
        path = await create(self)
        if moment == "created" and self.get_final().name == "2":
            await asyncio.to_thread(pause, "created", parent)
        return path

    async def patched_finalize(self):
        if moment == "committing" and self.get_final().name == "2":
            await asyncio.to_thread(pause, "committing", parent)
        return await finalize(self)

    async def patched_json(self, x, directory):
        if moment == "writing":
            await asyncio.to_thread(pause, "writing", parent)
        return await json_save(self, x, directory)

    cls.create, cls.finalize, JsonCheckpointHandler._save_fn = patched_create, patched_finalize, patched_json
    ckpt.save(state, extra={"data_position": 2})
    ckpt.wait()
    say(f"committed 2 {moment} (the test should have killed this process)")
    return 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", action="append", required=True)
    p.add_argument("--moment", action="append", choices=MOMENTS, required=True)
    a = p.parse_args()
    if len(a.dir) != len(a.moment):
        p.error(f"give one --moment per --dir: {len(a.dir)} directories, {len(a.moment)} moments")
    parent, children = os.getpid(), set()
    for directory, moment in zip(a.dir, a.moment):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = save_and_stop(directory, moment, parent)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                os._exit(code)  # never back into the parent's loop
        children.add(pid)
    while children:
        pid, status = os.wait()
        children.discard(pid)
        how = signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
        say(f"reaped {pid} {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
