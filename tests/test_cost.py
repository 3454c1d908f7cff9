"""The analytic cost model: published formulas, the search, and agreement with what XLA compiles.

Compiled comparisons run each layout on the 8 simulated devices and check
``Report.comparison()`` rows (estimate vs compiled, per device): parameter, optimizer-state and
argument bytes, peak memory, and executed collective bytes by role (gradient reduction, ZeRO
gathers, tensor-parallel all-reduces, sequence-parallel all-gathers) within 10%, including
sequence parallelism (``tp_sp``) and the data=2,fsdp=2,tensor=2 + SP ``hybrid``. Known gap: the peak memory of tensor-parallel
transformer layouts is underestimated by ~20% (the saved-activation heuristic), checked at 25%.
Pipelines (GPipe, circular, 1F1B on pipe=4 and data=2,pipe=4): state bytes, every pipeline
collective and the executed matmul flops within 10%; peak memory within 25% (measured 0.80-0.91: XLA:CPU's in-loop working set).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp
import optax
import pytest

import shardkit as sk
from shardkit import cost

TOL = 0.10
EXACT = ("memory/params", "memory/opt_state", "memory/arguments")
# "other": traffic no role explains (e.g. permutes reordering blocks between shardings) must
# not appear at all — the estimate has none.
COLLECTIVES = ("collective/grad-reduce", "collective/param-gather", "collective/tensor-reduce",
               "collective/tensor-gather", "collective/other")
PIPE_COLLECTIVES = ("collective/grad-reduce", "collective/param-gather", "collective/pipe-permute",
                    "collective/pipe-reduce", "collective/pipe-relayout", "collective/other")


# ---- formulas -------------------------------------------------------------------------------

@pytest.mark.parametrize("zero,expect", [(0, 12.0), (1, 4 + 8 / 64), (2, 4 + 8 / 64), (3, 12 / 64)])
def test_zero_persistent_state_per_param(zero, expect):
    """ZeRO (Rajbhandari et al. 2020), shardkit's bf16 policy: keeps 12Ψ (DP), 4Ψ + 8Ψ/N (ZeRO-1/2), 12Ψ/N (ZeRO-3)."""
    ms = cost.ModelShape("m", params=7.5e9, flops_per_token=6 * 7.5e9, layers=1, layer_params=7.5e9)
    e = cost.estimate(ms, cost.Layout(data=64, zero=zero), "h100", global_batch=64)
    per_param = (e.memory["params"] + e.memory["opt_state"]) / 7.5e9
    assert per_param == pytest.approx(expect, rel=1e-9)


def test_collective_times_follow_the_ring_model():
    ag = cost.collective_time("all-gather", 1e9, 8, 100e9, 0.0)
    assert ag == pytest.approx(7 / 8 * 1e9 / 100e9)
    assert cost.collective_time("all-reduce", 1e9, 8, 100e9, 0.0) == pytest.approx(2 * ag)
    assert cost.collective_time("all-reduce", 1e9, 1, 100e9, 1e-5) == 0.0


def test_pipeline_bubble_is_megatrons():
    lo = cost.Layout(data=8, pipe=4, zero=1, microbatches=8)
    t = cost.estimate("1b", lo, "h100", global_batch=64).time
    ideal = t["compute"] + t["tensor-reduce"] + t["tensor-gather"]
    assert t["bubble"] / ideal == pytest.approx(3 / 8, rel=1e-6)  # (p - 1)/m, bubble/ideal form
    lo2 = cost.Layout(data=8, pipe=4, zero=1, microbatches=8, schedule="circular", repeats=2)
    t2 = cost.estimate("1b", lo2, "h100", global_batch=64).time
    assert t2["bubble"] < t["bubble"]


def test_activation_memory_korthikanti():
    ms = dataclasses.replace(cost.model_shape("7b"), flash_attention=False,  # the paper's: scores kept
                             activations="korthikanti")
    b, s, h, a = 1, ms.seq, ms.d_model, ms.heads
    none = cost.activation_bytes(ms, cost.Layout(), b, s, 2)
    assert none == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    # A flash kernel (sk.attention on GPU/TPU) never writes the scores: the 5as/h term goes.
    flash = cost.activation_bytes(dataclasses.replace(ms, flash_attention=True), cost.Layout(), b, s, 2)
    assert flash == pytest.approx(s * b * h * 34)
    full = cost.activation_bytes(ms, cost.Layout(remat="full"), b, s, 2)
    assert full == pytest.approx(2 * s * b * h)
    sp = cost.activation_bytes(ms, cost.Layout(tensor=8, sequence_parallel=True), b, s, 2)
    assert sp == pytest.approx(none / 8)


