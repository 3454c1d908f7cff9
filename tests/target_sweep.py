"""The recipe's layouts compiled for real accelerators, deviceless (``sk.cost.simulate_many``
with ``target=``), and what each layout promises about the program its compiler emits.

Used by ``test_targets_gpu.py`` (H100: one host of 8, two hosts of 8) and
``test_targets_tpu.py`` (a TPU v5p slice of 8 chips). Each file compiles its whole sweep, and
the README MLP's hybrid meshes, in one subprocess (a module fixture, ``compile_sweep``), then
one test per layout checks the promises, so a failure names its layout. Without the compilers
(``pip install -e '.[test]'`` brings them) the files skip with the install line.
"""
from __future__ import annotations

import dataclasses

import pytest

import shardkit as sk
from models.transformer.config import SIZES
from models.transformer.layouts import LAYOUTS, Layout
from models.transformer.plan import layout_step
from shardkit.pipeline.schedules import EXPLICIT

CFG = SIZES["test"].replace(layers=4)  # d_model 32, 4 heads / 2 kv heads, seq 16, vocab 256; 4 layers for pipe=4 and 2 stages × 2 chunks
MOE = CFG.replace(moe_experts=8)


@dataclasses.dataclass(frozen=True)
class Case:
    layout: Layout
    moe: bool = False
    context_strategy: str = "ring"
    diloco: bool = False  # sk.DiLoCo over `replica`, syncing every 50 steps

    @property
    def cfg(self):
        cfg = MOE if self.moe else CFG
        return cfg.replace(context_strategy=self.context_strategy) if self.context_strategy != "ring" else cfg


