import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk
from shardkit.explain import collectives_from_hlo

HLO = """HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %g = f32[8] get-tuple-element(%p), index=1
  %ag = f32[32]{0} all-gather(%g), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %g)
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %g = f32[8] get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%g), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %w = (s32[], f32[8]) while(%p), condition=%cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8], b: bf16[4,4]) -> f32[8] {
  %a = f32[8] parameter(0)
  %b = bf16[4,4] parameter(1)
  %rs = (bf16[1,4]{1,0}, f32[2]{0}) reduce-scatter(%b, %a), channel_id=2, dimensions={0}, to_apply=%add
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  ROOT %r = f32[8] get-tuple-element(%w), index=1
}
"""


def test_collectives_are_counted_through_nested_loops():
    got = {c.kind: c for c in collectives_from_hlo(HLO)}
    assert got["all-reduce"].count == 4 and got["all-reduce"].bytes == 4 * 32
    assert got["all-gather"].count == 12 and got["all-gather"].bytes == 12 * 128  # 4 x 3 trips
    assert got["reduce-scatter"].count == 1 and got["reduce-scatter"].bytes == 8 + 8
    assert all(c.static_count == 1 for c in got.values())


# XLA:TPU's reduce-scatter, as the v5p compile of the README MLP on data=2,fsdp=2,tensor=2 writes
# it (issue 36): a kCustom fusion around an all-reduce and the dynamic-slice of this device's shard.
TPU_REDUCE_SCATTER = """HloModule m

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %a = bf16[] add(%x, %y)
}

%all-reduce-scatter (input: bf16[1024,2048]) -> bf16[256,2048] {
  %input = bf16[1024,2048]{1,0:T(8,128)(2,1)} parameter(0)
  %all-reduce.16 = bf16[1024,2048]{1,0:T(8,128)(2,1)} all-reduce(%input), channel_id=13, replica_groups={{0,4,2,6},{1,5,3,7}}, use_global_device_ids=true, to_apply=%add
  %o = s32[] constant(0)
  ROOT %dynamic-slice.80 = bf16[256,2048]{1,0:T(8,128)(2,1)} dynamic-slice(%all-reduce.16, %o, %o), dynamic_slice_sizes={256,2048}
}

ENTRY %main (g: bf16[1024,2048]) -> bf16[256,2048] {
  %g = bf16[1024,2048]{1,0} parameter(0)
  ROOT %fusion = bf16[256,2048]{1,0:T(8,128)(2,1)} fusion(%g), kind=kCustom, calls=%all-reduce-scatter
}
"""


def test_xla_tpus_reduce_scatter_fusion_reads_as_a_reduce_scatter():
    from shardkit.cost.compiled.hlo import traffic_from_hlo

    (t,) = traffic_from_hlo(TPU_REDUCE_SCATTER, {"data": 2, "fsdp": 2, "tensor": 2})
    assert (t.kind, t.axes, t.count) == ("reduce-scatter", ("data", "fsdp"), 1)
    assert t.bytes == 256 * 2048 * 2 and t.operand_bytes == 1024 * 2048 * 2  # the shard; the bytes reduced


# XLA:TPU's gradient reduction over every chip of a v5p 2x2x2 slice (data=4,fsdp=2): a true
# all-reduce and a slice, no all-reduce-scatter fusion (BENCHMARKS.md, issue 36).
TPU_WHOLE_SLICE = """HloModule m

%add (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %a = bf16[] add(%x, %y)
}

%fused_computation (param_0: bf16[1024,1024], param_1: u32[]) -> bf16[128,1024] {
  %param_0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = u32[] parameter(1)
  %constant.10 = u32[] constant(0)
  ROOT %dynamic-slice.3 = bf16[128,1024]{1,0:T(8,128)(2,1)} dynamic-slice(%param_0, %param_1, %constant.10), dynamic_slice_sizes={128,1024}
}

ENTRY %main (g: bf16[1024,1024], i: u32[]) -> bf16[128,1024] {
  %g = bf16[1024,1024]{1,0} parameter(0)
  %i = u32[] parameter(1)
  %all-reduce.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} all-reduce(%g), channel_id=2, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add
  ROOT %constant_dynamic-slice_fusion = bf16[128,1024]{1,0:T(8,128)(2,1)} fusion(%all-reduce.1, %i), kind=kLoop, calls=%fused_computation
}
"""


