"""A fingerprint of everything ``sk.cost`` computes, to prove that a refactor changed nothing.

Prints, one JSON line per case and sorted keys, the full figures of:

* the analytic estimate from a ``ModelShape`` (``sk.cost.estimate``) on the layouts the tests
  and ``sk.search`` use (data, ZeRO 0-3, fsdp, tensor with sequence parallelism, every pipeline
  schedule, remat, context, expert, DiLoCo), for H100 and TPU v5p;
* the ranking (``sk.search``, ``weak_scaling``) as the ``shardkit plan`` CLI runs it;
* the step estimate and the compiled report (``step.explain``, 8 simulated CPU devices) of the
  test families (``tests/families.py``) on the bands' layouts, of ``tests/test_cost.py``'s
  pipelined steps, and of a recipe transformer on the dense and pipelined layouts;
* ``sk.cost.simulate_many`` with ``estimate=True`` on simulated CPU devices and for H100s
  (the compile in a subprocess, the estimate joined beside it and re-timed).

Wall times (``Report.seconds`` and the note that quotes them) are left out: everything else is
deterministic. Run before and after a change and diff the files::

    python bench/cost_fingerprint.py > /tmp/before.jsonl
    ... change ...
    python bench/cost_fingerprint.py > /tmp/after.jsonl && diff /tmp/before.jsonl /tmp/after.jsonl

``--quick`` runs the analytic part only (a few seconds; no compile); ``--no-gpu`` leaves out the
XLA:GPU (deviceless H100) compile. ``--estimates`` prints, without any compile, every field of
the step estimate and of the program reading it rests on (``ProgramReading``) for the bands'
families (house and installed third-party ones, their layouts and the hybrid ones), the recipe
transformer at test size (dense, ZeRO-3, hybrid, pipelined, MoE layouts) and the ResNet recipe,
on the 8 CPU devices and for H100 and TPU v5p targets (the estimate a target's report sets
beside its compile): the check for a change to the program reader or the estimate alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

ESTIMATE_PARTS = ("families", "third-party", "pipelines", "transformer", "resnet")
_TIMING = re.compile(r"^export [0-9.]+ s; subprocess")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the analytic part only (no compile)")
    ap.add_argument("--no-gpu", action="store_true", help="leave out the XLA:GPU (deviceless H100) compiles")
    ap.add_argument("--estimates", action="store_true",
                    help="the step estimates and program readings only, every target (no compile)")
    ap.add_argument("--only", choices=ESTIMATE_PARTS, help="with --estimates: one part of them")
    ap.add_argument("--gpu-pipelines", action="store_true", help="only the pipelined layouts compiled for H100s")
    return ap.parse_args(argv)


def _plain(x):
    """JSON-able, floats as repr (every bit shows)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, (int, str, bool)) or x is None:
        return x
    return repr(x)


def emit(case: str, what) -> None:
    print(json.dumps({"case": case, "figures": _plain(what)}, sort_keys=True), flush=True)


def report_figures(report) -> dict:
    d = _plain(report)
    d.pop("seconds")
    d["notes"] = [n for n in d["notes"] if not _TIMING.match(n)]
    d["comparison"] = _plain(report.comparison())
    d["text"] = [line for line in report.render(width=140).splitlines() if not _TIMING.search(line.strip())
                 and "export " not in line]
    return d


def analytic_layouts() -> list:
    L = cost.Layout
    return [
        L(data=64, zero=0), L(data=64, zero=1), L(data=64, zero=2), L(data=64, zero=3),
        L(data=8, fsdp=8, zero=1), L(data=8, fsdp=8, zero=3), L(data=8, tensor=8, zero=1),
        L(data=8, tensor=8, zero=1, sequence_parallel=True), L(data=16, tensor=4, zero=2, remat="full"),
        L(data=16, tensor=4, zero=1, remat="dots", microbatches=4),
        L(data=8, pipe=4, zero=1, microbatches=8), L(data=8, pipe=4, zero=1, microbatches=8, schedule="1f1b"),
        L(data=8, pipe=4, zero=1, microbatches=8, schedule="circular", repeats=2),
        L(data=8, pipe=4, zero=1, microbatches=8, schedule="interleaved-1f1b", repeats=2),
        L(data=8, pipe=4, zero=1, microbatches=8, schedule="zb-h1"),
        L(data=4, pipe=4, tensor=4, zero=1, microbatches=16, schedule="1f1b", keep_residuals=True),
        L(data=2, fsdp=2, tensor=2, pipe=8, zero=3, microbatches=8),
        L(data=16, context=4, zero=1), L(data=16, expert=4, zero=1),
        L(data=16, tensor=4, zero=1, replica=2, diloco_every=50),
]