# Every recipe layout on 8 devices, plus ZeRO-2, ZeRO-3 inside a pipeline, and the all-gather
# context strategy (the recipe's named layouts use ring attention).
CASES_8 = {name: Case(lo, moe=name.startswith("ep")) for name, lo in LAYOUTS.items()}
CASES_8["zero2"] = Case(Layout("data=8", zero=2))
CASES_8["pp_zero3"] = Case(Layout("data=4,pipe=2", zero=3, schedule="1f1b"))
CASES_8["cp_allgather"] = Case(LAYOUTS["cp"], context_strategy="allgather")
CASES_8["diloco"] = Case(Layout("replica=2,data=4", zero=1), diloco=True)
CASES_8["diloco_tp"] = Case(Layout("replica=2,data=2,tensor=2", sequence_parallel=True), diloco=True)
CASES_8["diloco_pp"] = Case(Layout("replica=2,pipe=2,data=2", schedule="1f1b"), diloco=True)
# ZeRO-3 inside a zero-bubble pipeline with tensor-parallel stages: the default lane's one
# pipeline per target (below).
CASES_8["pp_zero3_zb_tp"] = Case(Layout("data=2,pipe=2,tensor=2", zero=3, schedule="zb-h1"))
# The default lane compiles one layout per promise `check` makes (the suite's 10 minutes: each
# deviceless compile costs 8-15 CPU seconds); --extended (conftest.py) compiles every layout.
# Each promise and the default case that keeps it, per target:
# - grad-reduce over data-like axes; params under the optimizer state with a param gather
#   (ZeRO-3, and ZeRO-3 inside a pipeline with its per-step gather bound): pp_zero3_zb_tp;
# - ZeRO-2's reduce-scatter on XLA:GPU: on H100 the README MLP's ZeRO-2 on data=4,fsdp=2
#   (test_hybrid_meshes_reduce_scatter_the_gradients_as_the_zero_formulas_say:
#   one reduce-scatter over the batch axes, its bytes as ZeRO's formula, no all-reduce over data;
#   on XLA:TPU the assertion is XLA:GPU's, and ZeRO's sharded state compiles in pp_zero3_zb_tp);
# - FSDP's weight gather, TP's row-parallel sums and SP's sequence gather: hybrid_16 on H100 (two
#   hosts, the outer axis across InfiniBand). On v5p hybrid moves to --extended: XLA:TPU's FSDP
#   gathers are held to the ZeRO formulas on the README MLP's data=2,fsdp=2,tensor=2 (below), its
#   row-parallel sums in pp_zero3_zb_tp's tensor-parallel stages; SP's gather is H100's, and
#   XLA:CPU's beside the estimate (test_cost.py::test_transformer_estimate_matches_compiled[hybrid]);
# - whole weights (no param gather) and EP's token all-to-all with expert weights left in place: ep;
# - ring attention's K/V permutes: cp, --extended on both targets (~11 CPU s on H100): at the
#   sweep's sizes (head_dim 8, sequence 16: no flash kernel takes them) every target traces the
#   same blockwise ring, a shard_map of explicit collective-permutes that no compiler turns into
#   another collective (XLA:GPU's program for cp has them: the default lane checked it until
#   2026-11-28). The recipe's ring is held on XLA:CPU's program, its bytes equal to the formula, in
#   tests/test_context.py::test_estimate_matches_the_compiled_recipe_step (cp_tp), and the
#   all-gather strategy (cp_allgather) and context inside a pipeline stage (cp_pp) there too;
# - nothing over the replica axis inside a DiLoCo interval: on XLA:CPU's program in
#   tests/test_diloco.py (test_h3_adamw_nesterov_matches_reference_with_no_replica_traffic_between_syncs);
# - a pipeline's microbatch permutes and the zero-bubble split backward with tensor parallelism
#   inside the stages, under ZeRO-3: pp_zero3_zb_tp (data=2,pipe=2,tensor=2, ZB-H1; one compile
#   where pp_zero3 and dp_pp_tp_zb / pp_zb took two).
# Moved to --extended, with the case above that keeps what each checks: zero2 (the README MLP's
# ZeRO-2 on H100, above), dp, zero1, zero3 (ep:
# whole weights; pp_zero3_zb_tp: ZeRO-3's gather), fsdp, fsdp_tp, tp, tp_sp (hybrid/hybrid_16),
# pp_zero3, pp_gpipe, pp_circular, pp_1f1b, pp_interleaved, tp_pp, dp_pp_tp, dp_pp_tp_1f1b,
# dp_pp_tp_zb, pp_zb (pp_zero3_zb_tp: ZeRO-3 in a pipeline, ZB-H1 with TP in the stages; each
# schedule's program is checked against the sequential model on CPU in tests/test_pipeline.py),
# ep_dp, ep_fsdp, ep_tp, ep_pp
# (ep; EP nested in a pipeline runs on CPU in tests/test_moe.py), cp, cp_tp, dp_cp_fsdp, cp_allgather,
# cp_pp (the ring above; hybrid), diloco, diloco_tp, diloco_pp (tests/test_diloco.py), zero2_16, pp_1f1b_16,
# pp_zb_16, ep_dp_16 (hybrid_16 for the two hosts), cp_tp_pp, ep_tp_pp, cp_tp_pp_16 (two
# compiler-owned axes beside an explicit schedule: pp_zero3_zb_tp for the schedule, ep for the
# axes; on CPU tests/test_pipeline.py::test_explicit_schedule_beside_two_compiler_owned_axes).
KEEP_H100 = {"pp_zero3_zb_tp", "hybrid_16", "ep"}
KEEP_TPU = {"pp_zero3_zb_tp", "ep"}

# Two H100 hosts: the outer axes cross InfiniBand.
CASES_16 = {
    "hybrid_16": Case(Layout("data=2,fsdp=2,tensor=4", zero=1, sequence_parallel=True)),
    "zero2_16": Case(Layout("data=16", zero=2)),
    "pp_1f1b_16": Case(Layout("data=2,pipe=2,tensor=4", schedule="1f1b")),
    "pp_zb_16": Case(Layout("data=2,pipe=2,tensor=4", schedule="zb-h1")),
    "ep_dp_16": Case(Layout("data=2,expert=8", zero=1), moe=True),
    # The 4D layout of long context (Llama 3's 128K row, scaled down): issue 37.
    "cp_tp_pp_16": Case(Layout("data=2,pipe=2,context=2,tensor=2", schedule="1f1b")),
}
EXTENDED_H100 = (set(CASES_8) | set(CASES_16)) - KEEP_H100
# A 16-chip v5p slice for the 4D layout (extended, as on H100).
CASES_TPU = {**CASES_8, "cp_tp_pp_16": CASES_16["cp_tp_pp_16"]}
EXTENDED_TPU = set(CASES_TPU) - KEEP_TPU