def test_recipe_shapes_match_the_recipe():
    from models.transformer.config import SIZES
    from models.transformer.model import flops_per_token, param_count

    for name in ("125m", "1b", "7b"):
        ms = cost.model_shape(name)
        assert ms.params == param_count(SIZES[name])
        assert ms.flops_per_token == pytest.approx(flops_per_token(SIZES[name]))


def test_search_ranks_fitting_layouts_by_time():
    res = sk.search("1b", devices=64, hardware="h100", global_batch=128)
    rows = res.rows
    assert rows and rows[0]["fits"]
    fitting = [r["step_time"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)
    assert all(0 < r["mfu"] <= 1 for r in rows[:10])
    small = sk.search("1b", devices=64, global_batch=128, memory_limit=1e9)
    assert not any(r["fits"] for r in small.rows) or small.rows[0]["memory"] <= 1e9
    with pytest.raises(ValueError, match="unknown model size"):
        sk.search("3q", devices=8, global_batch=8)


def test_efficiency_model_lands_in_the_published_band():
    """Published MFUs: Megatron-LM 41-48% on H100 at scale, MaxText 64-70% on TPU v5p; a
    roofline would say ~100%. Weak scaling 8 -> 256 H100s stays below 100%."""
    best = sk.search("7b", devices=256, hardware="h100", global_batch=512, top=3).best
    assert 0.40 <= best.mfu <= 0.70
    roof = cost.estimate("7b", best.layout, "h100", global_batch=512, model_efficiency=cost.ROOFLINE)
    assert roof.mfu > best.mfu
    v5p = sk.search("7b", devices=256, hardware="tpu-v5p", global_batch=512, top=3).best
    assert v5p.mfu > best.mfu
    rows = cost.weak_scaling("7b", best.layout, "h100", per_device_batch=2, devices=(8, 64, 256))
    assert rows[-1]["efficiency"] < 1.0
    # More exposed tensor-parallel traffic costs time; data-axis traffic hides behind compute.
    tp = cost.Layout(data=32, tensor=8, zero=1)
    e = cost.estimate("7b", tp, "h100", global_batch=512)
    assert e.time["exposed"] >= cost.efficiency_for(cost.hardware.lookup("h100")).exposed_tensor * e.time["tensor-reduce"]


def test_search_folds_identical_layouts():
    res = sk.search("1b", devices=8, global_batch=32)
    keys = [(r["step_time"], r["memory"], r["fits"]) for r in res.rows]
    assert len(keys) == len(set(keys))
    assert any(r["equivalent"] for r in res.rows)  # zero=3 over data == fsdp over the same devices
    # No two rows differ only in the data/fsdp split or ZeRO stage at (almost) the same time.
    ests = res.estimates
    for i, a in enumerate(ests):
        for b in ests[i + 1:]:
            la, lb = a.layout, b.layout
            fam = lambda lo, e: (lo.tensor, lo.pipe, lo.microbatches, lo.remat, lo.schedule,  # noqa: E731
                                 lo.repeats, lo.sequence_parallel, lo.context, lo.keep, e.fits)
            if fam(la, a) == fam(lb, b):
                assert abs(a.step_time - b.step_time) > 0.005 * min(a.step_time, b.step_time)


def test_search_keeps_residuals_where_memory_allows():
    """Issue 37: an explicit schedule's ``keep`` (``sk.pipeline(keep=)``) is one of the search's
    choices. keep="all" skips the recomputed forward (3/4 of keep="input"'s flops) and holds
    every in-flight microbatch's residuals; the search takes it where it fits and keep="input"
    under a memory limit that only the stage inputs fit."""
    from shardkit.pipeline.keep import KEEP

    # The loss in chunks, as the recipe runs it at this vocabulary: every keep stores its input.
    chunked = dataclasses.replace(cost.model_shape("1b"), loss_chunk=512)
    ests = {k: cost.estimate(chunked, cost.Layout(data=2, pipe=4, microbatches=8, schedule="1f1b", keep=k), "h100",
                             global_batch=16) for k in KEEP}
    assert ests["all"].flops == pytest.approx(0.75 * ests["input"].flops)
    assert ests["all"].step_time < ests["dots"].step_time < ests["input"].step_time
    assert ests["input"].memory["peak"] < ests["dots"].memory["peak"] < ests["all"].memory["peak"]
    # keep="lean" (the layer's named residuals): no matmul recomputed, dots' set and the attention
    # output kept, so all's flops and step at little more than dots' memory; it ranks first.
    assert ests["lean"].flops == ests["all"].flops and ests["lean"].step_time == ests["all"].step_time
    assert ests["dots"].memory["peak"] < ests["lean"].memory["peak"] < ests["all"].memory["peak"]
    # A loss's slot: "lean" runs the loss under "dots" (it names no LEAN_RESIDUALS), so a plain
    # loss's f32 logits or a chunked one's input and log-sum-exp are kept alike; lean and dots
    # differ by the layers' kept sets alone, whichever the loss (keep.Kept.loss_shapes).
    plain = {k: cost.estimate("1b", cost.Layout(data=2, pipe=4, microbatches=8, schedule="1f1b", keep=k), "h100",
                              global_batch=16).memory["activations"] for k in ("dots", "lean")}
    chunked_act = {k: ests[k].memory["activations"] for k in ("dots", "lean")}
    assert plain["lean"] - plain["dots"] == pytest.approx(chunked_act["lean"] - chunked_act["dots"])
    opts = dict(global_batch=16, pipe=(4,), tensor=(1,), fsdp=(1,), zero=(0,), microbatches=(8,), remat=("none",),
                schedules=("1f1b",))
    roomy = sk.search(chunked, 8, "h100", memory_limit=1e15, **opts)
    assert [r["keep"] for r in roomy.rows] == ["lean", "all", "dots", "input"]
    assert "keep=all" in str(roomy)  # the table's pipeline column says what is kept
    tight = sk.search(chunked, 8, "h100", memory_limit=(ests["input"].memory["peak"] + ests["dots"].memory["peak"]) / 2,
                      **opts)
    assert tight.best.layout.keep == "input" and tight.best.fits and not any(r["fits"] for r in tight.rows[1:])


def test_search_candidates_take_keep_chunks_and_a_context_axis():
    """Issue 37: ``keep`` on the explicit schedules without remat, every chunk count dividing a
    stage's layers, and a context axis only where each shard keeps ``CONTEXT_MIN_TOKENS``."""
    from shardkit.cost.search.candidates import CONTEXT_MIN_TOKENS, layouts

    kw = dict(layers=16, heads=8, global_batch=32, tensor=(1,), fsdp=(1,), zero=(0,), microbatches=(8,))
    los = layouts(8, seq=2048, schedules=("1f1b", "interleaved-1f1b", "circular"), **kw)
    explicit = [lo for lo in los if lo.pipe > 1 and lo.schedule != "circular"]
    assert {lo.keep for lo in explicit if lo.remat == "none"} == {"input", "all", "dots", "lean"}
    assert {lo.keep for lo in los if lo not in explicit or lo.remat != "none"} == {"input"}
    assert {lo.repeats for lo in los if lo.schedule == "interleaved-1f1b" and lo.pipe == 2} == {2, 4, 8}
    assert {lo.repeats for lo in los if lo.schedule == "circular" and lo.pipe == 8} == {2}
    assert {lo.context for lo in los} == {1}
    long = layouts(32, seq=131072, pipe=(1,), **dict(kw, microbatches=(1,)))
    assert {lo.context for lo in long} == {1, 2, 4, 8, 16} and 131072 // 16 == CONTEXT_MIN_TOKENS
    # Two 128K sequences on 32 devices: only a context axis gives every device work.
    best = sk.search("1b", 32, "h100", global_batch=2, seq=131072, pipe=(1,), tensor=(1,), fsdp=(1,)).best
    assert best.layout.context == 16 and best.layout.data == 2
    with pytest.raises(ValueError, match="no layout"):
        sk.search("1b", 32, "h100", global_batch=2, seq=131072, pipe=(1,), tensor=(1,), fsdp=(1,), context=(1,))


def test_layout_keep_is_checked_as_sk_pipeline_checks_it():
    for lo, match in [(cost.Layout(pipe=2, microbatches=4, schedule="1f1b", keep="most"), "use one of"),
                      (cost.Layout(pipe=2, microbatches=4, schedule="gpipe", keep="all"), "explicit schedules"),
                      (cost.Layout(data=2, keep="all"), "explicit schedules"),
                      (cost.Layout(pipe=2, microbatches=4, schedule="1f1b", remat="full", keep="dots"),
                       "remat='none' with keep")]:
        with pytest.raises(ValueError, match=match):
            cost.estimate("1b", lo, global_batch=8)


def test_weak_scaling_and_plan_cli(tmp_path, capsys):
    res = sk.search("1b", devices=64, global_batch=128, top=5)
    rows = cost.weak_scaling("1b", res.best.layout, "h100", per_device_batch=2, devices=(8, 64))
    assert rows[0]["efficiency"] == 1.0 and 0 < rows[-1]["efficiency"] <= 1.0 + 1e-9
    out = tmp_path / "plan.json"
    assert cost.plan_main(["--model", "125m", "--devices", "8", "--top", "3", "--json", str(out)]) == 0
    assert "125m on 8 x h100" in capsys.readouterr().out
    assert out.exists()


# ---- agreement with the compiled program --------------------------------------------------

D, F, L, B = 256, 1024, 2, 64
TP_RULES = [("w1", (None, None, "tensor")), ("w2", (None, "tensor", None))]


def _mlp_init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (L, D, F)) * 0.02, "w2": jax.random.normal(k2, (L, F, D)) * 0.02}


