"""Training entry point: ``python -m models.transformer`` / ``shardkit train transformer``.

With no flags it trains the tiny model on the standard-library byte corpus over 8 simulated
CPU devices (mesh ``data=2,fsdp=2,tensor=2``, sequence parallel), printing the mesh, every
parameter's sharding, per-device memory, a progress bar and validation loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import shardkit as sk

from ..checkpointing import init_from, open_and_resume
from ..common import metrics as metrics_lib
from ..common import runconfig
from ..common import schedules
from . import data as data_lib
from .config import SIZES, Config

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")  # sk.pipeline_schedule's
PRECISIONS = ("fp32", "bf16", "bf16-pure", "fp16", "fp8")



class FlagError(ValueError):
    """A command-line flag that cannot work; reported as one line naming the flag."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}")
        self.flag = flag


PROG = "python -m models.transformer"


def parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The recipe's flags; ``prog`` is the command the user typed (``shardkit train transformer``)."""
    from .layouts import MESH_AXES

    p = argparse.ArgumentParser(prog=prog, description="Train a GPT-style decoder under any shardkit layout.")
    a = p.add_argument
    a("--size", default="tiny", help=f"named model size: {', '.join(SIZES)} (default tiny)")
    a("--mesh", default="data=2,fsdp=2,tensor=2", help=f"mesh layout, axes among {', '.join(MESH_AXES)} "
      "(default data=2,fsdp=2,tensor=2)")
    a("--zero", type=int, default=0, help="ZeRO stage 0-3 over the data axes")
    a("--precision", default="fp32", help=f"one of {', '.join(PRECISIONS)}")
    a("--offload", default="", help="state kept in pinned host memory between steps, comma-separated: "
      "opt_state (the optimizer state, ZeRO-sharded; brought to the device for the update)")
    a("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
      help="shard norms/residuals over seq on the tensor axis (default: on when tensor > 1)")
    a("--layers", type=int, help="decoder layers (overrides --size)")
    a("--d-model", type=int, help="model width")
    a("--heads", type=int, help="attention heads")
    a("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    a("--seq", type=int, help="sequence length")
    a("--remat", help="activation checkpointing: none, full, dots, dots_no_batch, offload (as dots_no_batch, "
      "kept in host memory)")
    a("--dropout", type=float, help="residual dropout rate while training (default 0: off)")
    a("--moe-experts", type=int, help="experts per mixture-of-experts layer (default 0: dense); "
      "split over an `expert` mesh axis, e.g. --mesh data=2,expert=4")
    a("--moe-top-k", type=int, help="experts per token (default 2)")
    a("--moe-every", type=int, help="every N-th layer is an MoE layer (default 1: all)")
    a("--moe-capacity", type=float, help="expert capacity factor (tokens beyond it skip the "
      "layer); default: dropless")
    a("--attention", help="auto (the target's flash kernel: cuDNN on a GPU, Pallas Triton deviceless, "
      "Pallas Mosaic on TPU; jnp softmax on CPU), reference, xla, cudnn, triton, mosaic or blockwise")
    a("--loss-chunk", type=int, help="the loss in chunks of this many positions (never the whole "
      "logits); 0: plain; -1 (default): chunked on GPU/TPU targets at large vocabularies")
    a("--context-strategy", help="attention on a context axis: ring (default; K/V passed around) "
      "or allgather (K/V gathered once)")
    a("--batch", type=int, default=16, help="global batch (sequences per step)")
    a("--microbatches", type=int, help="pipeline microbatches with a pipe axis (default 2 x "
      "stages), else gradient-accumulation microbatches (default 1)")
    a("--pipeline-schedule", default="gpipe", help=f"one of {', '.join(SCHEDULES)}")
    a("--pipeline-repeats", type=int, default=None, help="layer chunks per stage (circular, interleaved-1f1b; default 2)")
    a("--pipeline-layer-order", default="natural", help="natural, or stage-major: the layers stored as the "
      "schedule reads them (no per-step relayout; checkpoints hold that order)")
    a("--diloco-every", type=int, help="DiLoCo: replicas on the mesh's `replica` axis sync every H "
      "steps (outer Nesterov SGD 0.7/0.9), e.g. --mesh replica=2,data=4 --diloco-every 50")
    a("--diloco-fragments", type=int, default=1, help="Streaming DiLoCo: layer fragments synced at "
      "staggered steps (divides --layers)")
    a("--diloco-compress", choices=["bf16", "int8", "int4"], help="quantise the outer gradients sent "
      "between replicas")
    a("--diloco-overlap", type=int, default=0, help="Streaming DiLoCo: a fragment's outer all-reduce runs "
      "beside the next inner step and its result is merged τ steps later (default 0: no overlap)")
    a("--diloco-mix", type=float, default=0.0, help="α of that merge: θ_r ← α·θ_r + (1−α)·θ_outer (default 0)")
    a("--diloco-outer-lr", type=float, default=0.7, help="DiLoCo's outer SGD learning rate (default 0.7)")
    a("--diloco-outer-momentum", type=float, default=0.9, help="its Nesterov momentum (default 0.9; 0 = "
      "plain SGD, and with --diloco-outer-lr 1 plain parameter averaging)")
    a("--steps", type=int, default=200, help="training steps (default 200)")
    a("--gpu-memory-fraction", type=float, default=sk.xla.GPU_MEMORY_FRACTION, help="on a GPU, XLA recomputes "
      f"values only past this share of the device (default {sk.xla.GPU_MEMORY_FRACTION}; run with "
      "XLA_PYTHON_CLIENT_MEM_FRACTION at least as large)")
    schedules.add_flags(p, lr=3e-3, warmup="steps/10, at most 100", weight_decay=0.1,
                        no_decay="norm|embed", grad_clip=1.0)
    a("--seed", type=int, default=0, help="seed of the initial parameters and of the data order (default 0)")
    a("--data", help="token file (.bin/.u16 uint16, .u32 uint32) or text file; default: the "
      "Python standard library as bytes")
    a("--data-format", default="auto", help="auto, text, uint16 or uint32")
    a("--tokenizer", help="SentencePiece .model or tiktoken BPE file: the text (--data, or the "
      "standard library) is tokenised once into token files, the vocab follows the tokenizer")
    a("--token-dir", help="where --tokenizer writes its token files (default ~/.cache/shardkit/tokens)")
    a("--eval-every", type=int, default=50, help="validation loss every N steps (and at the end)")
    a("--eval-batches", type=int, default=4, help="validation batches per evaluation (default 4)")
    a("--metrics-out", help="write JSON lines (step, loss, tokens_per_s, mfu; val_loss) here")
    metrics_lib.add_flags(p)
    a("--checkpoint-dir", help="save checkpoints here (Orbax; any mesh or ZeRO stage can restore them)")
    a("--checkpoint-every", type=int, default=100, help="checkpoint every N steps (and at the end)")
    a("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    a("--init-from", help="start from the latest checkpoint in this directory (its step, data position "
      "and state; a data-parallel one warm-starts a DiLoCo run, a DiLoCo one resumes as DP)")
    a("--stop-after", type=int, help="stop (evaluate, checkpoint) after this many steps of the --steps "
      "schedule, e.g. a warm-start phase that --init-from continues")
    a("--cpu-devices", type=int, default=8, help="simulated CPU devices; 0 = use the real "
      "accelerators")
    a("--quiet", action="store_true", help="no tables or progress bar")
    return p


def model_config(args) -> Config:
    if args.size not in SIZES:
        raise FlagError("--size", f"unknown size {args.size!r}; choose one of {', '.join(SIZES)}")
    changes = {k: v for k, v in (("layers", args.layers), ("d_model", args.d_model),
                                 ("heads", args.heads), ("kv_heads", args.kv_heads),
                                 ("seq", args.seq), ("remat", args.remat),
                                 ("dropout", args.dropout), ("attention", args.attention),
                                 ("context_strategy", args.context_strategy), ("loss_chunk", args.loss_chunk),
                                 ("moe_experts", args.moe_experts), ("moe_top_k", args.moe_top_k),
                                 ("moe_every", args.moe_every), ("moe_capacity", args.moe_capacity),
                                 ("fp8", True if args.precision == "fp8" else None))
               if v is not None}
    try:
        return SIZES[args.size].replace(**changes)
    except ValueError as e:
        flag = next((f for f in ("moe_experts", "moe_top_k", "moe_every", "moe_capacity",
                                 "kv_heads", "d_model", "heads", "remat", "layers", "seq", "dropout",
                                 "context_strategy", "attention", "loss_chunk")
                     if f in str(e)), "size")
        raise FlagError("--" + flag.replace("_", "-"), str(e)) from None


def _offload(args) -> tuple[str, ...]:
    return tuple(k for k in args.offload.split(",") if k)


def check_layout(args, cfg: Config, mesh_shape: dict) -> tuple[int, int]:
    """Flag checks that need the mesh; returns (pipeline microbatches, step microbatches)."""
    if args.zero not in (0, 1, 2, 3):
        raise FlagError("--zero", f"ZeRO stage {args.zero} is not 0, 1, 2 or 3")
    if args.precision not in PRECISIONS:
        raise FlagError("--precision", f"unknown precision {args.precision!r}; choose one of {', '.join(PRECISIONS)}")
    bad = [k for k in _offload(args) if k not in sk.offload.KINDS]
    if bad:
        raise FlagError("--offload", f"cannot offload {', '.join(bad)}; choose from {', '.join(sk.offload.KINDS)} "
                        "(activations: --remat offload)")
    if args.pipeline_schedule not in SCHEDULES:
        raise FlagError("--pipeline-schedule", f"unknown schedule {args.pipeline_schedule!r}; "
                        f"choose one of {', '.join(SCHEDULES)}")
    if args.pipeline_layer_order not in ("natural", "stage-major"):
        raise FlagError("--pipeline-layer-order", f"unknown layer order {args.pipeline_layer_order!r}; choose "
                        "natural or stage-major")
    if args.steps < 1:
        raise FlagError("--steps", "must be at least 1")
    if not args.lr > 0:
        raise FlagError("--lr", f"must be positive, got {args.lr}")
    tensor, stages = mesh_shape.get("tensor", 1), mesh_shape.get("pipe", 1)
    if args.precision == "fp8" and stages > 1:
        raise FlagError("--precision", "fp8 with a pipe axis is not supported: sk.pipeline sums its "
                        "microbatches' gradients, and fp8's amax histories need their max; drop pipe= from --mesh")
    if cfg.heads % tensor:
        raise FlagError("--heads", f"{cfg.heads} heads do not split over tensor={tensor}; use a "
                        f"multiple of {tensor}")
    if cfg.d_ff % tensor or cfg.vocab % tensor:
        raise FlagError("--mesh", f"tensor={tensor} does not divide d_ff={cfg.d_ff} / vocab={cfg.vocab}")
    repeats = _repeats(args)
    if cfg.layers % (stages * repeats):
        raise FlagError("--layers", f"{cfg.layers} layers do not split into pipe={stages} stages "
                        f"x {repeats} repeats; use a multiple of {stages * repeats}")
    experts = mesh_shape.get("expert", 1)
    if experts > 1 and cfg.moe_experts % experts:
        raise FlagError("--moe-experts", f"{cfg.moe_experts} experts do not split over expert={experts}; "
                        f"use a multiple of {experts}" + (" (an expert axis needs MoE layers)"
                                                          if not cfg.moe_experts else ""))
    # The batch is split over the expert axis too (each expert device routes its own tokens).
    data = math.prod(mesh_shape.get(a, 1) for a in ("replica", "data", "fsdp", "expert"))
    if stages > 1:
        pipe_mb, step_mb = args.microbatches or 2 * stages, 1
        if pipe_mb < stages:
            raise FlagError("--microbatches", f"{pipe_mb} microbatches cannot fill {stages} "
                            "pipeline stages; use at least as many as stages")
    else:
        pipe_mb, step_mb = 0, args.microbatches or 1
        if step_mb < 1:
            raise FlagError("--microbatches", "must be at least 1")
    need = data * max(pipe_mb, step_mb)
    if args.batch % need:
        raise FlagError("--batch", f"global batch {args.batch} is not divisible by data axes "
                        f"({data}) x microbatches ({max(pipe_mb, step_mb)}) = {need}")
    return pipe_mb, step_mb


def tokenizer_config(args, cfg: Config):
    """``(tokenizer or None, cfg)``: with ``--tokenizer`` the vocab is the tokenizer's, rounded
    up to a multiple of 128 (so it splits over any tensor axis up to 128)."""
    if not args.tokenizer:
        return None, cfg
    from .tokens import load_tokenizer

    try:
        tok = load_tokenizer(args.tokenizer)
    except data_lib.DataError as e:
        raise FlagError("--tokenizer", str(e)) from None
    return tok, cfg.replace(vocab=-(-tok.vocab // 128) * 128)


def load_data(args, cfg: Config, tokenizer=None):
    if tokenizer is not None:
        return _tokenized_data(args, tokenizer)
    try:
        if args.data:
            train, val = data_lib.load_tokens(args.data, fmt=args.data_format, vocab=cfg.vocab)
            return train, val, args.data
        if cfg.vocab < 256:
            raise FlagError("--size", "the byte corpus needs vocab >= 256")
        train, val = data_lib.stdlib_corpus()
        return train, val, "Python standard library (bytes)"
    except data_lib.DataError as e:
        raise FlagError("--data" if args.data else "--size", str(e)) from None


def _tokenized_data(args, tokenizer):
    import os
    import pathlib

    from .tokens import tokenize_corpus

    directory = args.token_dir or os.path.join(os.path.expanduser("~"), ".cache", "shardkit", "tokens")
    try:
        if args.data:
            text = open(args.data, "rb").read()
            cut = text.rfind(b"\n", 0, int(len(text) * 0.95)) + 1 or int(len(text) * 0.95)
            train_text, val_text, name = text[:cut], text[cut:], pathlib.Path(args.data).stem
        else:
            train_text, val_text = (bytes(t) for t in data_lib.stdlib_corpus())
            name = "stdlib"
        train, val, files = tokenize_corpus(train_text, val_text, tokenizer, directory, name)
    except OSError as e:
        raise FlagError("--data" if args.data else "--token-dir", str(e)) from None
    except data_lib.DataError as e:
        raise FlagError("--tokenizer", str(e)) from None
    return train, val, f"{args.data or 'Python standard library'} through {tokenizer.kind} " \
                       f"(vocab {tokenizer.vocab:,}; tokens in {files[0].parent})"


def main(argv: list[str] | None = None, prog: str = PROG) -> int:
    """Runs training; returns the exit status (2 for a bad flag). ``prog`` names the command in
    ``--help`` and errors."""
    args = runconfig.parse(parser(prog), argv)  # --config FILE.toml, then the command line
    try:
        if args.resume and not args.checkpoint_dir:
            raise FlagError("--resume", "needs --checkpoint-dir")
        if args.stop_after is not None and not 0 < args.stop_after <= args.steps:
            raise FlagError("--stop-after", f"must be in 1..--steps ({args.steps}), got {args.stop_after}")
        if args.checkpoint_every < 1:
            raise FlagError("--checkpoint-every", f"must be a positive integer, got {args.checkpoint_every}")
        try:  # checked before any compile: the trace window is used only once training runs
            metrics_lib.profiler_from(args)
        except ValueError as e:
            raise FlagError("--profile-steps", str(e).split(" ", 1)[1]) from None
        # Under `shardkit launch` / SLURM / Kubernetes this joins the job and the launcher sets
        # each process's devices; alone it does nothing.
        if sk.distributed.initialize() is None and args.cpu_devices:
            try:
                sk.use_cpu_devices(args.cpu_devices)
            except (ValueError, RuntimeError) as e:
                raise FlagError("--cpu-devices", str(e)) from None
        return _run(args)
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except sk.ShardingError as e:
        print(f"error: --mesh: the layout does not fit the model: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except sk.checkpoint.CheckpointError as e:
        print(f"error: --checkpoint-dir: {'; '.join(str(e).splitlines())}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import jax
    import optax
    from flax import nnx
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from shardkit.cost import hardware

    from .layouts import make_plan
    from .model import PipelineSpec, Transformer, flops_per_token, loss_fn, moe_loss_fn

    cfg = model_config(args)
    tokenizer, cfg = tokenizer_config(args, cfg)
    try:
        mesh = sk.make_mesh(args.mesh)
    except ValueError as e:
        raise FlagError("--mesh", str(e)) from None
    shape = dict(mesh.shape)
    pipe_mb, step_mb = check_layout(args, cfg, shape)
    train_tokens, val_tokens, data_name = load_data(args, cfg, tokenizer)
    sp = shape.get("tensor", 1) > 1 if args.sequence_parallel is None else args.sequence_parallel
    plan = make_plan(mesh, cfg, zero=args.zero, precision=args.precision, sequence_parallel=sp,
                     offload=_offload(args))
    plan.check_axes_used()  # the layouts' AxisRules name every axis the model uses: refuse a typo now
    pipeline = None
    if shape.get("pipe", 1) > 1:
        pipeline = PipelineSpec(pipe_mb, args.pipeline_schedule, _repeats(args), args.pipeline_layer_order)

    is_main = jax.process_index() == 0
    console = Console(quiet=args.quiet or not is_main, width=None if sys.stdout.isatty() else 150)
    if args.checkpoint_dir and is_main:  # `--config <dir>/config.toml` reproduces this run
        runconfig.write(args, args.checkpoint_dir)
    try:
        schedule = schedules.schedule_from(args, args.steps, default_warmup=max(1, min(100, args.steps // 10)))
        mask, clip_norm = schedules.decay_mask(args.no_decay), schedules.grad_clip_from(args)
    except ValueError as e:
        raise FlagError(str(e).split()[0], str(e).split(" ", 1)[1]) from None
    tx = optax.adamw(schedule(), b1=0.9, b2=0.95, weight_decay=args.weight_decay, mask=mask)

    # An MoE model's loss also returns its router statistics (tokens per expert, drops).
    objective = moe_loss_fn if cfg.moe_experts else loss_fn
    if cfg.dropout > 0:  # the step then draws a fresh key per step (and microbatch)
        def train_loss(model, batch, rng):
            return objective(model, batch, pipeline, rng=rng)
    else:
        def train_loss(model, batch):
            return objective(model, batch, pipeline)

    outer = diloco_from(args, shape, cfg)
    step = sk.train_step(plan, tx, microbatches=step_mb, clip_norm=clip_norm, outer=outer,
                         gpu_memory_fraction=args.gpu_memory_fraction)(train_loss)

    console.print(sk.describe_mesh(mesh))
    console.print(f"{plan}  sequence_parallel={sp}"
                  + (f"  pipeline={pipeline}" if pipeline else ""))
    console.print(f"model: {cfg}")
    console.print(data_lib.describe(train_tokens, val_tokens, data_name))
    state = step.init(lambda: Transformer(cfg, rngs=nnx.Rngs(args.seed)), seed=args.seed)
    ckpt, state, start, position = open_and_resume(args.checkpoint_dir, args.resume, plan, state, console)
    if args.init_from and not start:
        state, start, position = init_from(args.init_from, plan, state, console)
    stop = args.stop_after or args.steps
    if not args.quiet:
        console.print(plan.describe(step.model(state)))

    try:  # a Grain pipeline; `position` is its iterator state from the checkpoint
        batches = data_lib.Batches(train_tokens, args.batch, cfg.seq, args.seed, position=position)
    except data_lib.DataError as e:
        raise FlagError("--resume" if position is not None else "--batch", str(e)) from None
    evals = data_lib.eval_batches(val_tokens, args.batch, cfg.seq, args.eval_batches)
    t0 = time.perf_counter()
    if step.diloco:  # its programs (inner step, syncs, metrics), compiled once here; "inner" runs every step
        placed, shardings = step.place_batch(batches.batch_at(0))
        compiled = step.diloco.programs(state, placed, shardings)["inner"]
    else:
        compiled = step.compile(state, batches.batch_at(0))
    compile_s = time.perf_counter() - t0
    console.print(_memory_line(state, compiled, compile_s, "DiLoCo's programs" if step.diloco else "step"))
    replica_bytes = replica_traffic(step, state, batches.batch_at(0), compiled)
    if replica_bytes is not None:
        console.print(f"replica-axis traffic: {replica_bytes:,.0f} bytes per device per step")

    evaluate = _evaluator(step, plan, pipeline, (lambda m, b, p: moe_loss_fn(m, b, p)[1]["ce"])
                          if cfg.moe_experts else loss_fn)
    evaluated = f" (of the {step.diloco.replicas} replicas' parameters averaged)" if step.diloco else ""
    n_params = parameter_count(step, state)
    flops_tok = flops_per_token(cfg, cfg.seq)
    peak = hardware.total_peak_flops(mesh.devices.flat)
    tokens_per_step = args.batch * cfg.seq
    console.print(f"{n_params:,} parameters, {flops_tok / 1e6:.2f} MFLOP/token (6N + attention), "
                  f"peak {peak / 1e12:.2f} TFLOP/s over {mesh.devices.size} device(s)")

    profiler = metrics_lib.profiler_from(args)  # the flag was checked in main()
    tb = metrics_lib.MetricsWriter(None, args.tensorboard, is_main)  # TensorBoard beside the JSON lines
    out = open(args.metrics_out, "w") if args.metrics_out and is_main else None
    if out and replica_bytes is not None:
        out.write(json.dumps({"replica_bytes_per_step": replica_bytes}) + "\n")
    first_loss = last_loss = val_loss = float("nan")
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(),
               TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s  "
                          "MFU {task.fields[mfu]:.1%}"), TimeRemainingColumn())
    timings = []
    guard, stopped = sk.checkpoint.PreemptionGuard(), False
    try:
        with Progress(*columns, console=console, disable=args.quiet) as progress:
            task = progress.add_task("train", total=stop, completed=start, loss=float("nan"), tps=0.0, mfu=0.0)
            # Each batch goes to the devices two steps before its step; the checkpoint records
            # the position after the batch just used, not after those placed ahead.
            feed = sk.prefetch(batches, step, size=2, position=lambda: batches.position)
            for i in range(start, stop):
                batch = next(feed)
                t = time.perf_counter()
                with profiler.step(i):
                    state, metrics = step(state, batch)
                profiler.after(i, metrics)
                last_loss = float(metrics["loss"])  # waits for the step
                dt = time.perf_counter() - t
                timings.append(dt)
                first_loss = last_loss if i == start else first_loss
                tps = tokens_per_step / dt
                mfu = flops_tok * tps / peak
                progress.update(task, advance=1, loss=last_loss, tps=tps, mfu=mfu)
                if out or tb.active:
                    row = {"step": i, "loss": last_loss, "tokens_per_s": tps, "mfu": mfu}
                    # MoE: cross entropy, tokens per expert, drop fraction, router losses
                    row.update({k: jax.device_get(v).tolist() for k, v in (metrics.get("aux") or {}).items()})
                    if out:
                        out.write(json.dumps(row) + "\n")
                    tb.write(row)
                done = i + 1 == stop
                if done or (args.eval_every and (i + 1) % args.eval_every == 0):
                    val_loss = evaluate(state, evals)
                    progress.console.print(f"step {i + 1}: train loss {last_loss:.4f}  "
                                           f"validation loss {val_loss:.4f}{evaluated}")
                    if out:
                        out.write(json.dumps({"step": i, "val_loss": val_loss}) + "\n")
                    tb.write({"step": i, "val_loss": val_loss})
                stopped = guard.should_stop(i + 1)  # SIGTERM: save at this step boundary, exit 0
                if ckpt and (done or stopped or (i + 1) % args.checkpoint_every == 0):
                    ckpt.save(state, step=i + 1, extra={"step": i + 1, "data": feed.position}, force=True)
                if stopped:
                    progress.console.print(f"preempted: checkpoint of step {i + 1} saved; rerun with --resume")
                    break
    finally:
        guard.close()
        profiler.close()
        tb.close()
        if ckpt:
            ckpt.close()  # waits for the last asynchronous write
        if out:
            out.close()
    if stopped:
        return 0
    if not timings:
        console.print(f"nothing to do: the checkpoint is already at step {start} of {args.steps}")
        return 0
    steady = sorted(timings[1:] or timings)[len(timings[1:] or timings) // 2]
    if is_main:
        print(f"done: loss {first_loss:.3f} → {last_loss:.3f}, validation {val_loss:.3f}{evaluated}; "
              f"median step {steady * 1e3:.1f} ms = {tokens_per_step / steady:,.0f} tokens/s, "
              f"MFU {flops_tok * tokens_per_step / steady / peak:.1%}")
    return 0 if math.isfinite(last_loss) else 1


def diloco_from(args, shape, cfg: Config):
    """The ``sk.DiLoCo`` the --diloco-* flags ask for, or None."""
    if args.diloco_every is None:
        if args.diloco_fragments != 1 or args.diloco_compress or args.diloco_overlap or args.diloco_mix:
            raise FlagError("--diloco-every", "--diloco-fragments/--diloco-compress/--diloco-overlap/--diloco-mix "
                            "need --diloco-every H")
        return None
    if cfg.layers % max(args.diloco_fragments, 1):
        raise FlagError("--diloco-fragments", f"{args.diloco_fragments} fragments do not divide the "
                        f"{cfg.layers} layers; use a divisor of {cfg.layers}")
    if "replica" not in shape:
        raise FlagError("--mesh", f"--diloco-every needs a `replica` axis, e.g. --mesh replica=2,data=4; got {shape}")
    try:
        import optax

        m = args.diloco_outer_momentum
        outer = optax.sgd(args.diloco_outer_lr, momentum=m or None, nesterov=bool(m))
        return sk.DiLoCo(axis="replica", every=args.diloco_every, fragments=args.diloco_fragments,
                         compress=args.diloco_compress, optimizer=outer, overlap=args.diloco_overlap,
                         mix=args.diloco_mix)
    except ValueError as e:
        flag = next((f for f in ("overlap", "mix") if f"{f}=" in str(e).split(":")[0]), "every")
        raise FlagError(f"--diloco-{flag}", str(e)) from None


def replica_traffic(step, state, batch, compiled) -> float | None:
    """Bytes each device sends per step in collectives spanning the `replica` axis (ring
    formulas, read off the compiled programs; DiLoCo's syncs amortised), or None without one."""
    from shardkit.cost.compiled.hlo import traffic_from_hlo
    from shardkit.diloco import sent_bytes

    if step.diloco:
        return float(step.diloco.traffic(state, batch)["per_step"])
    shape = dict(step.plan.mesh.shape)
    if shape.get("replica", 1) == 1:
        return None
    return float(sent_bytes(traffic_from_hlo(compiled.as_text(), shape), "replica"))


def _repeats(args) -> int:
    return args.pipeline_repeats or (2 if args.pipeline_schedule in ("circular", "interleaved-1f1b") else 1)


def _batch_sharding(plan):
    from jax.sharding import PartitionSpec as P

    axes = plan.batch_axes
    return plan.sharding(P(axes if len(axes) != 1 else axes[0]) if axes else P())


def parameter_count(step, state) -> int:
    """The model's parameters, counted once: under DiLoCo every leaf carries a leading replica
    dimension (each replica's copy), which is not more model."""
    import jax

    lead = 1 if step.diloco else 0
    return sum(math.prod(x.shape[lead:]) for x in jax.tree.leaves(state.params))


def _memory_line(state, compiled, compile_s: float, what: str = "step") -> str:
    """Per-device persistent state (exact, from the shard shapes) and the compiled step's
    temporaries (DiLoCo: its inner program's)."""
    from shardkit.explain import compiled_memory, shard_bytes

    mib = 1 / 2**20
    line = (f"per-device memory: params {shard_bytes(state.params) * mib:.2f} MiB + optimizer state "
            f"{shard_bytes(state.opt_state) * mib:.2f} MiB")
    mem = compiled_memory(compiled) if compiled is not None else {}
    if mem:
        line += f" + step temporaries {mem['temporaries'] * mib:.2f} MiB"
    return line + f"  ({what} compiled in {compile_s:.1f} s)"


def _evaluator(step, plan, pipeline, loss_fn):
    """Mean validation loss over fixed batches, in the compute dtype, sharded like training."""
    import jax
    import jax.numpy as jnp

    compute = plan.precision.compute

    @jax.jit
    def one(state, batch):
        model = step.model(state.replace(params=jax.tree.map(
            lambda x: x.astype(compute) if jnp.issubdtype(x.dtype, jnp.floating) else x, state.params)))
        return loss_fn(model, batch, pipeline).astype(jnp.float32)

    sharding = _batch_sharding(plan)

    # DiLoCo: the replicas' parameters averaged, the model they have trained together. θ_outer
    # (consensus's parameters) is the last sync's: before the first sync it is the initial model.
    average = jax.jit(lambda params: jax.tree.map(
        lambda x: jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x[0], params))

    def evaluate(state, batches) -> float:
        if step.diloco:
            state = step.diloco.consensus(state).replace(params=average(state.params))
        with plan.active():
            losses = []
            for b in batches:
                b = data_lib.global_batch(b, sharding)
                b = jax.tree.map(lambda x: jax.device_put(x, sharding) if not isinstance(x, jax.Array) else x, b)
                losses.append(one(state, b))
            return float(jnp.mean(jnp.stack(losses)))
    return evaluate
