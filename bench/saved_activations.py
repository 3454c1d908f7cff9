"""Saved activations per layer and sequence, compiled vs counted: the recipe transformer at the
given widths, compiled by a target's XLA (deviceless) at 2/4 layers x 1/2 sequences a device;
the mixed difference of the four temporaries is what one layer keeps for one sequence (what
grows with layers alone or with sequences alone cancels). Beside it the ``ModelShape`` estimate
(``sk.cost.estimate``'s activations term per layer) with Korthikanti et al.'s GPT count and with
``activations="xla"`` (the count of the recipe's residuals, ``roles._xla_layer_bytes``).

    python bench/saved_activations.py --mesh data=8 --seq 2048                      # 7B widths
    python bench/saved_activations.py --mesh data=2,tensor=4 --sp --shape d_model=2048,heads=16,kv_heads=4,d_ff=5632
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GIB = 2 ** 30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="", help="Config fields over SIZES['7b'], e.g. d_model=2048,heads=16")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--mesh", default="data=8")
    p.add_argument("--sp", action="store_true", help="sequence parallelism over tensor")
    p.add_argument("--remat", default="none,dots")
    p.add_argument("--target", default="h100")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    import shardkit as sk
    from shardkit import cost
    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    shape = {k: int(v) for k, v in (kv.split("=") for kv in a.shape.split(",") if kv)}
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in a.mesh.split(","))}
    data, tensor = sizes.get("data", 1), sizes.get("tensor", 1)
    zero = 3 if data > 1 else 0  # the states small beside the activations
    amesh = sk.cost.abstract_mesh(a.mesh, target=a.target)
    grid = ((2, 1), (4, 1), (2, 2), (4, 2))
    remats = a.remat.split(",")
    jobs, keys = [], []
    for r in remats:
        for layers, n in grid:
            cfg = dataclasses.replace(SIZES["7b"], layers=layers, remat=r, seq=a.seq, **shape)
            step, state, batch = abstract_step(cfg, amesh, global_batch=data * n, zero=zero, precision="bf16",
                                               sequence_parallel=a.sp, target=a.target)
            jobs.append((step, state, batch, a.mesh))
            keys.append((r, layers, n))
    t0 = time.perf_counter()
    reports = dict(zip(keys, sk.cost.simulate_many(jobs, target=a.target, timeout=3600)))
    rows = []
    for r in remats:
        failed = [k for k in keys if k[0] == r and isinstance(reports[k], Exception)]
        if failed:
            print(f"remat {r}: {failed[0]} failed: {str(reports[failed[0]])[:300]}")
            continue

        def temps(layers, n, r=r):
            return float(reports[r, layers, n].memory["temporaries"])

        compiled = (temps(4, 2) - temps(2, 2) - temps(4, 1) + temps(2, 1)) / 2
        cfg = dataclasses.replace(SIZES["7b"], remat=r, seq=a.seq, **shape)
        lo = cost.Layout(data=data, tensor=tensor, zero=zero, remat=r, sequence_parallel=a.sp)
        row = {"remat": r, "compiled": compiled}
        for act in ("korthikanti", "xla"):
            ms = dataclasses.replace(cost.model_shape(cfg), activations=act)
            est = cost.estimate(ms, lo, a.target, global_batch=data, precision="bf16")
            row[act] = float(est.memory["activations"]) / cfg.layers
        rows.append(row)
        print(f"{a.shape or '7b'} {a.mesh}{' +SP' if a.sp else ''} remat {r}: compiled {compiled / GIB:.4f} GiB per "
              f"layer and sequence; Korthikanti {row['korthikanti'] / GIB:.4f} ({row['korthikanti'] / compiled - 1:+.0%}),"
              f" xla {row['xla'] / GIB:.4f} ({row['xla'] / compiled - 1:+.0%})")
    print(f"{time.perf_counter() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()
