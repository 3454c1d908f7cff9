"""shardkit's train step vs a hand-written ``jax.jit`` with identical shardings.

Both run the same MLP step (Megatron TP + ZeRO-3 over data/fsdp, AdamW, f32) from host NumPy
batches; runs are interleaved (A, B, A, B, ...) so machine noise hits both alike, and the table
reports the median time of each and their ratio (target: shardkit / hand-written <= 1.02).

    python bench/overhead.py [--steps 60] [--mesh data=2,fsdp=2,tensor=2] [--zero 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mesh", default="data=2,fsdp=2,tensor=2")
    ap.add_argument("--zero", type=int, default=3)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default="bench/results/overhead.json")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402


def main(argv=None) -> None:
    a = parse_args(argv)
    sk.use_cpu_devices(8)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from rich.console import Console
    from rich.table import Table

    d, f = a.d, 4 * a.d
    mesh = sk.make_mesh(a.mesh)
    plan = sk.Plan(mesh, rules=[(r"w1", ("fsdp", "tensor")), (r"w2", ("tensor", "fsdp")), (r".*", ())],
                   axis_rules={"batch": ("data", "fsdp"), "mlp": "tensor"}, zero=a.zero)
    tx = optax.adamw(1e-3)

    def loss_fn(p, batch):
        x = sk.constrain(batch["x"], ("batch", None))
        h = jax.nn.gelu(sk.constrain(x @ p["w1"], ("batch", "mlp")))
        return jnp.mean((sk.constrain(h @ p["w2"], ("batch", None)) - batch["y"]) ** 2)

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"w1": jax.random.normal(k1, (d, f)) / d ** 0.5, "w2": jax.random.normal(k2, (f, d)) / f ** 0.5}

    step = sk.train_step(plan, tx)(loss_fn)
    state = step.init(init)
    rng = np.random.RandomState(0)
    batch = {"x": rng.randn(a.batch, d).astype(np.float32), "y": rng.randn(a.batch, d).astype(np.float32)}

    # The hand-written twin: the same math, the same shardings, written against jax.jit directly.
    sh = step.state_shardings(state)
    batch_sh = plan.batch_shardings(batch)
    layout = plan.param_layout(state.params)
    zero_sh = plan.shardings(layout.tree(layout.zero_specs))

    def hand_step(params, opt_state, batch):
        with plan.active():
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        wsc = jax.lax.with_sharding_constraint
        upd = zero_sh if a.zero >= 1 else sh.params
        grads = wsc(grads, plan.shardings(plan.grad_specs(params)))
        grads, p = wsc(grads, upd), wsc(params, upd)
        updates, opt_state = tx.update(grads, opt_state, p)
        return wsc(optax.apply_updates(p, updates), sh.params), opt_state, (loss, optax.tree.norm(grads))

    hand = jax.jit(hand_step, in_shardings=(sh.params, sh.opt_state, batch_sh),
                   out_shardings=(sh.params, sh.opt_state, plan.sharding(jax.sharding.PartitionSpec())),
                   donate_argnums=(0, 1))
    hp, ho = jax.tree.map(jnp.copy, (state.params, state.opt_state))
    with plan.active():
        hp, ho, _ = hand(hp, ho, jax.device_put(batch, batch_sh))
    state, m = step(state, batch)
    jax.block_until_ready((hp, m))

    t_sk, t_hand = [], []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
        t_sk.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hp, ho, (loss, _) = hand(hp, ho, jax.device_put(batch, batch_sh))
        jax.block_until_ready(loss)
        t_hand.append(time.perf_counter() - t0)
    med_sk, med_hand = statistics.median(t_sk), statistics.median(t_hand)
    ratio = med_sk / med_hand
    table = Table(title=f"train-step overhead: {a.mesh}, ZeRO-{a.zero}, MLP d={d}, batch={a.batch}, {a.steps} interleaved steps")
    for c in ("variant", "median ms", "p10 ms", "p90 ms"):
        table.add_column(c, justify="right" if c != "variant" else "left")
    for name, ts in (("shardkit @train_step", t_sk), ("hand-written jax.jit", t_hand)):
        q = np.percentile(np.array(ts) * 1e3, [10, 90])
        table.add_row(name, f"{statistics.median(ts) * 1e3:.2f}", f"{q[0]:.2f}", f"{q[1]:.2f}")
    table.add_row("ratio (target <= 1.02)", f"{ratio:.3f}", "", "")
    Console(width=120).print(table)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"mesh": a.mesh, "zero": a.zero, "d": d, "batch": a.batch, "steps": a.steps,
                   "median_s_shardkit": med_sk, "median_s_hand": med_hand, "ratio": ratio}, fh, indent=2)


if __name__ == "__main__":
    main()