def require(target: str) -> None:
    try:
        sk.cost.targets.require(sk.cost.targets.get(target))
    except sk.cost.TargetError as err:
        pytest.skip(str(err))


def selected(cases: dict[str, Case], extended: set[str], config) -> dict[str, Case]:
    """The cases this run compiles: all with ``--extended``, else those not in ``extended``."""
    return {k: v for k, v in cases.items() if config.getoption("--extended") or k not in extended}


def params(cases: dict[str, Case], extended: set[str]) -> list:
    return [pytest.param(name, marks=[pytest.mark.extended] if name in extended else [])
            for name in sorted(cases)]


def _layout_job(case: Case, target: str) -> dict:
    devices = sk.cost.abstract_mesh(case.layout.mesh).size
    outer = sk.DiLoCo(axis="replica", every=50) if case.diloco else None
    step, state, batch = layout_step(case.layout, case.cfg, global_batch=2 * devices, target=target, outer=outer)
    return {"step": step, "state": state, "batch": batch, "mesh": case.layout.mesh}


def compile_sweep(cases: dict[str, Case], target: str, config) -> tuple[dict[str, object], dict[tuple[str, int], object]]:
    """The ``cases`` and the README MLP's ``hybrid_mlp_cases`` compiled for ``target`` in one
    subprocess (one start of JAX and the target's compiler per test file): the layouts' reports
    (or exceptions) by name, the MLP's by ``(mesh, zero)``."""
    mlp = hybrid_mlp_cases(config)
    jobs = [_layout_job(c, target) for c in cases.values()] + [(*hybrid_mlp_step(m, z), m) for m, z in mlp]
    reports = sk.cost.simulate_many(jobs, target=target, timeout=1800)
    return dict(zip(cases, reports[:len(cases)])), dict(zip(mlp, reports[len(cases):]))


def axis_bytes(report, kind: str, axis: str) -> float:
    """Bytes of ``kind`` collectives whose device groups span ``axis``."""
    return sum(t.bytes for t in report.traffic if t.kind == kind and axis in t.axes)