def test_xla_tpus_whole_slice_all_reduce_is_timed_as_an_all_reduce():
    """Where XLA:TPU all-reduces and slices a gradient the model reduce-scatters (a group
    spanning every chip of a 3-D slice), the step time counts it as the all-reduce it is: the
    same bytes reduced, twice the ring's bandwidth time; its reduce-scatter fusion stays one."""
    from shardkit.cost.analytic.steptime import efficiency_for, times
    from shardkit.cost.compiled.hlo import traffic_from_hlo
    from shardkit.cost.compiled.report import Report
    from shardkit.cost.terms import Layout

    shape = {"data": 4, "fsdp": 2}
    reports = {hlo: Report("", {}, [], 0.0, traffic=traffic_from_hlo(hlo, shape), data_axes=("data", "fsdp"))
               for hlo in (TPU_WHOLE_SLICE, TPU_REDUCE_SCATTER)}
    whole, fused = reports[TPU_WHOLE_SLICE], reports[TPU_REDUCE_SCATTER]
    assert [(t.kind, t.axes) for t in whole.traffic] == [("all-reduce", ("data", "fsdp"))]
    assert whole.all_reduced() == {"grad-reduce": 1.0} and fused.all_reduced() == {"grad-reduce": 0.0}
    hw, layout = sk.cost.hardware.lookup("tpu-v5p"), Layout(data=4, fsdp=2, zero=2)
    roles, counts = whole.roles(), whole.role_counts()
    assert roles["grad-reduce"] == 1024 * 1024 * 2
    rs = times(roles, counts, 0.0, hw, layout)["grad-reduce"]
    ar = times(roles, counts, 0.0, hw, layout, all_reduced=whole.all_reduced())["grad-reduce"]
    ops = 2 * efficiency_for(hw).latency  # the model's two stages (fsdp, then data), each an op
    assert ar - ops == pytest.approx(2 * (rs - ops))


def test_a_permute_is_a_gradient_reduction_only_when_it_carries_a_data_reduced_value():
    """A collective-permute whose operand is a reduction over a data axis (traced through data
    movement) is read as part of that reduction (``grad-reduce``: XLA reducing a gradient in
    another layout than ZeRO's shard, then carrying each block to its owner, issue 36); one that
    sends a computed value (a pipeline's microbatch, a context ring's K/V) or a tensor-reduced
    one is not."""
    from jax.sharding import PartitionSpec as P

    from shardkit.cost.compiled.hlo import traffic_from_hlo
    from shardkit.cost.compiled.report import Report

    mesh, swap = sk.make_mesh("data=2,tensor=4"), [(0, 1), (1, 0)]

    def body(x):
        sent = jax.lax.ppermute(jnp.sin(x), "data", swap)
        reduced = jax.lax.ppermute(jax.lax.psum(x * 3, "data"), "data", swap)
        tensor_reduced = jax.lax.ppermute(jax.lax.psum(x * 5, "tensor"), "data", swap)
        return sent, reduced, tensor_reduced

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data", "tensor")))
    traffic = traffic_from_hlo(f.lower(jnp.ones((8, 16))).compile().as_text(), dict(mesh.shape))
    roles = Report("", {}, [], 0.0, traffic=traffic, data_axes=("data",)).roles()
    block = 4 * 4 * 4  # one device's (4, 4) f32 block
    assert roles["grad-reduce"] == 2 * block, traffic  # the psum over data, and the permute carrying its result
    assert roles["other"] == 2 * block  # the computed value's send, the tensor-reduced value's
    permutes = sorted((t.after, t.after_axes) for t in traffic if t.kind == "collective-permute")
    assert permutes == [("", ()), ("all-reduce", ("data",)), ("all-reduce", ("tensor",))], traffic


