"""``sk.cost.simulate`` / ``step.explain(mesh=...)``: the step compiled for a mesh that is not
here (a subprocess with N simulated CPU devices), and ``search(..., verify=k)``."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk
from shardkit.cost.compiled.simulated import SimulationError, abstract_mesh
from shardkit_test_compile import AS_RUN_ENV  # tests/_site, on the path conftest.py sets

pytestmark = pytest.mark.subprocess

D, H = 64, 256  # divisible by 64: ZeRO-3 on 64 devices shards every leaf evenly
PSI = 2 * D * H


def mlp_loss(p, b):
    h = jax.nn.relu(sk.constrain(b["x"] @ p["w1"], ("batch", "mlp")))
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def mlp_step(mesh: str, zero: int, microbatches: int = 1):
    plan = sk.Plan(sk.make_mesh(mesh), rules=[(r"w1", (None, "tensor")), (r"w2", ("tensor", None))],
                   axis_rules=sk.AxisRules({"batch": "data", "mlp": "tensor"}, drop_missing=True), zero=zero)
    step = sk.train_step(plan, optax.adam(1e-3), microbatches=microbatches)(mlp_loss)
    state = step.init({"w1": jnp.ones((D, H)) * 0.01, "w2": jnp.ones((H, D)) * 0.01})
    return step, state


def batch_of(rows: int):
    return {"x": np.ones((rows, D), np.float32), "y": np.ones((rows, D), np.float32)}


THIS_MESH = [("data=4,tensor=2", 1, 1), ("data=8,tensor=1", 3, 2)]


@pytest.fixture(scope="module")
def simulated():
    """The MLP's steps on ``THIS_MESH`` and on 64 devices (ZeRO-3 over data, ZeRO-1 beside
    tensor) and ``pipelined_step`` on data=16,pipe=4, compiled with the estimate in ONE
    subprocess (``sk.cost.simulate_many``: each start of JAX costs seconds), as
    ``step.explain(mesh=)`` compiles one (``sk.cost.simulate``, which it calls, runs alone in
    test_a_plan_on_an_abstract_mesh_builds_without_devices): ``{key: (step, state, batch, report)}``.
    The tests read state bytes, collectives and estimates, and compare with ``explain`` in this
    process under the same emitters: XLA:CPU's older ones (conftest's ``older_emitters_ahead_of_time``)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv(AS_RUN_ENV, "1")
        return _simulate_the_meshes()


def _simulate_the_meshes():
    jobs = {}
    for mesh, zero, microbatches in THIS_MESH:
        step, state = mlp_step(mesh, zero, microbatches)
        jobs[mesh] = dict(step=step, state=state, batch=batch_of(32), mesh=mesh)
    step, state = mlp_step("data=4,tensor=2", zero=1)
    for mesh, zero in (("data=64,tensor=1", 3), ("data=16,tensor=4", 1)):
        jobs[mesh] = dict(step=step, state=state, batch=batch_of(128), mesh=mesh, zero=zero)
    step, state, batch = pipelined_step()
    jobs["data=16,pipe=4"] = dict(step=step, state=state, batch=batch, mesh="data=16,pipe=4")
    reports = sk.cost.simulate_many(list(jobs.values()), estimate=True)
    for r in reports:
        if isinstance(r, Exception):
            raise r
    return {k: (j["step"], j["state"], j["batch"], r) for (k, j), r in zip(jobs.items(), reports)}


@pytest.mark.parametrize("mesh,zero,microbatches", THIS_MESH)
def test_simulating_this_mesh_equals_explain_in_process(mesh, zero, microbatches, simulated,
                                                       older_emitters_ahead_of_time):
    step, state, batch, there = simulated[mesh]
    here = step.explain(state, batch)
    assert there.memory == here.memory
    assert there.collectives == here.collectives
    assert sorted(map(repr, there.traffic)) == sorted(map(repr, here.traffic))
    assert (there.flops, there.matmul_flops) == (here.flops, here.matmul_flops)
    assert there.roles() == here.roles() and there.role_counts() == here.role_counts()
    assert there.estimate == here.estimate  # the analytic model sees the same layout
    assert "simulated mesh" in there.compiled_on and "this process" in here.compiled_on