def _mlp_loss(p, batch):
    def layer(x, w):
        h = sk.constrain(jnp.tanh(x @ w[0]), ("batch", "mlp"))
        return sk.constrain(x + h @ w[1], ("batch", None)), None

    x, _ = jax.lax.scan(layer, batch["x"], (p["w1"], p["w2"]))
    return jnp.mean(x ** 2)


def _check(report, quantities, tol=TOL):
    rows = {r["quantity"]: r for r in report.comparison()}
    bad = []
    for q in quantities:
        r = rows.get(q)
        if r is None or (r["estimate"] == 0 and r["compiled"] == 0):
            continue
        ratio = r["estimate"] / r["compiled"] if r["compiled"] else float("inf")
        if abs(ratio - 1) > tol:
            bad.append(f"{q}: estimate {r['estimate']:.0f} compiled {r['compiled']:.0f} ratio {ratio:.3f}")
    assert not bad, f"{report.title}\n" + "\n".join(bad)


MLP_LAYOUTS = [("data=8", 0, 1), ("data=8", 1, 1), ("data=8", 2, 1), ("data=8", 3, 1),
               ("data=4,tensor=2", 0, 1), ("data=4,tensor=2", 1, 1), ("data=8", 0, 2)]


@pytest.mark.parametrize("mesh,zero,m", MLP_LAYOUTS)
def test_pytree_model_estimate_matches_compiled(mesh, zero, m):
    tp = "tensor" in mesh
    plan = sk.Plan(sk.make_mesh(mesh), rules=TP_RULES + [(".*", ())] if tp else [(".*", ())],
                   axis_rules={"batch": "data", "mlp": "tensor" if tp else None}, zero=zero)
    step = sk.train_step(plan, optax.adam(1e-3), microbatches=m)(_mlp_loss)
    state = step.abstract_state(_mlp_init)  # explain() compiles from shapes: no init program
    report = step.explain(state, {"x": jnp.ones((B, D))})
    assert report.estimate is not None
    _check(report, EXACT + COLLECTIVES + ("memory/peak",))
    flops = next(r for r in report.comparison() if r["quantity"] == "flops")
    assert flops["estimate"] == pytest.approx(flops["compiled"], rel=TOL)