def test_explain_a_data_parallel_step():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())])
    step = sk.train_step(plan, optax.sgd(0.1))(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2))
    state = step.init({"w": jnp.ones((64, 32))})
    report = step.explain(state, {"x": np.ones((16, 64), np.float32)})
    reduced = sum(c.bytes for c in report.collectives if c.kind in ("all-reduce", "reduce-scatter"))
    assert reduced >= 64 * 32 * 4  # the f32 gradient is reduced across the 8 replicas
    assert report.memory["params"] == 64 * 32 * 4 and report.memory["batch"] == 2 * 64 * 4
    assert report.memory["peak"] > 0 and report.flops > 0
    text = str(report)
    assert "per-device memory" in text and "all-reduce" in text
    assert "<table" in report._repr_html_() or "<pre" in report._repr_html_()


def test_async_reduce_scatter_counts_its_shard_not_its_operand():
    """XLA:GPU's async reduce-scatter returns ((operand), result): the bytes are the result's
    (the shard), the bytes reduced the operand's — not the operand times the group."""
    from shardkit.cost.compiled.hlo import collectives_from_hlo, traffic_from_hlo

    hlo = """ENTRY %main (p: f32[1024,1024]) -> f32[128,1024] {
  %p = f32[1024,1024]{1,0} parameter(0)
  %reduce-scatter-start = ((f32[1024,1024]{1,0}), f32[128,1024]{1,0}) reduce-scatter-start(%p), channel_id=3, replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, dimensions={0}, to_apply=%add
  ROOT %reduce-scatter-done = f32[128,1024]{1,0} reduce-scatter-done(%reduce-scatter-start)
}"""
    assert [(c.kind, c.bytes) for c in collectives_from_hlo(hlo)] == [("reduce-scatter", 128 * 1024 * 4)]
    (t,) = traffic_from_hlo(hlo, {"d": 8})
    assert (t.bytes, t.operand_bytes) == (128 * 1024 * 4, 1024 * 1024 * 4)


def test_a_loop_without_known_trip_count_runs_to_its_condition_bound():
    """XLA:TPU writes no known_trip_count: a scan's loop runs while i < N, and its body's
    collectives count N times (they counted once, under-reading every TPU program)."""
    from shardkit.cost.compiled.hlo import collectives_from_hlo

    hlo = """%cond (p: (s32[], f32[8])) -> pred[] {
  %c = s32[]{:T(128)} constant(4)
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}

%body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%q), index=1
  %ar = f32[8]{0:T(128)} all-reduce(%x), channel_id=1, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[8]) tuple(%i, %ar)
}

ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = (s32[], f32[8]) parameter(0)
  ROOT %w = (s32[], f32[8]) while(%a), condition=%cond, body=%body
}"""
    (c,) = collectives_from_hlo(hlo)
    assert (c.kind, c.count, c.static_count, c.bytes) == ("all-reduce", 4, 1, 4 * 8 * 4)


FP8_HLO = """ENTRY %main (x: bf16[8,16,16,32], w: bf16[3,3,32,64], a: f8e4m3fn[16,32], b: f8e4m3fn[32,8], c: bf16[16,32], d: bf16[32,8]) -> f32[16,8] {
  %x = bf16[8,16,16,32]{3,2,1,0} parameter(0)
  %w = bf16[3,3,32,64]{3,2,1,0} parameter(1)
  %conv = bf16[8,16,16,64]{3,2,1,0} convolution(%x, %w), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f
  %a = f8e4m3fn[16,32]{1,0} parameter(2)
  %b = f8e4m3fn[32,8]{1,0} parameter(3)
  %fp8 = f32[16,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %c = bf16[16,32]{1,0} parameter(4)
  %d = bf16[32,8]{1,0} parameter(5)
  %tpu = f32[16,8]{1,0} convolution(%c, %d), dim_labels=bf_io->bf
  %mixed = f32[16,8]{1,0} dot(f8e4m3fn[16,32]{1,0} %a, bf16[32,8]{1,0} %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %r = f32[16,8]{1,0} add(%fp8, %tpu)
}"""