def check(name: str, case: Case, report, target: str) -> None:
    """What the layout promises, on the target compiler's program."""
    if isinstance(report, Exception):
        raise report
    lo, roles = case.layout, report.roles()
    kinds = {c.kind for c in report.collectives}
    assert report.target == target and report.fits, (report.memory, report.device_memory)
    shape = dict(sk.cost.abstract_mesh(lo.mesh).shape)
    data = [a for a in ("data", "fsdp", "expert") if shape.get(a, 1) > 1]
    if case.diloco:
        # Inside an interval the replicas train apart: not one byte over the replica axis.
        assert sum(t.bytes for t in report.traffic if "replica" in t.axes) == 0, report.traffic
    # Gradients are reduced over every data-like axis, by whatever collective the compiler picks.
    if data:
        assert roles["grad-reduce"] > 0, roles
    if lo.zero == 0 and "fsdp" not in shape and "pipe" not in shape:
        assert roles["param-gather"] == 0, roles  # plain DP/TP/EP/CP keep whole weights
    if lo.zero >= 3 or "fsdp" in shape:
        assert roles["param-gather"] > 0, roles  # FSDP gathers weights where they are used
        assert report.memory["params"] < report.memory["opt_state"], report.memory
    if lo.zero == 2 and target.startswith(("h", "a", "b")):
        # ZeRO-2 on XLA:GPU: gradients reduce-scattered (XLA:CPU all-reduces and slices;
        # XLA:TPU was seen to all-reduce too, at equal bytes reduced).
        assert "reduce-scatter" in kinds, kinds
    if shape.get("tensor", 1) > 1:
        assert roles["tensor-reduce"] + roles["tensor-gather"] > 0, roles  # Megatron's row-parallel sums
    if lo.sequence_parallel:
        assert roles["tensor-gather"] > 0, roles  # the sequence gathered into each TP region
    # Issue 37: no collective inside a conditional branch that devices of its group can skip
    # (the explicit schedules' per-stage switch: a group spanning the pipe axis; any other
    # conditional: every collective), which would hang on real devices (cost.compiled.branches).
    assert not report.hang_risks(), f"{name} can hang on {target}:\n" + "\n".join(map(str, report.hang_risks()))
    if shape.get("pipe", 1) > 1:
        assert roles["pipe-permute"] > 0, roles  # microbatches move between stages
        if lo.schedule in EXPLICIT and shape.get("tensor", 1) > 1:
            # The reader sees into the per-stage switch: the stages' tensor sums run in its branches.
            assert any(c.pipeline_switch and c.axes == ("tensor",) for c in report.branch_collectives), \
                report.branch_collectives
        if shape.get("context", 1) > 1 and (target.startswith("h") or lo.schedule not in EXPLICIT):
            # sk.context_attention's ring runs nested in the stages (it was the compiler's
            # all-gathers of K/V before): K/V blocks permuted, in the explicit schedules'
            # branches one permute per stage (``_branches``). XLA:TPU cannot partition the
            # ring in those branches: the compiler gathers K/V there (``_context_tpu_nested``).
            assert roles["context-permute"] > 0 and roles["context-gather"] == 0, roles
        if lo.zero == 3:
            # ZeRO-3 inside a pipeline: each stage's weights are gathered per step, not per
            # microbatch tick: at most a forward and a backward gather of the stage's bf16
            # weights (params bytes here are the f32 shard: ×data / 2 per gather).
            stage_bf16 = report.memory["params"] * shape["data"] / 2
            assert roles["param-gather"] <= 2 * stage_bf16 * 1.05, (roles["param-gather"], stage_bf16)
    if shape.get("expert", 1) > 1 and "pipe" not in shape:
        # Tokens dispatched to their experts. Nested in a pipeline's stages sk.moe runs under
        # the compiler, and XLA:CPU, XLA:GPU and XLA:TPU all gather the expert weights there
        # instead (no all-to-all; README, expert parallelism).
        assert roles["expert-all-to-all"] > 0, roles
        if shape == {"expert": shape["expert"]}:  # pure EP: expert weights stay where they live
            assert axis_bytes(report, "all-gather", "expert") == 0, report.traffic
        if case.cfg.moe_capacity is None:
            # Dropless: the routed rows go by ragged-all-to-all (sk.moe's ragged dispatch); the
            # dense all-to-alls carry only per-expert counts and offsets, no padded buffers.
            ragged = axis_bytes(report, "ragged-all-to-all", "expert")
            assert ragged > 0 and axis_bytes(report, "all-to-all", "expert") < ragged / 10, report.traffic
            assert roles["expert-all-to-all"] >= ragged, roles  # in its role, not "other"
            if target.startswith("h") and shape == {"expert": shape["expert"]}:
                # Counted by the routed rows: 4 · tokens · k · D bf16 per MoE layer, a device's 2
                # sequences' tokens (XLA:TPU pads a row narrower than its lanes: the test width,
                # 32, travels as 256).
                cfg = case.cfg
                assert ragged == cfg.layers // cfg.moe_every * 4 * 2 * cfg.seq * cfg.moe_top_k * cfg.d_model * 2, ragged
    if shape.get("context", 1) > 1:
        if "pipe" in shape:
            # Nested in a pipeline stage the blockwise attention leaves moving K/V to the
            # compiler: XLA:CPU and XLA:TPU permute the blocks, XLA:GPU gathers them.
            assert roles["context-permute"] + roles["context-gather"] > 0, roles
        elif case.context_strategy == "ring":
            assert roles["context-permute"] > 0, roles  # K/V blocks around the ring
        else:
            assert roles["context-gather"] > 0 and roles["context-permute"] == 0, roles