TRANSFORMER = ["dp", "zero1", "zero3", "fsdp", "tp", "fsdp_tp", "tp_sp", "hybrid", "pp_gpipe", "pp_circular",
               "pp_1f1b", "tp_pp", "dp_pp_tp", "dp_pp_tp_1f1b", "pp_zb", "pp_interleaved", "dp_pp_tp_zb"]


@pytest.mark.parametrize("name", TRANSFORMER)
def test_transformer_estimate_matches_compiled(name):
    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.layouts import LAYOUTS, make_plan
    from models.transformer.model import PipelineSpec, Transformer, flops_per_token, loss_fn

    cfg = SIZES["test"].replace(d_model=64, heads=4, kv_heads=4, layers=4, seq=32)
    lo = LAYOUTS[name]
    plan = make_plan(sk.make_mesh(lo.mesh), cfg, zero=lo.zero, sequence_parallel=lo.sequence_parallel,
                     vocab_parallel=lo.vocab_parallel)
    pipe = PipelineSpec(4, lo.schedule, lo.repeats) if "pipe" in lo.mesh else None
    step = sk.train_step(plan, optax.adam(1e-3))(lambda model, batch: loss_fn(model, batch, pipe))
    state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # compiled from shapes
    tokens = jnp.zeros((16, cfg.seq), jnp.int32)
    report = step.explain(state, {"inputs": tokens, "targets": tokens},
                          flops_per_token=flops_per_token(cfg, cfg.seq))
    # Every quantity within 10%: state bytes, peak memory, each collective role, and flops
    # (attention and 1F1B's recomputed forward included) — but the peak of three layouts,
    # which the general liveness model (``cost/program/reader.py``) puts 10-14% low: XLA allocates
    # the layer scans' stacked buffers (zero-initialised, and copied) long before they are
    # written, which a model that follows the program's order misses.
    low_peak = name in ("dp", "zero1", "tp_sp")
    _check(report, EXACT + COLLECTIVES + PIPE_COLLECTIVES + ("flops",) + (() if low_peak else ("memory/peak",)))
    if low_peak:
        _check(report, ("memory/peak",), tol=0.15)