def test_fp8_flops_count_only_ops_whose_operands_are_fp8():
    """A bf16 convolution (and XLA:TPU's bf16 dot, written as a convolution) was counted as an
    fp8 GEMM: ``fp8_only`` applied to dot lines only, so a bf16 conv step read "100% in fp8
    GEMMs" and was timed at the fp8 peak. Only the dot of two fp8 operands is one."""
    from shardkit.cost.compiled.hlo import matmul_flops_from_hlo

    conv, gemm = 2 * (8 * 16 * 16 * 64) * 9 * 32, 2 * 16 * 8 * 32
    assert matmul_flops_from_hlo(FP8_HLO) == conv + 3 * gemm  # the fp8, TPU-style and mixed GEMMs
    assert matmul_flops_from_hlo(FP8_HLO, fp8_only=True) == gemm


def test_a_compiled_convolution_step_has_no_fp8_flops():
    from shardkit.cost.compiled.executable import report_from_compiled

    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(y ** 2)
    w, x = jnp.ones((3, 3, 4, 8), jnp.bfloat16), jnp.ones((2, 8, 8, 4), jnp.bfloat16)
    report = report_from_compiled(jax.jit(jax.grad(loss)).lower(w, x).compile(), "conv")
    assert report.matmul_flops >= 2 * 2 * (2 * 8 * 8 * 8) * 9 * 4  # forward and filter gradient
    assert report.fp8_matmul_flops == 0 and "fp8" not in str(report)


def _readme_step(rows: int):
    """The README's "Using it" step (its mesh, rules and loss) and a batch of ``rows`` rows."""
    plan = sk.Plan(sk.make_mesh("data=2,fsdp=2,tensor=2"),
                   rules=sk.PathRules([(r"w1", ("fsdp", "tensor")), (r"w2", ("tensor", "fsdp")), (r".*", ())]),
                   axis_rules=sk.AxisRules({"batch": ("data", "fsdp"), "mlp": "tensor"}), zero=3, precision="bf16")

    @sk.train_step(plan, optax.adamw(3e-4), microbatches=4, clip_norm=1.0)
    def step(params, batch):
        x = sk.constrain(batch["x"], ("batch", None))
        h = jax.nn.gelu(sk.constrain(x @ params["w1"], ("batch", "mlp")))
        return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)

    state = step.abstract_state(lambda: {"w1": jnp.zeros((512, 2048)), "w2": jnp.zeros((2048, 512))})
    batch = {k: jax.ShapeDtypeStruct((rows, 512), np.float32) for k in ("x", "y")}
    return step, state, batch


def test_a_matmul_xla_rewrote_is_said_not_read_as_zero_flops():
    """One batch row per device: XLA rewrites the matmul as multiply + reduce, which the
    flop count cannot read. The report says so and prints no ratio (it printed ``nan``)."""
    from shardkit.cost.compiled.executable import report_from_compiled

    f = jax.jit(jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w))))
    one, many = (report_from_compiled(f.lower(jnp.ones((512, 256)), jnp.ones((n, 512))).compile(), "t")
                 for n in (1, 16))
    assert one.unread_matmuls >= 1 and many.unread_matmuls == 0 and many.matmul_flops == 2 * 2 * 16 * 512 * 256
    one.estimate = {"flops": 2 * 2 * 512 * 256.0}
    (row,) = [r for r in one.comparison() if r["quantity"] == "flops"]
    assert row["caveat"].startswith("compiled figure incomplete: XLA rewrote matmuls")
    text = one.render(width=250)
    assert "multiply + reduce" in text and not re.search(r"\bnan\b", text)
    assert [line.split("│")[4].strip() for line in text.splitlines() if line.startswith("│ flops")] == ["-"]
    # A dot's scalar index arithmetic (XLA:CPU's ZeRO-3 loops) carries its name too: not a matmul.
    from shardkit.cost.compiled.hlo import rewritten_matmuls

    index = 'ENTRY %m (a: s32[]) -> s32[] {\n  ROOT %i = s32[] multiply(%a, %a), metadata={op_name="jit(f)/dot_general"}\n}'
    assert rewritten_matmuls(index) == 0 and rewritten_matmuls(index.replace("s32[]", "f32[4,8]")) == 1