def test_64_devices_zero3_and_zero1_state_bytes_follow_zero(simulated):
    r3, r1 = simulated["data=64,tensor=1"][3], simulated["data=16,tensor=4"][3]
    # ZeRO-3 (Rajbhandari et al. 2020): params 4Ψ/N, Adam moments 8Ψ/N (+ its int32 count),
    # gradients 4Ψ/N; the batch is split over 64 devices.
    assert r3.memory["params"] == 4 * PSI // 64
    assert r3.memory["opt_state"] == 8 * PSI // 64 + 4
    assert r3.memory["grads"] == 4 * PSI // 64
    assert r3.memory["batch"] == 2 * 2 * D * 4
    # The compiled arguments are exactly that state, the batch and the step's scalars
    # (step, skipped, streak: int32; the rng key's two uint32).
    scalars = 3 * 4 + 2 * 4
    assert r3.memory["arguments"] == sum(r3.memory[k] for k in ("params", "opt_state", "model_state", "batch")) + scalars
    assert r3.compiled()["collective/param-gather"] > 0  # FSDP gathers the weights
    assert r1.memory["params"] == 4 * PSI // 4  # split over tensor only
    assert r1.memory["opt_state"] == 8 * PSI // 64 + 4  # and the moments over data too
    assert r1.compiled()["collective/tensor-reduce"] > 0
    assert "64 XLA:CPU devices" in r1.compiled_on
    text = str(r1)
    assert "simulated mesh data=16,tensor=4" in text and "modelled" in text and "shard sizes" in text


def test_bad_mesh_specs_and_too_many_devices_are_clear_errors():
    step, state = mlp_step("data=8,tensor=1", zero=0)
    batch = batch_of(32)
    with pytest.raises(ValueError, match="tensor"):
        sk.cost.simulate(step, state, batch, "data=4,tensor=0")
    with pytest.raises(ValueError, match="max_devices=4096"):
        sk.cost.simulate(step, state, batch, "data=8192")
    with pytest.raises(sk.ShardingError, match="not divisible by 64"):
        step.explain(state, batch, mesh="data=64,tensor=1")  # 32 rows over 64 devices
    with pytest.raises(sk.ShardingError, match="unknown mesh axis 'tensor'"):
        step.explain(state, batch, mesh="data=8")  # the rules name tensor
    with pytest.raises(ValueError, match="only with mesh="):
        step.explain(state, batch, zero=3)
    with pytest.raises(SimulationError, match="took more than"):
        sk.cost.simulate(step, state, batch, "data=8,tensor=1", timeout=0.01)


PIPE_L, PIPE_W = 4, 32


def pipelined_step():
    """A GPipe step over ``pipe`` (4 layers of PIPE_W, 4 microbatches) planned on data=4,pipe=2."""
    def loss(p, b):
        def stage(w, x):
            return jnp.tanh(x @ w)
        y = sk.pipeline(lambda w, x: stage(w["w"], x), {"w": p["layers"]}, b["x"], microbatches=4)
        return jnp.mean(y ** 2)

    plan = sk.Plan(sk.make_mesh("data=4,pipe=2"), rules=[(r"layers", ("pipe",))], zero=1)
    step = sk.train_step(plan, optax.sgd(0.1))(loss)
    state = step.init({"layers": jnp.ones((PIPE_L, PIPE_W, PIPE_W)) * 0.1})
    return step, state, {"x": np.ones((128, PIPE_W), np.float32)}