@pytest.mark.parametrize("name", ["pp_gpipe", "pp_circular", "pp_1f1b", "pp_zb", "pp_interleaved"])
def test_analytic_pipeline_estimate_matches_the_step_estimate(name):
    """``sk.search``'s analytic ``estimate`` and the leaf-by-leaf step estimate count a
    pipeline's traffic alike: one gradient reduction over data per step (not m), circular's
    stage-major relayout, the permutes per schedule tick and the pipe psums."""
    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.layouts import LAYOUTS, make_plan
    from models.transformer.model import PipelineSpec, Transformer, loss_fn

    cfg = SIZES["test"].replace(d_model=64, heads=4, kv_heads=4, layers=4, seq=32)
    lo = LAYOUTS[name]
    mesh = sk.make_mesh(lo.mesh)
    plan = make_plan(mesh, cfg, zero=lo.zero, vocab_parallel=lo.vocab_parallel)
    pipe = PipelineSpec(4, lo.schedule, lo.repeats)
    step = sk.train_step(plan, optax.adam(1e-3))(lambda model, batch: loss_fn(model, batch, pipe))
    state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # traced, never run
    tokens = jnp.zeros((16, cfg.seq), jnp.int32)
    by_step = cost.estimate_for_step(step, state, {"inputs": tokens, "targets": tokens},
                                     pipeline=(4, lo.schedule, lo.repeats))
    layout = cost.Layout(data=mesh.shape["data"], pipe=mesh.shape["pipe"], zero=lo.zero, microbatches=4,
                         schedule=lo.schedule, repeats=lo.repeats)
    analytic = cost.estimate(cfg, layout, "h100", global_batch=16, precision="fp32")
    for role in ("grad-reduce", "param-gather", "pipe-permute", "pipe-reduce", "pipe-relayout"):
        assert analytic.collectives[role] == pytest.approx(by_step.collectives[role], rel=0.02), role
    assert analytic.collectives["grad-reduce"] > 0
    assert (analytic.collectives["pipe-relayout"] > 0) == (lo.repeats > 1)  # circular, interleaved
    more = cost.estimate(cfg, dataclasses.replace(layout, microbatches=8), "h100", global_batch=32,
                         precision="fp32")
    assert more.collectives["grad-reduce"] == analytic.collectives["grad-reduce"]  # once per step


def test_sequence_parallel_pipeline_gathers_again_where_the_backward_recomputes():
    """Under sequence parallelism inside an explicit schedule, a backward op that recomputes its
    chunk's forward (``keep="input"``, a policy's: the gather is no matmul) gathers each region's
    input again; ``keep="all"`` holds the gathered input (XLA:GPU at Llama 3 405B's widths, 8K:
    6.5 / 6.4 / 4.4 all-gathers over tensor per layer and microbatch under input / dots / all).
    The step estimate's tensor-gather bytes differ by one activation per region and pipeline
    microbatch: 2 regions x 2 layers a stage x 4 microbatches here."""
    from flax import nnx

    from models.transformer.config import SIZES
    from models.transformer.layouts import make_plan
    from models.transformer.model import PipelineSpec, Transformer, loss_fn

    cfg = SIZES["test"].replace(layers=4)
    plan = make_plan(sk.make_mesh("pipe=2,tensor=4"), cfg, sequence_parallel=True)
    tokens = jnp.zeros((8, cfg.seq), jnp.int32)
    gathered = {}
    for keep in ("input", "all"):
        pipe = PipelineSpec(4, "1f1b", keep=keep)
        step = sk.train_step(plan, optax.adam(1e-3))(lambda model, batch, pipe=pipe: loss_fn(model, batch, pipe))
        state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
        gathered[keep] = cost.estimate_for_step(step, state, {"inputs": tokens, "targets": tokens}
                                                ).collectives["tensor-gather"]
    # One microbatch of the pipeline: 2 rows of 16 tokens, split over tensor (SP) and gathered
    # whole, f32 on XLA:CPU.
    activation = 2 * cfg.seq * cfg.d_model * 4
    assert gathered["input"] - gathered["all"] == pytest.approx(2 * 2 * 4 * activation)


# ---- pipelines (sk.pipeline's trace note drives the estimate) --------------------------------

PD, PB, PL, PM = 128, 32, 8, 4


def _pipe_layer(lp, h):
    return jnp.tanh(h @ lp["w"] + lp["b"][None])


def _pipe_head(hp, y, t):
    return jnp.mean((y @ hp["w"] - t) ** 2)


def _pipe_init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"layers": {"w": jax.random.normal(k1, (PL, PD, PD)) * 0.1, "b": jnp.zeros((PL, PD))},
            "head": {"w": jax.random.normal(k2, (PD, PD)) * 0.1}}


def _pipe_step(mesh, schedule, v, zero):
    devs = jax.devices()[:4] if "data" not in mesh else None
    plan = sk.Plan(sk.make_mesh(mesh, devices=devs), rules=[(r"layers", ("pipe",)), (r".*", ())], zero=zero)

    @sk.train_step(plan, optax.adam(1e-3))
    def step(model, batch):
        return sk.pipeline(_pipe_layer, model["layers"], batch["x"], microbatches=PM, schedule=schedule,
                           repeats=v, loss_fn=_pipe_head, loss_params=model["head"], targets=batch["t"])

    return step, step.abstract_state(_pipe_init), {"x": jnp.ones((PB, PD)), "t": jnp.ones((PB, PD))}