@pytest.mark.targets
def test_the_readme_step_on_128_h100s_says_why_its_flops_read_zero():
    """The README's step with its 64-row batch on data=8,fsdp=2,tensor=8 (128 H100s): one row
    per device per microbatch, every matmul rewritten; with 1,024 rows they stay dots."""
    pytest.importorskip("jax_cuda12_plugin")
    # Both batches in one subprocess (one start of JAX and XLA:GPU), with the estimate beside, as
    # step.explain(mesh=, target=) gives it (that call: test_targets_gpu.py, test_cost_bands.py).
    mesh = "data=8,fsdp=2,tensor=8"
    report, big = sk.cost.simulate_many([(*_readme_step(rows), mesh) for rows in (64, 1024)], target="h100",
                                        estimate=True)
    for r in (report, big):
        if isinstance(r, Exception):
            raise r
    assert report.matmul_flops == 0 and report.unread_matmuls > 0
    text = " ".join(report.render(width=250).split())
    assert not re.search(r"\bnan\b", text) and "compiled figure incomplete" in text and "one batch row per device" in text
    assert big.unread_matmuls == 0 and big.matmul_flops == 5 * 2 * 64 * 512 * 256  # 5 GEMMs, 64 rows per device


def test_a_gpu_count_no_host_layout_has_is_a_target_error_before_compiling(monkeypatch):
    from shardkit.cost.compiled import simulated

    monkeypatch.setattr(simulated, "run_child", lambda *a, **k: pytest.fail("compiled a mesh of 12 H100s"))
    step, state, batch = _readme_step(48)
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())])
    step = step.with_plan(plan)
    with pytest.raises(sk.cost.TargetError, match="12 GPUs do not fill hosts of 8") as err:
        step.explain(state, batch, mesh="data=12", target="h100")
    assert "Traceback" not in str(err.value)
    # A TargetError the compiling child raises comes back as one, without the child's traceback.
    from shardkit.cost.compiled.child import compile_error

    e = compile_error({"error": "h100: 12 GPUs do not fill hosts of 8", "target_error": True})
    assert isinstance(e, sk.cost.TargetError) and str(e) == "h100: 12 GPUs do not fill hosts of 8"


def test_a_caveat_shared_by_several_rows_prints_once_and_a_band_that_bounds_nothing_is_not_printed(monkeypatch):
    from shardkit.cost.compiled import bands
    from shardkit.cost.compiled.report import Report

    monkeypatch.setitem(bands.BANDS, "h100", {"collective/tensor-reduce": (-0.999, -0.0, 14, 7)})
    monkeypatch.setitem(bands.HELD_OUT, "h100", {"collective/tensor-reduce": (-0.0, -0.0, 2, 1)})
    why = "not modelled: some ZeRO-3/FSDP-sharded weights are larger than the activations they multiply"
    r = Report("t", {"peak": 100, "temporaries": 50}, [], 0.0, target="h100",
               estimate={"memory/peak": 90.0, "memory/temporaries": 40.0, "collective/tensor-reduce": 4.0},
               caveats={"memory/peak": why, "memory/temporaries": why})
    text = r.render(width=250)
    assert text.count("some ZeRO-3/FSDP-sharded weights") == 1
    assert "memory/peak, memory/temporaries: not modelled" in text or "memory/temporaries, memory/peak" in text
    assert "-100%" not in text.split("collective/tensor-reduce: ")[0] and "-0%" not in text
    assert "collective/tensor-reduce: no band: estimate / compiled - 1 measured -100%..0%" in text
    assert "bounds nothing" in text


