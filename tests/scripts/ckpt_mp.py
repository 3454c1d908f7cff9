"""The tiny MLP (hidden width 512) on ``fsdp=8`` ZeRO-3 as one job of any number of processes,
for checkpoint integrity across hosts (run it under ``shardkit launch``).

``--save DIR`` trains 2 steps and saves steps 1 and 2 (each process checksums only the shards
it holds). ``--restore DIR`` resumes with ``fallback=True`` on every process; each prints
``restored <step> skipped <steps> verified <bool> process <i>``. With both, ``--wait-for FILE``
holds every process between the two until FILE exists (the test damages the saved steps
meanwhile): one job, one start-up, for both halves.
"""

import argparse
import os
import sys
import time

import shardkit as sk
from shardkit import distributed
from shardkit.checkpoint import Checkpointer

p = argparse.ArgumentParser()
p.add_argument("--save", default=None)
p.add_argument("--restore", default=None)
p.add_argument("--wait-for", default=None)
a = p.parse_args()

if distributed.initialize(timeout_s=60, heartbeat_timeout_s=10) is None:
    sk.use_cpu_devices(8)

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402


def init(key):
    return tiny.init_params(key, d_hid=512)


plan, step = tiny.make_step("fsdp=8", zero=3)
rows = distributed.local_rows(plan, tiny.BATCH)
if a.save:
    state = step.init(init, seed=0)
    with Checkpointer(a.save, keep=None) as ckpt:
        for i in range(2):
            state, _ = step(state, tiny.batch(i, rows))
            ckpt.save(state, extra={"data_position": i + 1})
    print(f"saved process {jax.process_index()}", flush=True)
while a.wait_for and not os.path.exists(a.wait_for):
    time.sleep(0.1)
if a.restore:
    ckpt = Checkpointer(a.restore)
    state, extra = ckpt.resume(plan, like=step.abstract_state(init), fallback=True)
    info = ckpt.last_restore
    print(f"restored {info.step} skipped {[s for s, _ in info.skipped]} verified {info.verified} "
          f"position {extra['data_position']} process {jax.process_index()}", flush=True)
