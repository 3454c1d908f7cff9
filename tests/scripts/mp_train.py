"""The tiny MLP on a ``data=8`` mesh as one job of any number of processes (run it under
``shardkit launch`` or with the ``JAX_*`` variables set); each process loads only its rows.

Process 0 prints ``loss <step> <float.hex>``. ``--save DIR`` checkpoints the final state; then
``--restore DIR`` resumes from that checkpoint (saved by any number of processes) up to
``--steps`` and prints ``resumed <step> <float.hex>``.
``--die-rank R --die-at S``: process R kills itself (SIGKILL) before step S; the others keep
stepping, so the test sees how fast they notice. ``--die-signal STOP`` freezes it instead (SIGSTOP:
its sockets stay open and nothing answers, like a hung or unreachable host); it prints
``dying <time> <pid>`` first, so whoever runs it can time the survivors and end it.
"""

import argparse
import os
import signal
import sys
import time

import shardkit as sk
from shardkit import distributed
from shardkit.checkpoint import Checkpointer

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--save", default=None)
p.add_argument("--restore", default=None)
p.add_argument("--die-rank", type=int, default=None)
p.add_argument("--die-at", type=int, default=3)
p.add_argument("--die-signal", choices=["KILL", "STOP"], default="KILL")
p.add_argument("--heartbeat", type=int, default=10)
a = p.parse_args()

spec = distributed.initialize(timeout_s=60, heartbeat_timeout_s=a.heartbeat)
if spec is None:
    sk.use_cpu_devices(8)

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

plan, step = tiny.make_step("data=8")
rows = distributed.local_rows(plan, tiny.BATCH)
state = step.init(tiny.init_params, seed=0)
if distributed.is_main():
    print(f"processes {jax.process_count()} devices {jax.device_count()} rows {rows.start}:{rows.stop}", flush=True)
for i in range(a.steps if a.die_rank is None else 10**6):
    if a.die_rank is not None and i == a.die_at:
        if jax.process_index() == a.die_rank:
            print(f"dying {time.time():.3f} {os.getpid()}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{a.die_signal}"))
        time.sleep(0.2)
    state, metrics = step(state, tiny.batch(i, rows))
    loss = float(metrics["loss"])
    if distributed.is_main():
        print(f"loss {i} {loss.hex()}", flush=True)
if a.save:
    ckpt = Checkpointer(a.save, async_save=True)
    ckpt.save(state, extra={"data_position": a.steps})
    ckpt.close()
    if distributed.is_main():
        print(f"saved {a.steps}", flush=True)
if a.restore:
    ckpt = Checkpointer(a.restore)
    state = ckpt.restore(plan, like=step.init(tiny.init_params, seed=0))
    for i in range(ckpt.extra()["data_position"], a.steps):
        state, metrics = step(state, tiny.batch(i, rows))
        loss = float(metrics["loss"])
        if distributed.is_main():
            print(f"resumed {i} {loss.hex()}", flush=True)
