"""One command that measures a GPU: the tests, the headline figures, and the cost model's error.

    PYTHONPATH=. python bench/gpu.py [--steps 20] [--xla-flags] [--out-dir bench/results]
    python bench/gpu.py --dry-run      # the same code at tiny sizes on one CPU device (CI)

On one accelerator, in this order:
1. ``pytest -m gpu`` (tests/test_gpu.py: one-device layouts, bf16, a pipeline, a checkpoint round
   trip, fast attention vs reference), in a subprocess started before this process touches the
   GPU (JAX here would otherwise hold most of its memory);
2. the transformer recipe at ~1B parameters (``--size 1b``), bf16, one GPU: tokens/s and MFU =
   model flops / (step time x dense bf16 peak of ``shardkit.cost.hardware``); the model flops
   are 6N + the attention term counted over the full T x T scores (PaLM, non-causal: the
   recipe's convention) and, beside it, over the causal half only (what cuDNN computes);
   a batch that does not fit is halved until one does (the JSON says which);
3. ResNet-50 (v1.5), bf16, batch 256, 224x224 synthetic images made on the device: images/s,
   beside NVIDIA's published 1-GPU mixed-precision figure (``NVIDIA_RESNET50``: an A100, the
   newest single-GPU row NVIDIA publishes for its ResNet-50 v1.5 recipe);
4. shardkit's train step vs a hand-written ``jax.jit`` of the same step (the ~125M transformer:
   same loss, casts, AdamW and gradient norm), timed interleaved in blocks of steps; the ratio;
5. for 2 and 3, the measured step time beside ``step.explain()``'s estimate (calibration data
   for ``shardkit.cost``).

Throughput is steady state: ``--steps`` steps dispatched back to back after two warm-up steps,
timed to the last one's completion. Writes ``<out-dir>/gpu.json`` and ``gpu.md`` (a dry run:
``gpu-dry-run.*``) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# NVIDIA's published single-GPU mixed-precision training throughput for ResNet-50 v1.5.
NVIDIA_RESNET50 = {
    "images_per_s": 2470.0,
    "device": "1x A100 80GB (DGX A100)",
    "setup": "PyTorch, NGC container pytorch-21.03, mixed precision (AMP)",
    "source": "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5/README.md, "
              "'Training performance: NVIDIA DGX A100 (8x A100 80GB)', the 1-GPU row",
}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on one CPU device (checks the code)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per model (default 20; dry run 3)")
    ap.add_argument("--size", default="1b", help="transformer size from models.transformer.config.SIZES")
    ap.add_argument("--batch", type=int, default=8, help="transformer sequences per step (halved on OOM)")
    ap.add_argument("--remat", default="none", help="transformer activation checkpointing policy")
    ap.add_argument("--resnet-batch", type=int, default=256)
    ap.add_argument("--xla-flags", action="store_true", help="apply sk.xla_flags('gpu') first")
    ap.add_argument("--skip-tests", action="store_true", help="do not run pytest -m gpu")
    ap.add_argument("--tests-k", default=None, metavar="EXPR", help="only the gpu tests matching this "
                    "pytest -k expression (CI's dry run runs one: the suite runs them all anyway)")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.dry_run else 20
    if args.steps < 1 or args.batch < 1 or args.resnet_batch < 1:
        ap.error("--steps, --batch and --resnet-batch must be positive")
    return args


if __name__ == "__main__":
    parse_args()  # --help and bad flags are answered here, before JAX starts

import shardkit as sk  # noqa: E402  (no JAX backend started by importing it)


# ---- 1. the gpu-marked tests ---------------------------------------------------------------------

def run_gpu_tests(dry: bool, select: str | None = None) -> dict:
    """``pytest -m gpu`` (``-k select``) in a subprocess; counts from its JUnit XML."""
    env = dict(os.environ)
    # tests/conftest.py defaults JAX_PLATFORMS to cpu; on the GPU machine the tests must see it.
    env["JAX_PLATFORMS"] = "cpu" if dry else "cuda"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        xml = pathlib.Path(tmp) / "junit.xml"
        t0 = time.perf_counter()
        # one process (-n 0): the suite's two xdist workers would each start JAX (seconds on
        # CPU) and on a GPU machine would share the one device
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-m", "gpu", "-p", "no:cacheprovider",
                               *(["-k", select] if select else []), f"--junitxml={xml}",
                               str(ROOT / "tests" / "test_gpu.py")],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if xml.exists():
            suite = ET.parse(xml).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            counts = {k: int(suite.get(k, 0)) for k in counts}
    failed = counts["failures"] + counts["errors"]
    return {"passed": counts["tests"] - failed - counts["skipped"], "failed": failed,
            "skipped": counts["skipped"], "exit_code": proc.returncode, "seconds": seconds,
            "output_tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]}


# ---- timing ---------------------------------------------------------------------------------

def steady_step_time(run_step, steps: int) -> float:
    """Seconds per step: two warm-up steps, then ``steps`` dispatched back to back, timed to
    the completion of the last (what a training loop that does not wait on each step gets)."""
    import jax

    for _ in range(2):
        jax.block_until_ready(run_step())
    t0 = time.perf_counter()
    for _ in range(steps):
        out = run_step()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def interleaved(a, b, rounds: int, block: int) -> tuple[float, float]:
    """Median seconds per step of ``a`` and ``b``, timed alternately in blocks of ``block``
    steps (A-block, B-block, ...), so drift and noise hit both alike."""
    import jax

    times = {"a": [], "b": []}
    for fn in (a, b):
        jax.block_until_ready(fn())
    for _ in range(rounds):
        for name, fn in (("a", a), ("b", b)):
            t0 = time.perf_counter()
            for _ in range(block):
                out = fn()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / block)
    return statistics.median(times["a"]), statistics.median(times["b"])


def estimate(step, state, batch, dry: bool, **kw) -> tuple[float | None, float | None, str | None]:
    """``explain()``'s estimated step time (seconds; the analytic model's) and the step-time
    model's on the compiled program's kernels and collectives (None on a CPU), or ``(None,
    None, the error)`` on a GPU (a dry run raises): one unreadable program must not cost the
    other figures of a rare GPU run."""
    try:
        report = step.explain(state, batch, **kw)
        return ((report.estimate or {}).get("time/step"), (report.step_time or {}).get("step"),
                None if report.estimate else "; ".join(report.notes))
    except Exception as e:  # noqa: BLE001
        if dry:
            raise
        return None, None, f"{type(e).__name__}: {e}"[:1000]


def is_oom(e: Exception) -> bool:
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


# ---- 2. the transformer ---------------------------------------------------------------------

# (config, batch) -> (step, {"state": its live state}, batch, optimizer) of the transformer
# section, for the overhead section when both use the same model (the dry run).
_BUILT: dict = {}


def transformer_step(cfg, batch: int, device):
    """The recipe's bf16 step on one device, its state and one synthetic batch on the device."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from models.transformer.layouts import make_plan
    from models.transformer.model import Transformer, loss_fn

    plan = make_plan(sk.make_mesh("data=1", devices=[device]), cfg, precision="bf16")
    tx = optax.adamw(1e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    step = sk.train_step(plan, tx)(lambda model, b: loss_fn(model, b))
    state = step.init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (batch, cfg.seq + 1), 0, cfg.vocab, jnp.int32)
    data, _ = step.place_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return step, state, data, tx


