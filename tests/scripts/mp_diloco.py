"""DiLoCo with its replica axis across two processes: the tiny MLP on ``make_mesh("data=4",
dcn="replica=2")`` (each process one replica, its 4 devices the inner data axis), inner Adam,
outer Nesterov, a sync every 2 steps. Imported by the test for the 1-process reference; run as a
2-process job (``shardkit launch --processes 2 --devices-per-process 4``) it trains ``--steps``
steps, each process loading only its rows, and process 0 prints ``RESULT {json}``: the losses
(``float.hex``), the processes of each replica-axis group and the final outer parameters.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tiny  # beside this file: on sys.path when run as a script, and put there by the tests

import shardkit as sk
from shardkit import distributed

EVERY = 2


def build():
    """``(plan, step)``: DiLoCo over the slow ``replica`` axis of a 2 x 4 mesh."""
    mesh = sk.make_mesh("data=4", dcn="replica=2")
    plan = sk.Plan(mesh, rules=[(r".*", ())])

    @sk.train_step(plan, optax.adam(1e-2), outer=sk.DiLoCo(every=EVERY))
    def step(p, batch):
        h = jnp.tanh(batch["x"] @ p["w1"] + p["b1"][None, :])
        return jnp.mean((h @ p["w2"] - batch["y"]) ** 2)

    return plan, step


def replica_groups(mesh) -> list[list[int]]:
    """The processes of the devices along ``replica``, one list per position on the other axes."""
    devs = np.moveaxis(mesh.devices, list(mesh.axis_names).index("replica"), -1).reshape(-1, mesh.shape["replica"])
    return [sorted({d.process_index for d in g}) for g in devs]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    if distributed.initialize(timeout_s=60, heartbeat_timeout_s=20) is None:
        raise SystemExit("run under `shardkit launch --processes 2 --devices-per-process 4`")
    plan, step = build()
    rows = distributed.local_rows(plan, tiny.BATCH)
    state = step.init(tiny.init_params, seed=0)
    losses = []
    for i in range(a.steps):
        state, metrics = step(state, tiny.batch(i, rows))
        losses.append(float(metrics["loss"]).hex())
    outer = jax.tree.map(lambda x: np.asarray(x).tolist(), state.outer.params[0])  # replicated over replica
    if jax.process_index() == 0:
        print("RESULT " + json.dumps({"loss": losses, "groups": replica_groups(plan.mesh), "rows": [rows.start, rows.stop],
                                      "outer": outer}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
