"""The ``shardkit plan`` command: the analytic layout ranking (``rank.search``) of a bundled
recipe size on N accelerators, printed; with ``--verify K`` the best K compiled for a target
and re-ranked (the recipe passes its step builder)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from .. import hardware as hw_lib
from .rank import search, weak_scaling


def plan_main(argv: list[str], build_for: Callable | None = None) -> int:
    """``shardkit plan``. ``build_for(size, global_batch, seq, precision, target)`` returns a
    ``search(build=)`` function for the recipe (the ``shardkit`` command passes the
    transformer recipe's); without one ``--verify`` is refused."""
    p = argparse.ArgumentParser(prog="shardkit plan", description=(
        "Rank mesh layouts of a bundled transformer size on N accelerators by estimated step "
        "time (analytic model; no accelerator needed); --verify K compiles the best K for --target "
        "with that accelerator's compiler, deviceless, and re-ranks them."))
    p.add_argument("--model", default="1b", help="recipe size: 125m, 1b, 7b (default 1b)")
    p.add_argument("--devices", type=int, default=256)
    p.add_argument("--hardware", default="h100", help=f"one of {', '.join(sorted(hw_lib.HARDWARE))}")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step (default 2 per device)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--memory-limit", type=float, default=None, help="GB per device (default 90%% of HBM)")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--verify", type=int, default=0, help="compile the best K layouts and re-rank them (default 0)")
    p.add_argument("--target", default="cpu",
                   help="compiler for --verify: h100, h200, a100, b200, tpu-v5e, tpu-v5p, tpu-v6e, "
                        "cpu (simulated devices; default)")
    p.add_argument("--precision", default="bf16")
    p.add_argument("--weak-scaling", action="store_true", help="also predict 8→N weak scaling of the best layout")
    p.add_argument("--json", default=None, help="write the ranked rows to this file")
    p.add_argument("--png", default=None, help="save a comparison chart of the top layouts")
    a = p.parse_args(argv)
    from rich.console import Console

    console = Console(width=150)
    global_batch = a.global_batch or 2 * a.devices
    verify = {}
    if a.verify:
        if build_for is None:
            print("shardkit plan: --verify needs the recipe's step builder (run it as `shardkit plan`)",
                  file=sys.stderr)
            return 2
        verify = {"verify": a.verify, "target": a.target,
                  "build": build_for(a.model, global_batch, a.seq, a.precision, a.target)}
    try:
        res = search(a.model, a.devices, a.hardware, global_batch=global_batch, seq=a.seq,
                     precision=a.precision, memory_limit=a.memory_limit * 1e9 if a.memory_limit else None,
                     **verify)
    except ValueError as e:
        print(f"shardkit plan: {e}", file=sys.stderr)
        return 2
    console.print(res.table(a.top))
    if not res.best.fits:
        console.print("[red]no layout fits in memory[/red]: add devices, lower the batch or seq, or raise --memory-limit")
    scaling = None
    if a.weak_scaling:
        devs = [n for n in (8, 16, 32, 64, 128, 256, 512, 1024) if n <= a.devices]
        scaling = weak_scaling(a.model, res.best.layout, a.hardware,
                               per_device_batch=res.global_batch / a.devices, devices=devs, seq=a.seq)
        for r in scaling:
            console.print(f"  {r['devices']:5d} devices  {r['layout']:48s} {r['tokens_per_s_per_device']:10,.0f} "
                          f"tok/s/dev  efficiency {r['efficiency']:.1%}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": res.shown_rows(a.top), "weak_scaling": scaling}, f, indent=1)
    if a.png:
        from ... import viz

        viz.save(viz.compare_layouts(res, top=min(a.top, 12)), a.png)
        console.print(f"saved {a.png}")
    return 0
