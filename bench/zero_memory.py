"""Per-device bytes of ZeRO stages 0-3 vs the ZeRO paper's formulas.

A stack of f32 MLP weights (Ψ parameters) trained with Adam on a ``data=N`` mesh. The formula
column is shardkit's f32 form of Rajbhandari et al. (SC'20): persistent state 4Ψ + 8Ψ (DP),
4Ψ + 8Ψ/N (ZeRO-1/2), 12Ψ/N (ZeRO-3); gradients 4Ψ, or 4Ψ/N from ZeRO-2 on. "compiled args"
is XLA's ``memory_analysis().argument_size_in_bytes`` of the compiled step (state + batch).

    python bench/zero_memory.py [--devices 8] [--d 512] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default="bench/results/zero_memory.json")
    return ap.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts


import shardkit as sk  # noqa: E402


def main(argv=None) -> None:
    a = parse_args(argv)
    sk.use_cpu_devices(a.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from rich.console import Console
    from rich.table import Table

    n, d, L = a.devices, a.d, a.layers
    psi = L * d * 4 * d * 2
    mesh = sk.make_mesh(f"data={n}")

    def loss_fn(p, batch):
        def layer(x, w):
            return jnp.tanh(sk.constrain(x @ w["up"], ("batch", None))) @ w["down"], None
        y, _ = jax.lax.scan(layer, batch["x"], p)
        return jnp.mean(y ** 2)

    def init():
        k1, k2 = jax.random.split(jax.random.key(0))
        return {"up": jax.random.normal(k1, (L, d, 4 * d)) * 0.02, "down": jax.random.normal(k2, (L, 4 * d, d)) * 0.02}

    batch = {"x": np.ones((2 * n, d), np.float32)}
    rows, out = [], []
    for zero in range(4):
        plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules={"batch": "data"}, zero=zero)
        step = sk.train_step(plan, optax.adam(1e-3))(loss_fn)
        state = step.init(init)
        r = step.explain(state, batch)
        state_bytes = r.memory["params"] + r.memory["opt_state"]
        formula = 4 * psi / (n if zero == 3 else 1) + 8 * psi / (n if zero >= 1 else 1)
        grad_formula = 4 * psi / (n if zero >= 2 else 1)
        rec = {"zero": zero, "params": r.memory["params"], "opt_state": r.memory["opt_state"],
               "state": state_bytes, "formula_state": formula, "grads": r.memory["grads"],
               "formula_grads": grad_formula, "compiled_arguments": r.memory["arguments"],
               "compiled_temporaries": r.memory["temporaries"], "ratio": state_bytes / formula}
        out.append(rec)
        del state
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    t = Table(title=f"ZeRO per-device memory, Adam f32, Ψ = {psi:,} params, data={n} (MiB)")
    for c in ("stage", "params", "opt state", "state", "formula 12Ψ form", "ratio", "grads", "formula",
              "compiled args", "compiled temp"):
        t.add_column(c, justify="right")
    for r in out:
        t.add_row(str(r["zero"]), mib(r["params"]), mib(r["opt_state"]), mib(r["state"]), mib(r["formula_state"]),
                  f"{r['ratio']:.4f}", mib(r["grads"]), mib(r["formula_grads"]), mib(r["compiled_arguments"]),
                  mib(r["compiled_temporaries"]))
    Console(width=150).print(t)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"devices": n, "psi": psi, "rows": out}, fh, indent=2)


if __name__ == "__main__":
    main()