def runner(step, holder: dict, data):
    """One step on ``holder["state"]`` (donated, replaced), returning its loss."""
    def run():
        holder["state"], m = step(holder["state"], data)
        return m["loss"]
    return run


def measure_transformer(args, device, peak: float) -> dict:
    import jax.numpy as jnp

    from models.transformer.config import SIZES
    from models.transformer.attention import attention_impl
    from models.transformer.model import flops_per_token, param_count

    cfg = (SIZES["test"].replace(seq=32) if args.dry_run
           else SIZES[args.size].replace(remat=args.remat))
    batch, too_big = (4 if args.dry_run else args.batch), []
    while True:
        try:
            step, state, data, tx = transformer_step(cfg, batch, device)
            holder = {"state": state}
            run = runner(step, holder, data)
            step_s = steady_step_time(run, args.steps)
            _BUILT[cfg, batch] = (step, holder, data, tx)
            break
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is retried
            if not is_oom(e) or batch == 1:
                raise
            too_big.append(batch)
            step = state = data = holder = run = None
            batch //= 2
    estimate_s, compiled_s, why = estimate(step, holder["state"], data, args.dry_run,
                                           flops_per_token=flops_per_token(cfg))
    with step.plan.active():
        impl = attention_impl(cfg.attention, jnp.bfloat16)
    tokens = batch * cfg.seq
    fpt = flops_per_token(cfg)
    causal_fpt = fpt - 6.0 * cfg.layers * cfg.heads * cfg.head_dim * cfg.seq  # half the T x T term
    return {"size": "test" if args.dry_run else args.size, "params": param_count(cfg),
            "layers": cfg.layers, "d_model": cfg.d_model, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
            "seq": cfg.seq, "batch": batch, "batches_that_did_not_fit": too_big, "remat": cfg.remat,
            "precision": "bf16", "attention": impl, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "flops_per_token": fpt, "flops_per_token_causal": causal_fpt, "peak_flops": peak,
            "mfu": fpt * tokens / step_s / peak, "mfu_causal": causal_fpt * tokens / step_s / peak,
            "attention_flops": "non-causal: the full T x T scores (PaLM's 12·L·H·Q·T); mfu_causal counts half",
            "estimate_step_s": estimate_s, "estimate_error": why,
            "measured_over_estimate": step_s / estimate_s if estimate_s else None,
            "compiled_model_step_s": compiled_s, "final_loss": float(run())}


