"""The README's MLP on hybrid meshes, compiled deviceless for 8 H100s and a TPU v5p slice of 8:
which collectives reduce the gradients and gather the weights, per device (issue 36).

2 layers, d 1024, f 4096, bf16, AdamW, w1 ("fsdp", "tensor"), w2 ("tensor", "fsdp"), one
microbatch of 1024 rows; each layout's ZeRO stages. Ψ = 16.8 M parameters. The ZeRO formulas
(FORMULAS.md) per device: gradients reduced once, Ψ/t bf16 elements (t the tensor size) by one
reduce-scatter over the batch axes; ZeRO-1/2 gather the updated f32 masters over data once
(Ψ/(t·f) elements); FSDP (ZeRO-3) gathers Ψ/t bf16 elements per use.

    python bench/hybrid_zero.py [--targets h100 tpu-v5p] [--d 1024 --f 4096 --rows 1024]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LAYOUTS = [("data=2,fsdp=2,tensor=2", z) for z in (1, 2, 3)] + [("data=4,fsdp=2", z) for z in (1, 2, 3)] + [
    ("data=2,tensor=4", z) for z in (1, 2)] + [("data=8", 2)]


def mlp_step(mesh_spec: str, zero: int, d: int, f: int, rows: int, layers: int = 2):
    """``(step, abstract state, batch)`` of the issue's README-style MLP (w1 ("fsdp", "tensor"),
    w2 ("tensor", "fsdp"), bf16, AdamW) on ``mesh_spec``; tests/target_sweep.py compiles the same."""
    import jax
    import jax.numpy as jnp
    import optax

    import shardkit as sk

    mesh = sk.make_mesh(mesh_spec)
    ax = lambda a: a if a in mesh.shape else None  # noqa: E731
    plan = sk.Plan(mesh, rules=[(r"w1", (ax("fsdp"), ax("tensor"))), (r"w2", (ax("tensor"), ax("fsdp"))), (r".*", ())],
                   axis_rules={"batch": tuple(a for a in ("data", "fsdp") if a in mesh.shape), "mlp": ax("tensor")},
                   zero=zero, precision="bf16")

    def loss(params, batch):
        x = sk.constrain(batch["x"], ("batch", None))
        for layer in params.values():
            x = jax.nn.gelu(sk.constrain(x @ layer["w1"], ("batch", "mlp"))) @ layer["w2"]
        return jnp.mean((x - batch["y"]) ** 2)

    step = sk.train_step(plan, optax.adamw(3e-4))(loss)
    state = step.abstract_state(lambda: {f"l{i}": {"w1": jnp.zeros((d, f)), "w2": jnp.zeros((f, d))} for i in range(layers)})
    row = jax.ShapeDtypeStruct((rows, d), jnp.float32)
    return step, state, {"x": row, "y": row}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", nargs="+", default=["h100", "tpu-v5p"])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--f", type=int, default=4096)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/hybrid_zero.json")
    a = ap.parse_args()
    import shardkit as sk

    sk.use_cpu_devices(8)  # this process plans and traces; the compiles are a subprocess
    result = {}
    for target in a.targets:
        jobs = [(*mlp_step(m, z, a.d, a.f, a.rows), m) for m, z in LAYOUTS]
        rows = []
        print(f"\n{target}: collectives per device (MB; reduce-scatter: result / operand)")
        for (mesh, zero), r in zip(LAYOUTS, sk.cost.simulate_many(jobs, target=target, timeout=3600)):
            if isinstance(r, Exception):
                print(f"{mesh} ZeRO-{zero}: {r}")
                continue
            ops = [{"kind": t.kind, "axes": list(t.axes), "count": t.count, "bytes": t.bytes,
                    "operand_bytes": t.operand_bytes} for t in r.traffic if t.bytes >= 1024]
            rows.append({"mesh": mesh, "zero": zero, "traffic": ops})
            cells = [f"{t['kind']} {','.join(t['axes'])} "
                     + (f"{t['bytes'] / 1e6:.1f}/{t['operand_bytes'] / 1e6:.1f}" if t["kind"] == "reduce-scatter"
                        else f"{t['bytes'] / 1e6:.1f}") for t in sorted(ops, key=lambda t: (t["kind"], t["axes"]))]
            print(f"{mesh:24s} ZeRO-{zero}: " + "; ".join(cells))
        result[target] = rows
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