PIPE_LAYOUTS = [("pipe=4", "gpipe", 1, 0), ("data=2,pipe=4", "gpipe", 1, 1),
                ("data=2,pipe=4", "circular", 2, 1), ("pipe=4", "1f1b", 1, 0),
                ("data=2,pipe=4", "1f1b", 1, 1)]


@pytest.mark.parametrize("mesh,schedule,v,zero", PIPE_LAYOUTS)
def test_pipeline_estimate_matches_compiled(mesh, schedule, v, zero):
    """State bytes, peak memory and every pipeline collective (permutes, the pipe psums, the
    gradient reduction over data) within 10%."""
    step, state, batch = _pipe_step(mesh, schedule, v, zero)
    report = step.explain(state, batch)
    assert step.trace_notes["pipeline"]["schedule"] == schedule
    rows = {r["quantity"]: r for r in report.comparison()}
    assert rows["collective/pipe-permute"]["compiled"] > 0
    _check(report, EXACT + PIPE_COLLECTIVES + ("memory/peak",))
    # Executed matmul flops: GPipe/circular idle ticks compute (ticks/(v·m) × the stages'),
    # 1F1B's switch branches weighted by the schedule table on the compiled side.
    _check(report, ("flops",))


def test_pipeline_override_and_bubble():
    step, state, batch = _pipe_step("data=2,pipe=4", "gpipe", 1, 1)
    auto = cost.estimate_for_step(step, state, batch)  # lowers once to read the trace note
    assert auto.layout.pipe == 4 and auto.layout.microbatches == PM
    more = cost.estimate_for_step(step, state, batch, pipeline=(8, "gpipe", 1))
    assert more.layout.microbatches == 8 and more.collectives["pipe-permute"] > 0
    assert more.time["bubble"] < auto.time["bubble"]


def test_a_pipelined_moe_step_with_data_axes_counts_its_row_syncs():
    """An ``sk.moe`` block in front of a GPipe pipeline on data=2,pipe=4: its load-balancing
    loss's expert shares are all-reduced over data on their own (the program's row syncs), in
    ``grad-reduce`` beside the pipeline's gradient reduction, not overwritten by it."""
    from shardkit.cost.analytic.step_facts import step_facts

    E, note = 4, (PM, "gpipe", 1)
    plan = sk.Plan(sk.make_mesh("data=2,pipe=4"), rules=[(r"layers", ("pipe",)), (r".*", ())], zero=1)

    def init():
        k1, k2 = jax.random.split(jax.random.key(1))
        return {**_pipe_init(), "moe": {"router": jax.random.normal(k1, (PD, E)) * 0.1,
                                        "experts": jax.random.normal(k2, (E, PD, PD)) * 0.1}}

    def step_for(balanced: bool):
        @sk.train_step(plan, optax.adam(1e-3))
        def step(model, batch):
            moe = model["moe"]
            y, aux = sk.moe(batch["x"], batch["x"] @ moe["router"], lambda w, h: jnp.tanh(h @ w), moe["experts"],
                            top_k=1)
            loss = sk.pipeline(_pipe_layer, model["layers"], batch["x"] + y, microbatches=PM, schedule="gpipe",
                               loss_fn=_pipe_head, loss_params=model["head"], targets=batch["t"])
            return loss + 0.01 * aux["load_balance"] if balanced else loss

        return step, step.abstract_state(init), {"x": jnp.ones((PB, PD)), "t": jnp.ones((PB, PD))}

    plain, balanced = (cost.estimate_for_step(*step_for(b), pipeline=note) for b in (False, True))
    syncs, sync_bytes = step_facts(*step_for(True), note).reading.row_syncs
    assert syncs == 1 and sync_bytes > 0
    assert balanced.collectives["grad-reduce"] == plain.collectives["grad-reduce"] + sync_bytes
    # One more op behind the gradients: its latency is in the step time.
    assert balanced.time["grad-reduce"] > plain.time["grad-reduce"]