def analytic() -> None:
    L = cost.Layout
    for model in ("1b", "7b"):
        for hw in ("h100", "tpu-v5p"):
            for lo in analytic_layouts():
                try:
                    e = cost.estimate(model, lo, hw, global_batch=256)
                except Exception as err:  # noqa: BLE001 — a refusal is part of the fingerprint
                    e = f"{type(err).__name__}: {err}"
                emit(f"estimate {model} {hw} {lo}", e)
    emit("estimate 1b fp8", cost.estimate("1b", L(data=8, tensor=8, zero=1), "h100", global_batch=256,
                                          precision="fp8"))
    for args, kw in [(("1b", 64, "h100"), {"global_batch": 128}),
                     (("1b", 8, "h100"), {"global_batch": 32}),
                     (("7b", 256, "tpu-v5p"), {"global_batch": 512, "top": 5}),
                     (("1b", 256, "h100"), {"global_batch": 256, "pipe": [1], "top": 3}),
                     (("1b", 64, "h100"), {"global_batch": 128, "memory_limit": 1e9})]:
        res = sk.search(*args, **kw)
        emit(f"search {args} {kw}", {"rows": res.rows, "text": str(res)})
    emit("weak_scaling", cost.weak_scaling("1b", L(tensor=8, zero=1), "h100", per_device_batch=2))


