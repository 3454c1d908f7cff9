"""Train a ResNet: ``python -m models.resnet`` or ``shardkit train resnet``.

The default run trains a narrow ResNet-18 on scikit-learn's digits (32x32) on 8 simulated
CPU devices in a few minutes; ``--mesh``, ``--zero`` and ``--channels`` change only the layout.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax

import shardkit as sk

from ..checkpointing import open_and_resume
from ..common import metrics as metrics_lib
from ..common import runconfig
from ..common import schedules
from . import data
from .config import DEPTHS, STEMS, Config
from .train import OPTIMIZERS, Evaluator, compiled_memory, init_state, make_optimizer, make_plan, make_step, state_bytes_per_device

PROG = "python -m models.resnet"
DEFAULT_LR = {"adamw": 3e-3, "sgd": 0.1}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block: the message names the bad flag
        raise _UsageError(f"{message} (see --help)")


class _UsageError(Exception):
    pass


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The recipe's flags; ``prog`` is the command the user typed (``shardkit train resnet``)."""
    p = _Parser(prog=prog, description="Train ResNet-18/50 with global-batch BatchNorm on a shardkit mesh.")
    a = p.add_argument
    a("--mesh", default="data=8", help="mesh layout, e.g. 'data=8' or 'data=2,fsdp=4' (default data=8)")
    a("--zero", type=int, choices=(0, 1, 2, 3), default=0, help="ZeRO stage: 0 data parallel .. 3 FSDP")
    a("--precision", default="fp32", choices=[p for p in sk.Precision.PRESETS if p != "fp8"], help="dtype policy (default fp32)")
    a("--channels", default=None, metavar="AXIS", help="shard conv channels over this mesh axis (e.g. tensor)")
    a("--depth", type=int, choices=sorted(DEPTHS), default=18, help="ResNet depth (default 18)")
    a("--width", type=float, default=0.25, help="multiplier on widths 64..512 (default 0.25; 1.0 is standard)")
    a("--stem", choices=("auto",) + STEMS, default="auto", help="auto: cifar below 128 px, else imagenet")
    a("--dataset", default="digits", help="digits | synthetic | folder:PATH | npy:PATH (default digits)")
    a("--image-size", type=int, default=None, help="side of the square images (digits 32, synthetic 224, folder 32)")
    a("--shift", type=int, default=None, help="random-shift augmentation in pixels (digits: one digit pixel, 3 at 32 px; others: 0)")
    a("--steps", type=int, default=200, help="training steps (default 200)")
    a("--batch", type=int, default=64, help="global batch size (default 64)")
    a("--microbatches", type=int, default=1, help="gradient accumulation steps per batch")
    a("--optimizer", choices=OPTIMIZERS, default="adamw", help="adamw (default) or sgd (Nesterov momentum)")
    schedules.add_flags(p, lr=None, lr_help=" (default 3e-3 adamw, 0.1 sgd)", warmup="steps/10",
                        weight_decay=5e-4, no_decay=None, grad_clip=None, min_lr_ratio=0.0)
    a("--eval-every", type=int, default=50, help="test accuracy every N steps (0: only at the end)")
    a("--seed", type=int, default=0, help="seed of the initial parameters and of the data order (default 0)")
    a("--metrics-out", default=None, metavar="FILE", help="write JSON lines of metrics here")
    metrics_lib.add_flags(p)
    a("--checkpoint-dir", default=None, metavar="DIR", help="save checkpoints here (Orbax; any mesh can restore them)")
    a("--checkpoint-every", type=int, default=0, metavar="N", help="checkpoint every N steps (0: at the end)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    a("--show-layout", action="store_true", help="print every parameter's sharding")
    a("--cpu-devices", type=int, default=8, metavar="N", help="simulated CPU devices (default 8; 0: use JAX's devices)")
    return p


def parse_args(argv: list[str], prog: str = PROG) -> argparse.Namespace:
    """The command line, checked (``_UsageError`` naming the flag)."""
    args = runconfig.parse(parser(prog), argv)  # --config FILE.toml, then the command line
    for name in ("steps", "batch", "microbatches"):
        if getattr(args, name) < 1:
            raise _UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    for name in ("eval_every", "checkpoint_every", "cpu_devices"):
        if getattr(args, name) < 0:
            raise _UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.lr is not None and not args.lr > 0:
        raise _UsageError(f"--lr must be positive, got {args.lr}")
    if args.image_size is not None and args.image_size < 8:
        raise _UsageError(f"--image-size must be at least 8, got {args.image_size}")
    if args.shift is not None and args.shift < 0:
        raise _UsageError(f"--shift must be >= 0, got {args.shift}")
    if args.resume and not args.checkpoint_dir:
        raise _UsageError("--resume needs --checkpoint-dir")
    try:
        metrics_lib.profiler_from(args)
    except ValueError as e:
        raise _UsageError(str(e)) from None
    return args


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Entry point; returns the exit status (0 on success, 2 for bad flags or data). ``prog``
    names the command in ``--help`` and errors."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv, prog)
        # Under `shardkit launch` / SLURM / Kubernetes this joins the job (the launcher sets
        # each process's device count); alone it does nothing.
        if sk.distributed.initialize() is None and args.cpu_devices:
            sk.use_cpu_devices(args.cpu_devices)
        return _train(args)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except (_UsageError, ValueError, RuntimeError, OSError, sk.checkpoint.CheckpointError) as e:
        text = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"{prog}: error: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def _train(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    console = Console(quiet=not sk.distributed.is_main())  # one host reports
    if args.checkpoint_dir and sk.distributed.is_main():  # `--config <dir>/config.toml` reproduces this run
        runconfig.write(args, args.checkpoint_dir)
    mesh = sk.make_mesh(args.mesh)
    ds = data.load(args.dataset, image_size=args.image_size, shift=args.shift)
    h, _, c = ds.image_shape
    stem = args.stem if args.stem != "auto" else ("imagenet" if h >= 128 else "cifar")
    cfg = Config(depth=args.depth, num_classes=ds.num_classes, in_channels=c, stem=stem, width=args.width)
    plan = make_plan(mesh, zero=args.zero, precision=args.precision, channels=args.channels)
    plan.check_axes_used()  # e.g. --mesh data=4,tensor=2 without --channels tensor: refused before compiling
    need = plan.batch_size_multiple * args.microbatches
    if args.batch % need:
        raise ValueError(f"--batch {args.batch} is not a multiple of {need} (the batch axes {plan.batch_axes} "
                         f"hold {plan.batch_size_multiple} devices x {args.microbatches} microbatches)")
    if ds.train is not None and args.batch > len(ds.train[0]):
        raise ValueError(f"--batch {args.batch} is larger than the {len(ds.train[0])} training images of {ds.name}")
    lr = args.lr if args.lr is not None else DEFAULT_LR[args.optimizer]
    optimizer = make_optimizer(args.optimizer, lr, steps=args.steps, weight_decay=args.weight_decay,
                               warmup=args.warmup_steps, decay=args.decay, min_lr_ratio=args.min_lr_ratio,
                               no_decay=args.no_decay)
    step = make_step(plan, optimizer, microbatches=args.microbatches, clip_norm=schedules.grad_clip_from(args))

    console.print(sk.describe_mesh(mesh))
    console.print(f"{plan}\nResNet-{cfg.depth} ({cfg.block}, {cfg.stem} stem, width x{cfg.width:g}) on "
                  f"{ds.name} {ds.image_shape}, {ds.num_classes} classes, batch {args.batch}")
    t0 = time.perf_counter()
    state = init_state(step, cfg, args.seed)
    ckpt, state, start, position = open_and_resume(args.checkpoint_dir, args.resume, plan, state, console)
    if args.show_layout:
        console.print(plan.describe(step.model(state)))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    batches = ds.batches(args.batch, seed=args.seed, position=position)
    # Each batch goes to the devices two steps before its step; the checkpoint records the
    # position after the batch just used, not after those placed ahead.
    feed = sk.prefetch(batches, step, size=2, position=lambda: batches.position)
    first = next(feed)
    mem = compiled_memory(step, state, first)
    per_dev = state_bytes_per_device(state)
    console.print(f"{n_params / 1e6:.2f}M parameters; init + compile {time.perf_counter() - t0:.1f}s")
    console.print("per-device memory: " + ", ".join(f"{k} {_mib(v)}" for k, v in per_dev.items())
                  + (f"; compiled step: peak {_mib(mem['peak'])} (temp {_mib(mem['temporaries'])})" if mem else ""))

    evaluator = Evaluator(step) if ds.test is not None else None
    profiler = metrics_lib.profiler_from(args)
    out = metrics_lib.MetricsWriter(args.metrics_out, args.tensorboard, sk.distributed.is_main())

    def log(record: dict) -> None:
        out.write(record, flush=True)
    test_acc, loss, acc, stopped = None, float("nan"), float("nan"), False
    guard = sk.checkpoint.PreemptionGuard()
    try:
        columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[info]}"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task("train", total=args.steps, completed=start, info="")
            for i in range(start + 1, args.steps + 1):
                batch = first if i == start + 1 else next(feed)
                t = time.perf_counter()
                with profiler.step(i):
                    state, metrics = step(state, batch)
                profiler.after(i, metrics)
                loss, acc = float(metrics["loss"]), float(metrics["aux"]["accuracy"])
                ips = args.batch / (time.perf_counter() - t)
                log({"step": i, "loss": loss, "accuracy": acc, "images_per_s": ips})
                bar.update(task, advance=1, info=f"loss {loss:.3f} acc {acc:.3f} {ips:.0f} img/s")
                if evaluator and args.eval_every and i % args.eval_every == 0 and i < args.steps:
                    test_acc = evaluator.accuracy(state, *ds.test)
                    log({"step": i, "test_accuracy": test_acc})
                    bar.console.print(f"step {i}: loss {loss:.4f}, test accuracy {test_acc:.4f}")
                stopped = guard.should_stop(i)  # SIGTERM: checkpoint at this step boundary, exit 0
                if ckpt and (stopped or i == args.steps or (args.checkpoint_every and i % args.checkpoint_every == 0)):
                    ckpt.save(state, step=i, extra={"step": i, "data": feed.position}, force=True)
                if stopped:
                    bar.console.print(f"preempted: checkpoint of step {i} saved; rerun with --resume to continue")
                    break
        if evaluator and not stopped:
            test_acc = evaluator.accuracy(state, *ds.test)
            log({"step": args.steps, "test_accuracy": test_acc, "final": True})
    finally:
        guard.close()
        profiler.close()
        if ckpt:
            ckpt.close()  # waits for the last asynchronous write
        out.close()
    if stopped:
        return 0
    took = time.perf_counter() - t0
    summary = f"final loss {loss:.4f}, train accuracy {acc:.4f}"
    summary += f", test accuracy {test_acc:.4f}" if test_acc is not None else " (no test set)"
    console.print(f"{summary}; {args.steps} steps in {took:.1f}s")
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


if __name__ == "__main__":
    sys.exit(main())