def test_an_nnx_model_with_batch_statistics_is_estimated_from_its_abstract_state():
    """``estimate_for_step`` takes an abstract state (``step.abstract_state``, as
    ``sk.cost.simulate`` hands it a target's): a Flax NNX BatchNorm writes its running
    statistics into the model state as the loss is traced, which must then be arrays jax can
    update, not host (numpy) ones."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(16, 16, rngs=rngs)
            self.norm = nnx.BatchNorm(16, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.dense(x), use_running_average=False)

    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())])
    step = sk.train_step(plan, optax.sgd(0.1))(lambda model, batch: jnp.mean(model(batch["x"]) ** 2))
    state = step.abstract_state(lambda: Net(nnx.Rngs(0)))
    est = cost.estimate_for_step(step, state, {"x": jax.ShapeDtypeStruct((32, 16), jnp.float32)})
    assert est.memory["model_state"] == 2 * 16 * 4  # the running mean and variance, f32


def test_a_pipelined_estimate_traces_its_loss_once():
    """A pipeline's saved residuals are read off the trace the program reader walks (the loss's
    ``value_and_grad``, in the parameters as the step takes it), not off a second trace of the
    loss (``jax.ad_checkpoint.saved_residuals``, which differentiated the batch too)."""
    traces = []
    plan = sk.Plan(sk.make_mesh("data=2,pipe=4"), rules=[(r"layers", ("pipe",)), (r".*", ())], zero=1)

    @sk.train_step(plan, optax.adam(1e-3))
    def step(model, batch):
        traces.append(1)
        return sk.pipeline(_pipe_layer, model["layers"], batch["x"], microbatches=PM, schedule="gpipe",
                           loss_fn=_pipe_head, loss_params=model["head"], targets=batch["t"])

    state, batch = step.abstract_state(_pipe_init), {"x": jnp.ones((PB, PD)), "t": jnp.ones((PB, PD))}
    est = cost.estimate_for_step(step, state, batch, pipeline=(PM, "gpipe", 1))  # the note given: no lowering
    assert est.memory["activations"] > 0
    assert len(traces) == 1


def test_an_estimate_walks_its_traced_program_once(monkeypatch):
    """One walk of the traced ``value_and_grad`` per estimate hands every equation to each
    reading (liveness and flops, row syncs, the gather-or-move check, explicit collectives):
    each nested jaxpr (sk.moe's shard_map, jax's calls) is entered once per equation holding
    it, not once per reading."""
    import families as F
    from shardkit.cost.program import walk, walker

    walks, entries = [], []
    top, nested = walker.Walker.walk, walker.Walker._walk
    monkeypatch.setattr(walker.Walker, "walk", lambda self, j: walks.append(j) or top(self, j))
    monkeypatch.setattr(walker.Walker, "_walk", lambda self, j, *a: entries.append(j) or nested(self, j, *a))
    step, state, batch = F.build("moe", "data=2,expert=4", 1)
    est = cost.estimate_for_step(step, state, batch)
    assert est.collectives["expert-all-to-all"] > 0  # the shard_map's collectives were read
    assert len(walks) == 1

    def inside(j):  # the jaxprs one walk of ``j`` enters, ``j`` included
        return 1 + sum(inside(sub) for e in j.eqns for sub, _, _ in walk.sub_jaxprs(e))

    assert len(entries) == inside(walks[0]) > 1


# ---- the program reader: reductions over the rows the backward waits for -------------------------

def _syncs(loss):
    """``ProgramReading.row_syncs`` of ``loss`` on 32 rows split 8 ways over the data axes."""
    from shardkit.cost.program.reader import read_program

    params = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((32, 16), jnp.float32)}

    def split_of(aval, leaf, manual=frozenset()):
        return (8 if leaf is None and aval.shape[:1] == (32,) else 1), 1

    return read_program(loss, params, batch, split_of=split_of, n_params=1).row_syncs[0]


def test_row_syncs_count_the_reductions_the_backward_waits_for():
    def plain(p, b):  # the loss's mean reaches the loss value only: folded into the gradients'
        return jnp.mean(jnp.tanh(b["x"] @ p["w"]))

    def balanced(p, b):  # Switch's load balance: the rows' shares scale every row's gradient
        probs = jax.nn.softmax(b["x"] @ p["w"])
        share = jnp.mean(jax.lax.stop_gradient(probs), axis=0)
        return jnp.sum(share * jnp.mean(probs, axis=0))

    def batch_norm_twice(p, b):  # a chain: the second statistics wait for the first
        def norm(h):
            mu = jnp.mean(h, axis=0, keepdims=True)
            return (h - mu) * jax.lax.rsqrt(jnp.mean((h - mu) ** 2, axis=0, keepdims=True) + 1e-5)
        h = norm(b["x"] @ p["w"])
        return jnp.mean(jnp.tanh(norm(h * h)))

    assert _syncs(plain) == 0
    assert _syncs(balanced) == 1
    assert _syncs(batch_norm_twice) >= 2


def _without_scan_counts(jaxpr):
    """``jaxpr`` with every scan's ``num_consts``/``num_carry`` params removed, as jax 0.11
    writes scans (it replaced them by a ``FlatTree``, ``ft_in``)."""
    from jax._src import core as jcore

    def strip(value):
        if isinstance(value, jcore.ClosedJaxpr):
            return jcore.ClosedJaxpr(strip(value.jaxpr), value.consts)
        if isinstance(value, jcore.Jaxpr):
            eqns = []
            for e in value.eqns:
                params = {k: strip(v) if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))
                          else tuple(strip(b) for b in v) if k == "branches" else v
                          for k, v in e.params.items() if not (e.primitive.name == "scan" and k in ("num_consts", "num_carry"))}
                eqns.append(e.replace(params=params))
            return value.replace(eqns=eqns)
        return value
    return strip(jaxpr)


def test_scan_counts_are_read_off_the_avals_as_jax_0_11_writes_scans(monkeypatch):
    """A real H200 run under jax 0.11 raised ``KeyError: 'num_consts'`` in explain(): the
    reader took a scan's consts and carries from params jax 0.11 no longer writes. They are
    derived from the avals now; the estimate is the same with those params and without."""
    from jax._src import core as jcore

    from shardkit.cost.program.walk import scan_split

    def loss(p, batch):
        def layer(carry, w):
            x, n = carry
            return (x + jnp.tanh(x @ w[0]) @ w[1] * p["scale"], n + 1.0), jnp.sum(x)
        (x, _), sums = jax.lax.scan(layer, (batch["x"], 0.0), (p["w1"], p["w2"]))
        return jnp.mean(x ** 2) + jnp.sum(sums)

    params = {**_mlp_init(), "scale": jnp.ones(())}
    batch = {"x": jnp.ones((B, D))}
    scans = []

    def visit(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "scan":
                scans.append(e)
            for sub in jcore.jaxprs_in_params(e.params):
                visit(getattr(sub, "jaxpr", sub))
    visit(jax.make_jaxpr(jax.value_and_grad(loss))(params, batch).jaxpr)
    assert len(scans) >= 2  # the forward scan and its transpose
    def declared(e):  # what the scan itself says: jax 0.10's params, or jax 0.11's FlatTree
        if "num_consts" in e.params:
            return e.params["num_consts"], e.params["num_carry"]
        consts, carry, _ = e.params["ft_in"].unpack()
        return len(list(consts)), len(list(carry))
    assert [scan_split(e) for e in scans] == [declared(e) for e in scans]

    plan = sk.Plan(sk.make_mesh("data=4,tensor=2"), rules=TP_RULES + [(r".*", ())],
                   axis_rules={"batch": "data", "mlp": "tensor"})
    step = sk.train_step(plan, optax.adam(1e-3))(loss)
    state = step.init(params)
    before = cost.estimate_for_step(step, state, batch).as_dict()
    make_jaxpr = jax.make_jaxpr
    monkeypatch.setattr(jax, "make_jaxpr", lambda *a, **k: (lambda *x, **y: _without_scan_counts(
        make_jaxpr(*a, **k)(*x, **y))))
    assert cost.estimate_for_step(step, state, batch).as_dict() == before


def test_a_compiled_layout_the_estimate_is_far_under_is_flagged_in_the_table():
    """Notebook 07 showed a compiled H100 peak of 28.9 GB beside 15.3 GB estimated, and a
    step of 75.9 ms beside 45.6 ms, with no flag; the mesh column was cut to "data=8,…"."""
    from shardkit.cost.compiled.bands import underestimate
    from shardkit.cost.search.rank import Verified, compiled_flags

    assert underestimate(15.3, 28.9) == "under-estimate: 47% under the compiled peak; plan with the compiled figure"
    assert underestimate(95.0, 100.0) is None and underestimate(120.0, 100.0) is None and underestimate(1.0, 0.0) is None
    res = sk.search("1b", devices=256, global_batch=256, pipe=[1], top=3)
    first, second = res.estimates[:2]
    compiled = types.SimpleNamespace(target="h100")  # what the table reads of a compiled report
    res.verified = [Verified(compiled, 1.89 * first.memory["peak"], True, {"step": first.step_time / 0.6}),
                    Verified(compiled, 1.05 * second.memory["peak"], True, {"step": second.step_time}), None]
    assert compiled_flags(first, res.verified[0]) == [
        "under-estimate: 47% under the compiled peak; plan with the compiled figure",
        "under-estimate: 40% under the compiled step time (re-timed on its collectives); plan with the compiled figure"]
    assert compiled_flags(second, res.verified[1]) == [] and res.rows[1]["flags"] == []
    text = res.table(3)._repr_mimebundle_()["text/plain"]
    assert "\x1b[" not in text and "…" not in text
    mesh = first.layout.mesh + (" +sp" if first.layout.sequence_parallel else "")
    assert f"! #1 {mesh}: under-estimate: 47% under the compiled peak" in " ".join(text.split())
    assert sum(line.count(" !") for line in text.splitlines() if line.startswith("│ 1 ")) == 2