def test_a_pipelined_step_compiles_on_a_simulated_mesh(simulated):
    there = simulated["data=16,pipe=4"][3]
    assert there.pipe_axis == "pipe" and there.roles()["pipe-permute"] > 0
    # f32 layers over 4 stages (ZeRO-1 keeps whole params)
    assert there.memory["params"] == PIPE_L * PIPE_W * PIPE_W * 4 // 4
    assert there.estimate is not None and there.estimate["memory/params"] == there.memory["params"]


def test_a_plan_on_an_abstract_mesh_builds_without_devices(older_emitters_ahead_of_time):
    mesh = abstract_mesh("data=32,tensor=8")
    plan = sk.Plan(mesh, rules=[(r"w1", (None, "tensor")), (r"w2", ("tensor", None))],
                   axis_rules={"batch": "data", "mlp": "tensor"}, zero=3)
    step = sk.train_step(plan, optax.adam(1e-3))(mlp_loss)
    state = step.abstract_state(lambda: {"w1": jnp.zeros((D, H)), "w2": jnp.zeros((H, D))})
    assert np.prod(state.params["w1"].sharding.shard_shape((D, H))) == D * H // 256
    report = sk.cost.simulate(step, state, batch_of(256), mesh, estimate=False)
    assert report.memory["params"] == 4 * PSI // 256 and report.estimate is None


def test_search_verify_replans_a_given_step_on_each_layout(older_emitters_ahead_of_time):
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())],  # one table for every layout searched
                   axis_rules=sk.AxisRules({"batch": ("data", "fsdp"), "mlp": "tensor"}, drop_missing=True))
    step = sk.train_step(plan, optax.adam(1e-3))(mlp_loss)
    state = step.init({"w1": jnp.ones((D, H)), "w2": jnp.ones((H, D))})
    res = sk.search(state.params, 8, "h100", global_batch=32, flops_per_token=6 * PSI, verify=2,
                    step=step, state=state, batch=batch_of(32), pipe=(1,), remat=("none",), microbatches=(1,))
    checked = [(e, v) for e, v in zip(res.estimates, res.verified) if v is not None]
    assert len(checked) == 2 and all(not v.error and v.fits for _, v in checked)
    for e, v in checked:  # compiled on the layout's mesh with its ZeRO stage
        assert v.report.title.startswith(f"Plan(mesh='{e.layout.mesh}', zero={e.layout.zero}")
    with pytest.raises(ValueError, match="build=layout"):
        sk.search(state.params, 8, global_batch=32, verify=1)


@pytest.mark.extended  # default lane: tests/test_cost.py::test_search_keeps_residuals_where_memory_allows (analytic)
def test_search_verify_compiles_each_keep_through_the_recipe_builder():
    """Issue 37: ``verify=k`` compiles the candidates' ``keep`` through the recipe
    (``models.transformer.plan.builder``): keep="all" holds every in-flight microbatch's
    residuals, a larger compiled peak than keep="input"'s stage inputs (the same program
    twice if the builder dropped it)."""
    from models.transformer.config import SIZES
    from models.transformer.plan import builder

    cfg = SIZES["test"].replace(layers=4)
    res = sk.search(cfg, 8, "h100", global_batch=16, verify=3, build=builder(cfg, global_batch=16), target="h100",
                    memory_limit=1e12, pipe=(2,), tensor=(1,), fsdp=(1,), zero=(0,), microbatches=(4,),
                    remat=("none",), schedules=("1f1b",), keep=("input", "all", "lean"), sequence_parallel=(False,))
    checked = {e.layout.keep: v for e, v in zip(res.estimates, res.verified) if v is not None and not v.error}
    peaks = {k: v.peak for k, v in checked.items()}
    assert set(peaks) == {"input", "all", "lean"} and peaks["input"] < peaks["lean"] < peaks["all"], (
        peaks, res.verified)
    assert {r["keep"] for r in res.rows} == {"input", "all", "lean"}
    # Compiled as the step runs on an H100: XLA:GPU's recompute limit at the step's share of it.
    assert all("recomputes past 95% of the device" in " ".join(v.report.notes) for v in checked.values())