def small_step():
    """A tensor-parallel MLP under ZeRO-3 on this process's 8 CPU devices (the README's kind)."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    plan = sk.Plan(sk.make_mesh("data=4,tensor=2"), rules=[(r"w1", (None, "tensor")), (r"w2", ("tensor", None))],
                   axis_rules={"batch": "data", "mlp": "tensor"}, zero=3, precision="bf16")
    step = sk.train_step(plan, optax.adamw(1e-3))(
        lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2))
    state = step.init({"w1": jnp.ones((64, 256)) * 0.01, "w2": jnp.ones((256, 64)) * 0.01})
    batch = {"x": np.ones((32, 64), np.float32), "y": np.ones((32, 64), np.float32)}
    return step, state, batch


# Issue 25: the recipe at a size where activations dominate (8 layers, d=512, seq 512, remat
# full, bf16, 16 devices, 4 pipeline microbatches, batch 32; BENCHMARKS.md table (c)).
PIPELINE_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 1))


def schedule_memory_ratios(target: str, schedules=PIPELINE_SCHEDULES, keeps=("input",),
                           remat: str = "full") -> dict[str, float]:
    """Each schedule's step estimate of its temporaries over the ``target`` compiler's, on
    data=2,pipe=2,tensor=4 (layers stored stage-major), all compiled in one subprocess; keyed
    by schedule (``keeps`` of one) or ``schedule/keep``."""
    from models.transformer.plan import abstract_step

    cfg = SIZES["1b"].replace(layers=8, d_model=512, heads=8, kv_heads=4, d_ff=2048, seq=512, vocab=8000,
                              remat=remat)
    mesh = "data=2,pipe=2,tensor=4"
    cases = [(s, v, k) for s, v in schedules for k in keeps]
    jobs = [(*abstract_step(cfg, mesh, global_batch=32, schedule=s, repeats=v, pipeline_microbatches=4,
                            target=target, layer_order="stage-major", keep=k), mesh) for s, v, k in cases]
    ratios = {}
    for (s, _, k), report in zip(cases, sk.cost.simulate_many(jobs, target=target, estimate=True, timeout=1800)):
        if isinstance(report, Exception):
            raise report
        row = next(r for r in report.comparison() if r["quantity"] == "memory/temporaries")
        ratios[s if len(keeps) == 1 else f"{s}/{k}"] = row["estimate"] / row["compiled"]
    return ratios


# Issue 36: the README's MLP (2 layers, w1 ("fsdp", "tensor"), w2 ("tensor", "fsdp"), bf16, AdamW,
# one microbatch) on meshes where ZeRO's data axes meet fsdp and tensor. d 256, f 1024 and 256
# rows keep the proportions (rows = d, f = 4d): with far fewer rows than weights XLA
# moves the activations instead of reducing the gradients.
HYBRID_MLP = [(m, z) for m, stages in (("data=2,fsdp=2,tensor=2", (1, 2, 3)), ("data=4,fsdp=2", (1, 2, 3)),
                                      ("data=2,tensor=4", (1, 2))) for z in stages]
MLP_D, MLP_F, MLP_ROWS, MLP_LAYERS = 256, 1024, 256, 2
# The default lane: ZeRO-1 and ZeRO-3 on the 3-axis mesh, where the all-reduce was found (ZeRO-1's
# whole gradient; ZeRO-3's weights split over data and fsdp), and one stage on each 2-axis mesh
# (the same gradient reduce-scatter and master gather, on fewer axes). ZeRO-2 on the 3-axis mesh:
# its reduce-scatter over the batch axes and its master gather are ZeRO-1's there (the sharded
# gradient buffer is the only difference), and ZeRO-2 itself stays on data=4,fsdp=2.
EXTENDED_HYBRID_MLP = {("data=4,fsdp=2", 1), ("data=4,fsdp=2", 3), ("data=2,tensor=4", 2),
                       ("data=2,fsdp=2,tensor=2", 2)}


def hybrid_mlp_params() -> list:
    return [pytest.param(m, z, marks=[pytest.mark.extended] if (m, z) in EXTENDED_HYBRID_MLP else [])
            for m, z in HYBRID_MLP]


def hybrid_mlp_step(mesh_spec: str, zero: int):
    """``(step, abstract state, batch)`` of the README's MLP planned on this process's 8 devices:
    bench/hybrid_zero.py's step (one program for the benchmark's table and these checks), at the
    sweep's smaller widths."""
    import repo_files

    bench = repo_files.load("bench/hybrid_zero.py", "hybrid_zero")
    return bench.mlp_step(mesh_spec, zero, MLP_D, MLP_F, MLP_ROWS, MLP_LAYERS)


