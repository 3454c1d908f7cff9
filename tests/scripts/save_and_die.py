"""Commits checkpoint 1, then starts saving checkpoint 2 and stops at ``--moment`` (printing
``at <moment>``) so the test can ``kill -9`` it there.

Moments (Orbax internals, patched here only): ``created`` (the step's temporary directory
exists, nothing written), ``writing`` (the state is written, the ``extra`` item is not),
``committing`` (everything written, the atomic rename not yet done).
"""

import argparse
import asyncio
import sys
import time

import shardkit as sk
from shardkit.checkpoint import Checkpointer

sk.use_cpu_devices(8)

from orbax.checkpoint import JsonCheckpointHandler  # noqa: E402
from orbax.checkpoint._src.path import atomicity  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import tiny  # noqa: E402


def pause(moment):
    print(f"at {moment}", flush=True)
    time.sleep(60)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--moment", choices=("created", "writing", "committing"), required=True)
    a = p.parse_args()
    plan, step = tiny.make_step("data=8")
    ckpt = Checkpointer(a.dir, keep=1)
    state = step.init(tiny.init_params, seed=0)
    state, _ = step(state, tiny.batch(0))
    ckpt.save(state, extra={"data_position": 1})
    ckpt.wait()
    print("committed 1", flush=True)
    state, _ = step(state, tiny.batch(1))

    cls = atomicity.AtomicRenameTemporaryPath
    create, finalize, json_save = cls.create, cls.finalize, JsonCheckpointHandler._save_fn

    async def patched_create(self):
        path = await create(self)
        if a.moment == "created" and self.get_final().name == "2":
            await asyncio.to_thread(pause, "created")
        return path

    async def patched_finalize(self):
        if a.moment == "committing" and self.get_final().name == "2":
            await asyncio.to_thread(pause, "committing")
        return await finalize(self)

    async def patched_json(self, x, directory):
        if a.moment == "writing":
            await asyncio.to_thread(pause, "writing")
        return await json_save(self, x, directory)

    cls.create, cls.finalize, JsonCheckpointHandler._save_fn = patched_create, patched_finalize, patched_json
    ckpt.save(state, extra={"data_position": 2})
    ckpt.wait()
    print("committed 2 (the test should have killed this process)", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