def compiled(gpu: bool) -> None:
    import families as F
    import jax.numpy as jnp
    import optax

    for fam in ("mlp", "cnn", "gpt", "moe"):
        for mesh, zero in F.LAYOUTS + (F.EXPERT_LAYOUTS if fam == "moe" else []):
            step, state, batch = F.build(fam, mesh, zero)
            emit(f"explain {fam} {mesh} zero={zero}", report_figures(step.explain(state, batch)))

    import test_cost as T

    for mesh, schedule, v, zero in T.PIPE_LAYOUTS:
        step, state, batch = T._pipe_step(mesh, schedule, v, zero)
        emit(f"explain pipe {mesh} {schedule} v={v} zero={zero}", report_figures(step.explain(state, batch)))
        emit(f"estimate_for_step pipe {mesh} {schedule} m=8",
             cost.estimate_for_step(step, state, batch, pipeline=(8, schedule, v)))

    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.layouts import LAYOUTS, make_plan
    from models.transformer.model import PipelineSpec, Transformer, flops_per_token, loss_fn

    cfg = SIZES["test"].replace(d_model=64, heads=4, kv_heads=4, layers=4, seq=32)
    for name in ("dp", "zero3", "fsdp_tp", "tp_sp", "hybrid", "pp_gpipe", "pp_1f1b", "dp_pp_tp",
                 "pp_interleaved", "dp_pp_tp_zb"):
        lo = LAYOUTS[name]
        plan = make_plan(sk.make_mesh(lo.mesh), cfg, zero=lo.zero, sequence_parallel=lo.sequence_parallel,
                         vocab_parallel=lo.vocab_parallel)
        pipe = PipelineSpec(4, lo.schedule, lo.repeats) if "pipe" in lo.mesh else None
        step = sk.train_step(plan, optax.adam(1e-3))(lambda model, batch, pipe=pipe: loss_fn(model, batch, pipe))
        state = step.init(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((16, cfg.seq), jnp.int32)
        emit(f"explain transformer {name}",
             report_figures(step.explain(state, {"inputs": tokens, "targets": tokens},
                                         flops_per_token=flops_per_token(cfg, cfg.seq))))

    step, state, batch = F.build("gpt", "data=8", 1)
    jobs = [(step, state, batch, "data=16"), {"step": step, "state": state, "batch": batch,
                                              "mesh": "data=4,fsdp=2,tensor=2", "zero": 3}]
    for i, r in enumerate(sk.cost.simulate_many(jobs, target="cpu", estimate=True)):
        emit(f"simulate_many cpu {i}", report_figures(r))
    if gpu:  # XLA:GPU deviceless: the estimate re-timed on the compiled figures
        step, state, batch = F.build("mlp", "data=8", 1)
        jobs = [(step, state, batch, "data=8"), (step, state, batch, "data=4,tensor=2")]
        for i, r in enumerate(sk.cost.simulate_many(jobs, target="h100", estimate=True)):
            emit(f"simulate_many h100 {i}", report_figures(r))
        gpu_pipelines()


def gpu_pipelines() -> None:
    """The recipe's pipelined layouts compiled for H100s: the pipeline memory model a GPU or
    TPU target's estimate reads (the trace note's residuals and backward jaxprs)."""
    from models.transformer.config import SIZES
    from models.transformer.plan import layout_step
    from models.transformer.layouts import LAYOUTS

    cfg = SIZES["test"].replace(d_model=64, heads=4, kv_heads=4, layers=4, seq=32)
    names = ("pp_gpipe", "pp_1f1b", "dp_pp_tp_zb")
    jobs = []
    for name in names:
        step, state, batch = layout_step(LAYOUTS[name], cfg, global_batch=16, target="h100")
        jobs.append((step, state, batch, step.plan.mesh))
    for name, r in zip(names, sk.cost.simulate_many(jobs, target="h100", estimate=True)):
        emit(f"simulate_many h100 transformer {name}", report_figures(r))


def _estimate(case: str, step, state, batch, target: str) -> None:
    """The step estimate of ``step`` for ``target`` (``"cpu"``: on the plan's own mesh), beside
    the program reading it read (every field of both)."""
    import contextlib

    from shardkit.cost.analytic import from_step
    from shardkit.cost.compiled import simulated, targets
    from shardkit.plan import detailed_notes

    try:  # the module that calls the program reader
        from shardkit.cost.analytic import step_facts as caller
    except ImportError:
        caller = from_step
    readings = []
    read = caller.read_program

    def keep(*args, **kw):
        readings.append(read(*args, **kw))
        return readings[-1]

    caller.read_program = keep
    try:
        if target == "cpu" and not isinstance(step.plan.mesh, jax.sharding.AbstractMesh):
            est = cost.estimate_for_step(step, state, batch)
        else:
            tgt = targets.get(target)
            mesh = step.plan.mesh
            if not isinstance(mesh, jax.sharding.AbstractMesh):
                amesh = simulated.abstract_mesh(mesh, max_devices=simulated.MAX_TARGET_DEVICES, target=tgt)
                step = step.with_plan(simulated.simulated_plan(step.plan, amesh))
                state, batch = simulated.abstract_inputs(step, state, batch)
            # The trace notes a target's estimate reads (simulate exports under them).
            with simulated._on(step.plan), detailed_notes() if tgt.platform != "cpu" else contextlib.nullcontext():
                est = from_step.step_estimate(step, state, batch,
                                              hardware=None if tgt.platform == "cpu" else tgt.hardware)
    except Exception as err:  # noqa: BLE001 — a refusal is part of the fingerprint
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        est = f"{type(err).__name__}: {err}".replace(root, "<repo>")  # the same in any checkout
    finally:
        caller.read_program = read
    # A saved residual's source line (``where``'s "from file:line") moves with any edit above it.
    readings = [dataclasses.replace(r, saved=[(a, w.split(" from ")[0]) for a, w in r.saved])
                if hasattr(r, "saved") else r for r in readings]
    emit(f"estimate_for_step {case} {target}", {"estimate": est, "readings": readings})


def estimates(only: str | None = None) -> None:
    """See ``--estimates`` in the module docstring; ``only``: one part (``ESTIMATE_PARTS``)."""
    import families as F

    want = lambda part: only in (None, part)  # noqa: E731

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
    from cost_bands import HYBRID_LAYOUTS

    for fam in F.FAMILIES if want("families") else ():
        own = F.LAYOUTS + (F.EXPERT_LAYOUTS if fam == "moe" else [])
        for mesh, zero in own + [lo for lo in HYBRID_LAYOUTS if lo not in own]:
            step, state, batch = F.build(fam, mesh, zero)
            for target in ("cpu", "h100", "tpu-v5p"):
                _estimate(f"{fam} {mesh} zero={zero}", step, state, batch, target)
    try:
        import third_party_families as T
    except ImportError:
        T = None
    for fam in (T.available() if T and want("third-party") else ()):
        for mesh, zero in T.LAYOUTS + [lo for lo in HYBRID_LAYOUTS if lo not in T.LAYOUTS]:
            step, state, batch = T.build(fam, mesh, zero)
            for target in ("cpu", "h100"):
                _estimate(f"{fam} {mesh} zero={zero}", step, state, batch, target)

    import test_cost

    for mesh, schedule, v, zero in test_cost.PIPE_LAYOUTS if want("pipelines") else ():
        step, state, batch = test_cost._pipe_step(mesh, schedule, v, zero)
        for target in ("cpu", "h100"):
            _estimate(f"pipe {mesh} {schedule} v={v} zero={zero}", step, state, batch, target)

    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    cfg = SIZES["test"].replace(d_model=64, heads=4, kv_heads=4, layers=4, seq=32)
    moe = cfg.replace(moe_experts=8, moe_top_k=2, moe_capacity=2.0)
    recipe = [("dense data=8", cfg, "data=8", {}), ("dense fsdp=8 zero=3", cfg, "fsdp=8", {"zero": 3}),
              ("dense data=8 zero=3", cfg, "data=8", {"zero": 3}),
              ("dense data=2,fsdp=2,tensor=2 zero=1", cfg, "data=2,fsdp=2,tensor=2", {"zero": 1}),
              ("dense data=2,fsdp=2,tensor=2 sp", cfg, "data=2,fsdp=2,tensor=2", {"sequence_parallel": True}),
              ("dense data=4,pipe=2 gpipe", cfg, "data=4,pipe=2", {"zero": 1}),
              ("dense data=4,pipe=2 1f1b", cfg, "data=4,pipe=2", {"zero": 1, "schedule": "1f1b"}),
              ("dense data=4,pipe=2 interleaved", cfg, "data=4,pipe=2",
               {"zero": 1, "schedule": "interleaved-1f1b", "repeats": 2}),
              ("dense data=2,pipe=2,tensor=2 zb-h1", cfg, "data=2,pipe=2,tensor=2", {"schedule": "zb-h1"}),
              ("moe expert=8", moe, "expert=8", {}), ("moe data=2,expert=4 zero=1", moe, "data=2,expert=4", {"zero": 1}),
              ("moe data=2,expert=2,pipe=2", moe, "data=2,expert=2,pipe=2", {}),
              ("moe dropless data=2,expert=4", moe.replace(moe_capacity=None), "data=2,expert=4", {})]
    for name, c, mesh, kw in recipe if want("transformer") else ():
        for target in ("cpu", "h100", "tpu-v5p"):
            step, state, batch = abstract_step(c, mesh, global_batch=16, target=target, **kw)
            _estimate(f"transformer {name}", step, state, batch, target)

    from flax import nnx
    import numpy as np
    import optax

    from models.resnet.config import Config
    from models.resnet.model import ResNet
    from models.resnet.train import make_plan, make_step

    if not want("resnet"):
        return
    rcfg = Config(depth=10, width=0.25, in_channels=1, num_classes=10)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: ResNet(rcfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, jax.jit(lambda: nnx.split(ResNet(rcfg, rngs=nnx.Rngs(0)))[1])())
    for mesh, zero in (("data=8", 0), ("data=8", 3), ("data=4,fsdp=2", 2)):
        step = make_step(make_plan(sk.make_mesh(mesh), zero=zero), optax.sgd(0.1))
        state = step.init(model)
        batch = {"image": jax.ShapeDtypeStruct((16, 16, 16, 1), np.float32),
                 "label": jax.ShapeDtypeStruct((16,), np.int32)}
        for target in ("cpu", "h100"):
            _estimate(f"resnet {mesh} zero={zero}", step, state, batch, target)


def main(argv=None) -> None:
    global jax, sk, cost
    a = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.join(here, "..", "tests"), os.path.join(here, "..")]
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import shardkit as sk
    from shardkit import cost

    if a.gpu_pipelines:
        return gpu_pipelines()
    if a.estimates:
        return estimates(a.only)
    analytic()
    if not a.quick:
        compiled(gpu=not a.no_gpu)


if __name__ == "__main__":
    main()