def hybrid_mlp_cases(config) -> list[tuple[str, int]]:
    """The ``HYBRID_MLP`` layouts this run checks (all with --extended)."""
    return [c for c in HYBRID_MLP if config.getoption("--extended") or c not in EXTENDED_HYBRID_MLP]


def check_hybrid_mlp(mesh_spec: str, zero: int, report, target: str) -> None:
    """The ZeRO formulas (Rajbhandari et al. 2020; FORMULAS.md) per device, Ψ parameters, t, f,
    d the tensor, fsdp and data sizes: the gradients (bf16 on the wire: the dots write bf16 and
    XLA reduces before the f32 cast) are one reduce-scatter over every batch axis of Ψ/t
    elements; ZeRO-1/2 gathers the updated f32 masters over data once (Ψ/(t·f) elements);
    weights split over fsdp (or, ZeRO-3, over data and fsdp) are gathered by one all-gather
    over those axes per use, forward and (unless XLA keeps the copy) backward: Ψ/t bf16
    elements once or twice. Nothing is permuted, nor (XLA:GPU) all-reduced over a data axis.
    XLA:TPU picks per gradient, at the same bytes reduced, and the kinds are held: over a group
    spanning every chip of the 3-D slice (data=4,fsdp=2 on a 2x2x2 v5p) an all-reduce and a
    slice (its 3-colour all-reduce over the three dimensions' links beats its only reduce-scatter
    there, a one-link ring: BENCHMARKS.md); the gradient whose data shard is one 128-lane tile
    of its minor dim (w1 on data=2,tensor=4 at this size: f/(t·data) = 128) all-reduced and
    sliced too (XLA:TPU does not re-layout for a reduce-scatter by default); every other one a
    reduce-scatter, the fusion around an all-reduce ``cost.hlo`` reads as one."""
    if isinstance(report, Exception):
        raise report
    shape = dict(sk.cost.abstract_mesh(mesh_spec).shape)
    t, f = shape.get("tensor", 1), shape.get("fsdp", 1)
    batch = {a for a in ("data", "fsdp") if a in shape}
    psi = MLP_LAYERS * 2 * MLP_D * MLP_F
    tol = 0.05
    grads = psi / t * 2
    tpu = target.startswith("tpu")
    kinds = ("reduce-scatter", "all-reduce") if tpu else ("reduce-scatter",)
    # The scalars (loss, norm) are all-reduced over the data axes too: a few bytes.
    reductions = [x for x in report.traffic if x.kind in kinds and set(x.axes) == batch and x.bytes >= 64]
    assert abs(sum(x.operand_bytes for x in reductions) - grads) <= tol * grads, (grads, report.traffic)
    if tpu:
        whole = set(batch) == set(shape)  # 8 chips: the 2x2x2 slice, every dimension of the torus
        tile = "fsdp" not in shape and MLP_F // (t * shape["data"]) == 128  # w1's data shard, lanes
        w1 = MLP_LAYERS * MLP_D * MLP_F * 2 / t
        all_reduced = grads if whole else w1 if tile else 0.0
        reduced = sum(x.operand_bytes for x in reductions if x.kind == "all-reduce")
        assert abs(reduced - all_reduced) <= tol * grads, (all_reduced, report.traffic)
    else:
        assert any(x.kind == "reduce-scatter" for x in reductions), report.traffic
        reduced = sum(x.bytes for x in report.traffic if x.kind == "all-reduce" and batch & set(x.axes))
        assert reduced < 64, report.traffic
    assert not [x for x in report.traffic if x.kind in ("collective-permute", "all-to-all")], report.traffic
    gathers = {x.axes: x.bytes for x in report.traffic if x.kind == "all-gather"}
    if zero < 3:
        masters = psi / (t * f) * 4
        assert abs(gathers.pop(("data",)) - masters) <= tol * masters, (masters, report.traffic)
    weights = psi / t * 2
    sharded = tuple(a for a in ("data", "fsdp") if a in shape and (a == "fsdp" or zero == 3))
    if sharded:
        assert weights * (1 - tol) <= gathers.pop(sharded) <= 2 * weights * (1 + tol), (weights, report.traffic)
    assert set(gathers) <= {("tensor",)}, report.traffic