def test_a_report_renders_once_in_a_notebook_with_plain_text(monkeypatch):
    """Notebooks 03/04 showed each report twice (rich displayed what ``render`` recorded) and
    the text/plain was the dataclass's fields, or ANSI codes."""
    import rich.console
    import rich.jupyter

    shown = []
    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)  # as inside a kernel
    monkeypatch.setattr(rich.jupyter, "display", lambda *a, **k: shown.append(a))
    from shardkit.cost.compiled.report import Report

    r = Report("a title", {"peak": 100}, [], 0.0)
    html = r._repr_html_()
    printed = []
    r._repr_pretty_(type("P", (), {"text": lambda self, t: printed.append(t)})(), False)
    assert not shown and "a title" in html
    assert printed == [r.render()] and "\x1b[" not in printed[0] and "per-device memory" in printed[0]


@pytest.mark.parametrize("two_auto_axes", [True, False])
def test_a_collective_a_stage_can_skip_inside_the_pipeline_switch_is_a_hang_risk(two_auto_axes):
    """Issue 37: docs/upstream/xla_partitioner_two_auto_axes.py's program (a per-tick switch by
    stage, manual over pipe, the weights split over an auto axis) compiled, not run: with two
    auto axes XLA reshards inside the branches with permutes naming every device, which the
    stages on another branch never reach (it hangs when run); with one, the branches' tensor
    sums stay inside a stage. ``Report.hang_risks`` (the target sweeps' check) tells them apart."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardkit.cost.compiled.branches import branch_collectives
    from shardkit.cost.compiled.report import Report
    from shardkit.pipeline.schedules import EXPLICIT_SCOPE

    mesh = sk.make_mesh("pipe=2,context=2,tensor=2" if two_auto_axes else "pipe=2,tensor=4")
    table = jnp.array([[1, 0], [1, 1], [0, 2], [0, 1], [2, 2], [2, 0]], jnp.int32)  # idle 0, F 1, BW 2
    stage = lambda w, h: jnp.tanh(h @ w)  # noqa: E731

    def body(w, x):
        w, i = w[0], jax.lax.axis_index("pipe")
        branches = [lambda h, g, acc: (jnp.zeros_like(h), jnp.zeros_like(g), acc),
                    lambda h, g, acc: (stage(w, h), jnp.zeros_like(g), acc),
                    lambda h, g, acc: (jnp.zeros_like(h), *(lambda dw, dh: (dh, acc + dw))(
                        *jax.vjp(stage, w, h)[1](g)))]

        def tick(carry, row):
            with jax.named_scope(EXPLICIT_SCOPE):
                down, up, acc = jax.lax.switch(row[i], branches, *carry)
            return (jax.lax.ppermute(down, "pipe", [(0, 1)]), jax.lax.ppermute(up, "pipe", [(1, 0)]), acc), None

        return jax.lax.scan(tick, (x, x, jnp.zeros_like(w)), table)[0][2][None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("pipe"), P()), out_specs=P("pipe"),
                              axis_names={"pipe"}, check_vma=False))
    w = jax.ShapeDtypeStruct((2, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P("pipe", None, "tensor")))
    found = branch_collectives(f.lower(w, jax.ShapeDtypeStruct((16, 64), jnp.float32)).compile().as_text(),
                               dict(mesh.shape))
    risks = Report("", {}, [], 0.0, pipe_axis="pipe", branch_collectives=found).hang_risks()
    assert found and all(c.pipeline_switch for c in found), found  # the reader sees into the branches
    if two_auto_axes:
        assert {c.kind for c in risks} == {"collective-permute"} and all("pipe" in c.axes for c in risks), risks
        assert "collective-permute over pipe" in str(risks[0]) and "branch " in str(risks[0])
    else:
        assert not risks and {c.axes for c in found} == {("tensor",)}, found
    # Outside the pipeline's switch the reader cannot tell who takes which branch: all are risks.
    assert Report("", {}, [], 0.0, branch_collectives=found).hang_risks() == found
