"""Trains the tiny MLP the way a recipe would: periodic checkpoints, SIGTERM → save at the next
step boundary and exit 0, ``--resume`` continues from the latest checkpoint and data position.

Prints one ``loss <step> <float.hex>`` line per step (exact values, for bit-identity checks).
"""

import argparse
import sys
import time

import shardkit as sk
from shardkit import distributed
from shardkit.checkpoint import Checkpointer, PreemptionGuard

if distributed.initialize(timeout_s=60, heartbeat_timeout_s=10) is None:  # else: under shardkit launch
    sk.use_cpu_devices(8)

import jax  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import tiny  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--mesh", default="data=8")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--delay", type=float, default=0.0, help="sleep per step (gives a signal time to land)")
    a = p.parse_args(argv)

    plan, step = tiny.make_step(a.mesh, a.zero)
    ckpt = Checkpointer(a.dir, keep=2, every=a.every)
    guard = PreemptionGuard()
    rows = distributed.local_rows(plan, tiny.BATCH)  # all rows on one process
    state = step.init(tiny.init_params, seed=0)
    start = 0
    if a.resume and ckpt.latest_step() is not None:
        state = ckpt.restore(plan, like=state)
        start = ckpt.extra()["data_position"]
        if distributed.is_main():
            print(f"resumed {start}", flush=True)
    for i in range(start, a.steps):
        state, metrics = step(state, tiny.batch(i, rows))
        loss = float(metrics["loss"])
        if distributed.is_main():
            print(f"loss {i} {loss.hex()}", flush=True)
        ckpt.save(state, extra={"data_position": i + 1})
        if guard.should_stop(i + 1):
            ckpt.save(state, extra={"data_position": i + 1}, force=True)
            ckpt.wait()
            print(f"preempted {i + 1} (process {jax.process_index()})", flush=True)
            return 0
        time.sleep(a.delay)
    ckpt.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