# ---- 4. shardkit vs a hand-written jax.jit ----------------------------------------------------

def measure_overhead(args, device) -> dict:
    """The transformer step through ``sk.train_step`` vs the same step written against
    ``jax.jit`` by hand (master f32 params cast to bf16 for the loss, f32 gradients, AdamW,
    gradient norm; state donated), both on one device."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.model import loss_fn

    cfg = SIZES["test"].replace(seq=32) if args.dry_run else SIZES["125m"]
    batch = 4 if args.dry_run else 8
    if (cfg, batch) in _BUILT:  # the transformer section's step and its current state
        step, holder, data, tx = _BUILT.pop((cfg, batch))
        state = holder.pop("state")
    else:
        step, state, data, tx = transformer_step(cfg, batch, device)
    graphdef, params = nnx.split(step.model(state), nnx.Param)
    params = jax.tree.map(jnp.copy, params)  # its own copy: the shardkit state is donated

    def hand_step(params, opt_state, batch):
        def loss(p):
            model = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p))
            return loss_fn(model, batch).astype(jnp.float32)
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": value, "grad_norm": optax.tree.norm(grads)}

    hand = jax.jit(hand_step, donate_argnums=(0, 1))
    # The optimizer state on the params' mesh, where the step's outputs land: initialised off it
    # (its count a device-less scalar), the second call's inputs differed and compiled it again.
    replicated = jax.sharding.NamedSharding(step.plan.mesh, jax.sharding.PartitionSpec())
    hold = {"sk": state, "hand": (params, jax.jit(tx.init, out_shardings=replicated)(params))}

    def run_sk():
        hold["sk"], m = step(hold["sk"], data)
        return m["loss"]

    def run_hand():
        p, o, m = hand(*hold["hand"], data)
        hold["hand"] = (p, o)
        return m["loss"]

    rounds, block = (3, 2) if args.dry_run else (10, 5)
    t_sk, t_hand = interleaved(run_sk, run_hand, rounds, block)
    return {"size": "test" if args.dry_run else "125m", "batch": batch, "seq": cfg.seq,
            "rounds": rounds, "steps_per_block": block, "shardkit_step_s": t_sk, "hand_step_s": t_hand,
            "ratio": t_sk / t_hand}


# ---- 3. ResNet-50 -------------------------------------------------------------------------------

def measure_resnet(args, device) -> dict:
    import jax
    import jax.numpy as jnp

    from models.resnet.config import Config
    from models.resnet.train import init_state, make_optimizer, make_plan, make_step

    if args.dry_run:
        cfg, side, batch = Config(depth=10, width=0.125, num_classes=10, stem="imagenet"), 32, 8
    else:
        cfg, side, batch = Config(depth=50, num_classes=1000, stem="imagenet"), 224, args.resnet_batch
    plan = make_plan(sk.make_mesh("data=1", devices=[device]), precision="bf16")
    step = make_step(plan, make_optimizer("sgd", 0.1, steps=1000))
    state = init_state(step, cfg, 0)
    k1, k2 = jax.random.split(jax.random.key(0))
    images = jax.random.normal(k1, (batch, side, side, cfg.in_channels), jnp.float32)
    labels = jax.random.randint(k2, (batch,), 0, cfg.num_classes, jnp.int32)
    data, _ = step.place_batch({"image": images, "label": labels})  # synthetic, made on the device
    hold = {"state": state}
    step_s = steady_step_time(runner(step, hold, data), args.steps)
    estimate_s, compiled_s, why = estimate(step, hold["state"], data, args.dry_run)
    ips = batch / step_s
    return {"depth": cfg.depth, "width": cfg.width, "image": side, "batch": batch, "precision": "bf16",
            "params": int(sum(x.size for x in jax.tree.leaves(hold["state"].params))),
            "step_s": step_s, "images_per_s": ips, "nvidia_published": NVIDIA_RESNET50,
            "over_nvidia_published": ips / NVIDIA_RESNET50["images_per_s"],
            "estimate_step_s": estimate_s, "estimate_error": why,
            "measured_over_estimate": step_s / estimate_s if estimate_s else None,
            "compiled_model_step_s": compiled_s}


# ---- the table ------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    ms = lambda s: "—" if s is None else f"{s * 1e3:.1f} ms"  # noqa: E731
    ratio = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    g = result["tests"]
    rows = [("device", result["device"], f"jax {result['jax']}, XLA flags: {result['xla_flags'] or 'defaults'}"),
            ("tests -m gpu", "skipped" if g is None else f"{g['passed']} passed, {g['failed']} failed",
             "" if g is None else f"{g['seconds']:.0f} s")]
    # a section not reached yet (the file is rewritten after each one) reads as not run
    t, r, o = (result.get(k, {"error": "not run (yet)"}) for k in ("transformer", "resnet", "overhead"))
    if "error" in t:
        rows.append(("transformer", "failed", t["error"][:200]))
    else:
        rows += [
            ("transformer", f"{t['params'] / 1e9:.2f}B params, bf16, batch {t['batch']} x {t['seq']}",
             f"attention {t['attention']}, remat {t['remat']}"
             + (f"; batches {t['batches_that_did_not_fit']} did not fit" if t["batches_that_did_not_fit"] else "")),
            ("transformer tokens/s", f"{t['tokens_per_s']:,.0f}", f"step {ms(t['step_s'])}"),
            ("transformer MFU", f"{t['mfu']:.1%}",
             f"attention flops non-causal (PaLM); causal count: {t['mfu_causal']:.1%}"),
            ("transformer step vs explain()", f"{ms(t['step_s'])} vs {ms(t['estimate_step_s'])}",
             f"measured / estimate {ratio(t['measured_over_estimate'])}; on the compiled kernels "
             f"{ms(t['compiled_model_step_s'])}"
             + (f"; {t['estimate_error'][:120]}" if t["estimate_error"] else ""))]
    if "error" in r:
        rows.append(("ResNet", "failed", r["error"][:200]))
    else:
        ref = r["nvidia_published"]
        rows += [
            (f"ResNet-{r['depth']} images/s", f"{r['images_per_s']:,.0f}",
             f"batch {r['batch']}, {r['image']}x{r['image']}, bf16; NVIDIA {ref['device']}: "
             f"{ref['images_per_s']:,.0f} (x{r['over_nvidia_published']:.2f})"),
            ("ResNet step vs explain()", f"{ms(r['step_s'])} vs {ms(r['estimate_step_s'])}",
             f"measured / estimate {ratio(r['measured_over_estimate'])}; on the compiled kernels "
             f"{ms(r['compiled_model_step_s'])}"
             + (f"; {r['estimate_error'][:120]}" if r["estimate_error"] else ""))]
    if "error" in o:
        rows.append(("sk.train_step vs hand-written jax.jit", "failed", o["error"][:200]))
    else:
        rows.append(("sk.train_step vs hand-written jax.jit", f"{ms(o['shardkit_step_s'])} vs {ms(o['hand_step_s'])}",
                     f"ratio {o['ratio']:.3f} ({o['size']} transformer, {o['rounds']} interleaved rounds of "
                     f"{o['steps_per_block']})"))
    head = (f"GPU benchmark ({'DRY RUN: tiny sizes on CPU, not figures' if result['dry_run'] else 'measured'}), "
            f"{result['date']}, `{result['command']}`\n\n")
    lines = ["| measurement | value | notes |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c.replace('|', '/')} |" for a, b, c in rows]
    return head + "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    flags = sk.xla_flags("gpu") if args.xla_flags else None  # before JAX starts
    if args.dry_run:
        try:
            sk.use_cpu_devices(1)
        except RuntimeError:
            pass  # JAX already started (tests/test_bench_gpu.py calls main in-process): its first device
    else:
        # JAX takes 75% of GPU memory by default; the ~1B model without remat wants more
        # (its batch is halved until it fits, but a bigger batch is the better figure).
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")
    tests = None if args.skip_tests else run_gpu_tests(args.dry_run, args.tests_k)  # before this process takes the GPU

    import jax

    from shardkit.cost import hardware

    if not args.dry_run and jax.default_backend() != "gpu":
        print(f"bench/gpu.py: no GPU here (JAX's backend is {jax.default_backend()}); "
              "run with --dry-run to check the code on CPU", file=sys.stderr)
        return 2
    device = jax.devices()[0]
    peak = hardware.total_peak_flops([device])
    result = {"dry_run": args.dry_run, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python bench/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": f"{device.device_kind} ({device.platform})", "jax": jax.__version__,
              "python": platform.python_version(), "xla_flags": flags,
              "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), "tests": tests}
    sections = (("transformer", lambda: measure_transformer(args, device, peak)),
                ("resnet", lambda: measure_resnet(args, device)), ("overhead", lambda: measure_overhead(args, device)))
    out = pathlib.Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "gpu-dry-run" if args.dry_run else "gpu"

    def write() -> str:
        # after every section: a lease that ends mid-run still leaves what was measured
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        table = markdown(result)
        (out / f"{stem}.md").write_text(table)
        return table

    write()
    failed = False
    for name, measure in sections:
        t0 = time.perf_counter()
        try:
            result[name] = measure()
            result[name]["seconds"] = time.perf_counter() - t0  # compiles included
        except Exception as e:  # noqa: BLE001 - on a GPU, keep the other sections' figures
            if args.dry_run:
                raise
            traceback.print_exc()
            result[name], failed = {"error": f"{type(e).__name__}: {e}"[:3000]}, True
        table = write()
    print(table)
    print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}")
    return 0 if not failed and (tests is None or tests["failed"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
