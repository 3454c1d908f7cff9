import jax
import jax.numpy as jnp
import numpy as np
import optax

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
    from shardkit.cost.hlo import traffic_from_hlo

    (t,) = traffic_from_hlo(TPU_REDUCE_SCATTER, {"data": 2, "fsdp": 2, "tensor": 2})
    assert (t.kind, t.axes, t.count) == ("reduce-scatter", ("data", "fsdp"), 1)
    assert t.bytes == 256 * 2048 * 2 and t.operand_bytes == 1024 * 2048 * 2  # the shard; the bytes reduced


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
    from shardkit.cost.hlo import collectives_from_hlo, traffic_from_hlo

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
    from shardkit.cost.hlo import collectives_from_hlo

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
