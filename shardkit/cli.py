"""The ``shardkit`` command: a thin router to the recipes and tools.

Each subcommand lives beside the concept it exposes and takes its own ``argv``:
``train NAME`` → ``models.NAME.__main__.main``, ``launch`` → ``shardkit.distributed.launch_main``,
``plan`` → ``models.transformer.plan.main`` (``shardkit.cost.plan_main`` with the recipe's step builder). ``mesh`` is small enough to live here.
"""

from __future__ import annotations

import argparse
import importlib
import sys

RECIPES = ("transformer", "resnet")

_TOOLS = {
    "launch": ("shardkit.distributed", "launch_main", "run a multi-process job on this machine (loopback)"),
    # The recipe builds the steps that --verify compiles; the ranking itself is sk.cost.plan_main.
    "plan": ("models.transformer.plan", "main", "rank mesh layouts for a recipe model on N accelerators"),
}


def _mesh(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="shardkit mesh", description="Show how a mesh spec lays out devices.")
    p.add_argument("spec", help="e.g. 'data=2,fsdp=2,tensor=2' (one size may be -1)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--dcn", default=None, help="outer (cross-slice / cross-host) axes, e.g. 'data=2'")
    a = p.parse_args(argv)
    from . import mesh as m

    m.use_cpu_devices(a.devices)
    try:
        print(m.describe_mesh(m.make_mesh(a.spec, dcn=a.dcn)))
    except ValueError as e:
        print(f"shardkit mesh: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="shardkit",
        description="JAX SPMD sharding toolkit: data, ZeRO, tensor and pipeline parallel train steps.",
        epilog="Run 'shardkit COMMAND --help' for a command's options.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    t = sub.add_parser("train", help=f"train a bundled recipe ({', '.join(RECIPES)})", add_help=False)
    t.add_argument("recipe", nargs="?", choices=RECIPES, help="then the recipe's flags ('shardkit train RECIPE --help')")
    sub.add_parser("mesh", help="show how a mesh spec lays out devices", add_help=False)
    for name, (_, _, text) in _TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0
    command, rest, kwargs = argv[0], argv[1:], {}
    if command == "mesh":
        return _mesh(rest)
    if command == "train":
        if rest[:1] in (["-h"], ["--help"]):
            t.print_help()
            return 0
        if not rest or rest[0] not in RECIPES:
            print(f"shardkit train: name a recipe: {', '.join(RECIPES)} (e.g. 'shardkit train transformer --help')",
                  file=sys.stderr)
            return 2
        target = (f"models.{rest[0]}.__main__", "main")
        # --help and errors name the command as typed, not `python -m models.NAME`.
        kwargs = {"prog": f"shardkit train {rest[0]}"}
        rest = rest[1:]
    elif command in _TOOLS:
        target = _TOOLS[command][:2]
    else:
        p.print_usage(sys.stderr)
        print(f"shardkit: unknown command {command!r}", file=sys.stderr)
        return 2
    try:
        fn = getattr(importlib.import_module(target[0]), target[1])
    except (ImportError, AttributeError) as e:
        print(f"shardkit {command}: not available in this install ({e})", file=sys.stderr)
        return 2
    return int(fn(rest, **kwargs) or 0)


if __name__ == "__main__":
    sys.exit(main())