@pytest.mark.slow
def test_search_verify_recompiles_and_reranks_the_top_layouts(older_emitters_ahead_of_time):
    from models.transformer.config import SIZES
    from models.transformer.layouts import make_plan
    from models.transformer.model import Transformer, loss_fn

    cfg = SIZES["test"]
    batch = {k: jax.ShapeDtypeStruct((16, cfg.seq), np.int32) for k in ("inputs", "targets")}

    def build(lo):
        plan = make_plan(abstract_mesh(lo.mesh), cfg, zero=lo.zero)
        step = sk.train_step(plan, optax.adamw(1e-3), microbatches=lo.microbatches)(lambda m, b: loss_fn(m, b))
        return step, step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), batch

    opts = dict(global_batch=16, pipe=(1,), remat=("none",), microbatches=(1,), sequence_parallel=(False,))
    plain = sk.search(cfg, 8, "h100", **opts)
    res = sk.search(cfg, 8, "h100", verify=2, build=build, **opts)
    top2 = {str(e.layout) for e in plain.estimates[:2]}
    checked = [(e, v) for e, v in zip(res.estimates, res.verified) if v is not None]
    assert {str(e.layout) for e, _ in checked} == top2  # the analytic top 2 were compiled
    assert all(v.report is not None and v.peak > 0 and not v.error for _, v in checked)
    # Re-ranked by the compiled traffic's step time, fitting ones first.
    times = [v.step_time for _, v in checked]
    assert times == sorted(times) and [e for e, _ in checked] == res.estimates[:2]
    for e, v in checked:  # the compiled bytes per role feed the re-timed step
        assert v.report.roles()["grad-reduce" if e.layout.data * e.layout.fsdp > 1 else "tensor-reduce"] > 0
    assert res.rows[0]["compiled_memory"] == checked[0][1].peak and "compiled_step_time" in res.rows[1]
    assert "compiled_memory" not in res.rows[2]
    assert "compiled: XLA:CPU's program" in str(res)
    # A memory limit below every compiled peak moves them all behind the uncompiled layouts.
    tight = sk.search(cfg, 8, "h100", verify=1, build=build, memory_limit=1.0, **opts)
    assert all(v is None for v in tight.verified[:-1])
    assert tight.verified[-1] is not None and not tight.verified[-1].fits
    # ... and the table still shows that compiled row past its top rows.
    assert len(tight.estimates) > 2 and tight.table(top=1).row_count == 2
    assert [r["rank"] for r in tight.shown_rows(1)] == [1, len(tight.estimates)]


def test_a_compilers_out_of_memory_verdict_is_does_not_fit_with_its_bytes():
    """XLA:TPU refuses, at compile time, a program whose temporaries exceed the chip's HBM: that
    is an answer (the layout does not fit, by how much), not a crash."""
    from shardkit.cost.compiled.child import compile_error
    from shardkit.cost.compiled.simulated import DoesNotFit

    err = compile_error({"error": "compiling for the mesh [['fsdp', 256]] (tpu-v5p) failed: JaxRuntimeError: "
                                   "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
                                   "HLO temporaries (158.05G) exceeds available HBM (95.74G)."})
    assert isinstance(err, DoesNotFit) and isinstance(err, SimulationError)
    assert err.required == 158.05 * 2**30 and err.available == 95.74 * 2**30
    assert "needs 158.1 GiB of temporaries per device, the device has 95.7 GiB" in str(err)
    # A report's fits verdict for a v5p is judged against what this compiler allows, in the
    # same (binary) unit: the "95 GB" of Google's table read as decimal was 88.5 GiB.
    assert sk.cost.hardware.lookup("tpu-v5p").hbm_bytes == err.available
    assert type(compile_error({"error": "something else"})) is SimulationError
