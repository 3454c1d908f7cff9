"""The cost model on ``sk.moe``'s dropless dispatch (``_moe_ragged``: ragged-all-to-alls and
grouped matmuls on GPU and TPU targets): the compiled program's and the jaxpr's collectives
by their routed rows, as ``expert-all-to-all``; the grouped matmuls' flops; the ``ModelShape``
estimate's routed-row traffic. What XLA:GPU and XLA:TPU compile of the whole recipe is checked
by ``tests/target_sweep.py``'s ``ep`` case (``sk.cost.simulate_many(..., estimate=True)``)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import shardkit as sk
from shardkit.cost.analytic.caveats import step_caveats
from shardkit.cost.compiled.hlo import traffic_from_hlo
from shardkit.cost.program.explicit import TPU_ROW_BYTES
from shardkit.cost.program.reader import read_program
from shardkit.cost.program.walk import grouped_kernel

# One ragged-all-to-all of sk.moe's dispatch (64 routed rows of d_model 32 into a 256-row
# receive buffer) and of its combine (back home), as the compilers print them (8 devices,
# backend configs cut): XLA:GPU's async start lists ((rows, output, 4 offset arrays), result);
# XLA:TPU's sync op names its operands (and pads the rows to its lanes: 32 -> (2, 128)).
H100 = """ENTRY %main (p: bf16[64,32]) -> bf16[64,32] {
  %ragged-all-to-all-start = ((bf16[64,32]{1,0}, bf16[256,32]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, /*index=5*/s64[8]{0}), bf16[256,32]{1,0}) ragged-all-to-all-start(%bitcast.14.0, %get-tuple-element.107, %get-tuple-element.82, %get-tuple-element.84, %wrapped_convert, /*index=5*/%get-tuple-element.81), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, backend_config={"operation_queue_id":"0"}
  %ragged-all-to-all-done = bf16[256,32]{1,0} ragged-all-to-all-done(%ragged-all-to-all-start)
  %ragged-all-to-all-start.1 = ((bf16[256,32]{1,0}, bf16[64,32]{1,0}, s64[8]{0}, s64[8]{0}, s64[8]{0}, /*index=5*/s64[8]{0}), bf16[64,32]{1,0}) ragged-all-to-all-start(%input_scatter_fusion.4, %get-tuple-element.103, %get-tuple-element.77, %get-tuple-element.81, %wrapped_convert.1, /*index=5*/%get-tuple-element.84), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, backend_config={"operation_queue_id":"0"}
  ROOT %ragged-all-to-all-done.1 = bf16[64,32]{1,0} ragged-all-to-all-done(%ragged-all-to-all-start.1)
}
"""
TPU = """ENTRY %main (p: bf16[64,2,128]) -> bf16[64,2,128] {
  %copy-done.11 = bf16[64,2,128]{2,1,0:T(2,128)(2,1)S(1)} copy-done(%copy-start.11)
  %ragged_all_to_all.68 = bf16[256,2,128]{2,1,0:T(2,128)(2,1)} ragged-all-to-all(%copy-done.11, %copy.135, %copy-done.37, %scatter_offload_async_done, %reduce.9, /*index=5*/%copy-done.24), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, metadata={op_name="jit(loss)/jvp()/shard_map/ragged_all_to_all" stack_frame_id=25}
  %copy-done.6 = bf16[256,2,128]{2,1,0:T(2,128)(2,1)S(1)} copy-done(%copy-start.6)
  ROOT %ragged_all_to_all.89 = bf16[64,2,128]{2,1,0:T(2,128)(2,1)} ragged-all-to-all(%copy-done.6, %copy.137, %reduce.14, %copy-done.24, %reduce.11, /*index=5*/%scatter_offload_async_done), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}
}
"""


@pytest.mark.parametrize("hlo,row", [(H100, 32 * 2), (TPU, 2 * 128 * 2)], ids=["h100", "tpu-v5p"])
def test_compiled_ragged_all_to_alls_count_their_routed_rows_as_expert_all_to_all(hlo, row):
    """Each op by the 64 rows on its routed side, not the 256-row receive buffer (nor, on
    XLA:GPU, the whole operand tuple), and in the ``expert-all-to-all`` role, not "other"."""
    [t] = traffic_from_hlo(hlo, {"expert": 8})
    assert (t.kind, t.axes, t.count) == ("ragged-all-to-all", ("expert",), 2)
    assert t.bytes == 2 * 64 * row
    roles = sk.Report("moe", {}, [], 0.0, traffic=[t]).roles()
    assert roles["expert-all-to-all"] == t.bytes and roles["other"] == 0


def test_compiled_flops_count_xla_tpu_grouped_ragged_dots():
    """XLA:TPU's ragged_dot forward, a Mosaic grouped matmul (custom call) of 256 buffer rows
    of 32 features into 64 (one local expert), at the flops its cost estimate states; the group
    bookkeeping call is no matmul."""
    from shardkit.cost.compiled.hlo import matmul_flops_from_hlo

    M, K, N = 256, 32, 64
    hlo = f"""ENTRY %main (p: bf16[{M},{K}]) -> bf16[{M},{N}] {{
  %ragged-dot-metadata = (s32[2]{{0:T(128)}}, s32[1]{{0:T(128)}}) custom-call(%bitcast.4), custom_call_target="tpu_custom_call", metadata={{op_name="ragged-dot-metadata"}}, backend_config={{"custom_call_config":{{"cost_estimate":{{"flops":"0","transcendentals":"0"}}}}}}
  ROOT %ragged-dot-none.2 = bf16[{M},{N}]{{1,0:T(8,128)(2,1)}} custom-call(%a, %b, %c, %d, %e, /*index=5*/%x, %w), custom_call_target="tpu_custom_call", operand_layout_constraints={{s32[1]{{0}}, bf16[{M},{K}]{{1,0}}, bf16[1,{K},{N}]{{2,1,0}}}}, backend_config={{"custom_call_config":{{"body":"bW9k","cost_estimate":{{"flops":"{2 * M * K * N}","transcendentals":"0"}}}}}}
}}
"""
    assert matmul_flops_from_hlo(hlo) == 2 * M * K * N
    assert matmul_flops_from_hlo(hlo, fp8_only=True) == 0


def _dispatch_loss(mesh, M):
    """A device's rows out to the experts' devices into an ``M``-row buffer (sk.moe's ragged
    exchange, offsets fixed), through a grouped matmul, summed; the rows are parameters so
    that the backward brings their gradient home by the transposed exchange."""
    n = mesh.shape["expert"]

    def body(x_AxD, w_GxDxF):
        A, G = x_AxD.shape[0], w_GxDxF.shape[0]
        per = jnp.full((n,), A // n, jnp.int32)
        offsets = jnp.arange(n, dtype=jnp.int32) * (A // n)
        buf = lax.ragged_all_to_all(x_AxD, jnp.zeros((M, x_AxD.shape[1]), x_AxD.dtype), offsets, per,
                                    offsets, per, axis_name="expert")
        y = lax.ragged_dot(buf, w_GxDxF, jnp.full((G,), M // G, jnp.int32))
        return jax.lax.psum(jnp.sum(y), "expert")

    def loss(params, batch):
        return jax.shard_map(body, mesh=mesh, in_specs=(jax.P("expert"), jax.P("expert")), out_specs=jax.P(),
                             check_vma=False)(params["x"], params["w"]) * batch

    return loss


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "tpu"])
def test_the_reader_counts_routed_rows_and_ragged_dot_flops(grouped):
    """The jaxpr's ragged-all-to-alls (the dispatch, and its transpose in the backward) by their
    routed rows; ``lax.ragged_dot`` at the dense product XLA:CPU and XLA:GPU run, forward, input
    and weight gradients (``2·G·M·D·F`` each), or as XLA:TPU runs it: forward and input gradient
    grouped (``2·M·D·F``), the weight gradient dense;
    XLA:TPU sends the rows padded to whole 128-lane tile rows, 512 bytes (an 8-wide f32 row as
    128; read in a v5p compile of sk.moe: a ``pad`` before the exchange)."""
    mesh = sk.make_mesh("expert=8")
    A, M, D, F, G = 16, 64, 8, 4, 2  # per device: 16 routed rows, a 64-row buffer, 2 experts
    params = {"w": jax.ShapeDtypeStruct((8 * G, D, F), jnp.float32), "x": jax.ShapeDtypeStruct((8 * A, D), jnp.float32)}
    row = TPU_ROW_BYTES if grouped else 1
    reading = read_program(_dispatch_loss(mesh, M), params, jax.ShapeDtypeStruct((), jnp.float32),
                           split_of=lambda aval, leaf, manual=(): (1, 1), n_params=2, grouped_ragged_dots=grouped,
                           ragged_row_bytes=row)
    n, nbytes = reading.explicit[("all-to-all", ("expert",))]
    # Two ragged exchanges of the 16 rows each (not the 64-row buffer), and the transpose's two
    # all_to_alls of the 8 peers' int32 offsets.
    assert (n, nbytes) == (4, 2 * A * max(D * 4, row) + 2 * 8 * 4)
    assert reading.total_flops == (2 if grouped else 2 * G) * (2 * M * D * F) + 2 * G * M * D * F
    # The comparison says the bytes are a bound (the rows that carry a token are data-dependent).
    caveats = step_caveats(reading, [False, False], [False, False], piped=False, moe=True)
    assert caveats["collective/expert-all-to-all"].startswith("a bound: sk.moe's dropless ragged-all-to-alls")
    assert "kernel" not in reading.unseen


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "tpu"])
def test_a_ragged_dot_run_densely_holds_its_masked_row_copies(grouped):
    """``lax.ragged_dot`` as XLA:CPU and XLA:GPU run it (and XLA:TPU its weights' gradient) reads
    its rows as ``G`` masked copies ``(G, M, K)``: at the weights' gradient the rows' copy (made
    once, for the forward too) and the cotangent's (shared with the input gradient) are alive
    beside the cotangent and the gradient. Which copies XLA keeps for the backward is its
    fusion's choice: the memory rows say so instead of a number."""
    M, K, N, G = 256, 32, 32, 8

    def loss(p, b):
        return jnp.sum(lax.ragged_dot(p["x"], p["w"], jnp.full((G,), M // G, jnp.int32))) * b

    params = {"w": jax.ShapeDtypeStruct((G, K, N), jnp.float32), "x": jax.ShapeDtypeStruct((M, K), jnp.float32)}
    reading = read_program(loss, params, jax.ShapeDtypeStruct((), jnp.float32),
                           split_of=lambda aval, leaf, manual=(): (1, 1), n_params=2, grouped_ragged_dots=grouped)
    masked = 4 * G * M * (K + N)  # f32: the rows' and the cotangent's masked copies
    alive = 4 * (M * N + G * K * N)  # the cotangent, read by both backward dots; the weights' gradient
    assert 0 <= reading.peak - (masked + alive) < 64  # and a few f32 scalars (the loss, its seed)
    caveats = step_caveats(reading, [False, False], [False, False], piped=False, moe=True)
    assert caveats["memory/peak"].startswith(f"not modelled: lax.ragged_dot run as a dense product over {G} groups")


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_grouped_matmul_kernels_are_named_and_their_flops_counted(platform, monkeypatch):
    """Megablox's gmm/tgmm (TPU) and Mosaic GPU's ragged_dot (GPU), traced for their targets:
    each row meets one group's weights, ``2·M·K·N`` (Megablox's own CostEstimate)."""
    from shardkit.kernels import grouped

    monkeypatch.setattr(grouped, "target_platform", lambda: platform)
    M, K, N, G = 256, 128, 256, 4
    bf16 = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((M, K), bf16), jax.ShapeDtypeStruct((G, K, N), bf16),
            jax.ShapeDtypeStruct((G,), jnp.int32))
    loss = lambda x, w, s: jnp.sum(grouped.grouped_matmul(x, w, s).astype(jnp.float32))  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args).jaxpr
    found = []

    def walk(j):
        for e in j.eqns:
            if (got := grouped_kernel(e)) is not None:
                found.append(got)
                if (est := e.params.get("cost_estimate")) is not None:
                    assert got[1] == est.flops, (got, est)
            else:
                for sub in jax.extend.core.jaxprs_in_params(e.params):
                    walk(getattr(sub, "jaxpr", sub))

    walk(jaxpr)
    # TPU: gmm forward and input gradient, tgmm for the weights'; GPU: ragged_dot forward and
    # input gradient (the weights' by a masked product per group in a deviceless compile).
    names = ["gmm", "gmm", "tgmm"] if platform == "tpu" else ["gmm", "gmm"]
    assert sorted(found) == [(k, 2.0 * M * K * N) for k in names]


def test_model_shape_estimate_sends_routed_rows_when_dropless():
    """Dropless with an expert axis on a GPU/TPU (the hardware table's): ``4·tokens·k·D``
    elements per MoE layer (sk.moe's ragged dispatch), not the padded ``E/k`` times that;
    with a capacity, the padded form's slots as before."""
    from shardkit.cost.analytic.roles import moe_traffic

    D, E, k, T, B, layers = 64, 16, 2, 32, 16, 4
    ms = sk.cost.ModelShape("moe", params=1e6, flops_per_token=6e6, layers=layers, layer_params=2e5, d_model=D,
                            heads=4, d_ff=128, seq=T, experts=E, top_k=k, expert_params=5e5)
    est = sk.cost.estimate(ms, sk.cost.Layout(expert=8), "h100", global_batch=B)
    tokens = B * T // 8
    routed = layers * 4 * tokens * k * D * 2  # bf16
    assert est.collectives["expert-all-to-all"] == routed
    padded = moe_traffic(tokens=tokens, d_model=D, experts=E, top_k=k, capacity_factor=None, group_size=T,
                         bytes_per_element=2, axis_size=8)
    assert padded == routed / layers * E / k
    capped = sk.cost.estimate(dataclasses.replace(ms, capacity_factor=1.0), sk.cost.Layout(expert=8), "tpu-v5p",
                              global_batch=B)
    assert capped.collectives["expert-all-to-all"] == layers * moe_traffic(
        tokens=tokens, d_model=D, experts=E, top_k=k, capacity_factor=1.0, group_size=T, bytes_per_element=2,
        axis_size=8)
    with pytest.raises(ValueError, match="ragged=True is the dropless dispatch; capacity_factor=1.0 must be None"):
        moe_traffic(tokens=tokens, d_model=D, experts=E, top_k=k, capacity_factor=1.0, group_size=T,
                    bytes_per_element=2, axis_size=8, ragged=True)
