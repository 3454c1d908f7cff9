"""The step-time roofline (``steptime.roofline_excess``): each kernel takes the longer of its
flops at the achievable matmul rate and its bytes at the HBM bandwidth. Its kernels come from
two readings, both held here on small programs: the compiled program's text
(``compiled.kernels``) and the traced pass (``program.kernel_traffic``)."""

import jax
import jax.numpy as jnp
import pytest

from shardkit.cost import hardware
from shardkit.cost.analytic import steptime
from shardkit.cost.compiled.kernels import kernels_from_hlo
from shardkit.cost.program.reader import read_program

H100 = hardware.lookup("h100")
RATE = H100.peak_flops * steptime.efficiency_for(H100).matmul


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_an_elementwise_program_is_timed_by_its_bytes_and_a_matmul_by_its_flops():
    n = 1 << 20
    x = jax.ShapeDtypeStruct((n,), jnp.float32)
    # Three elementwise ops fuse into one kernel: it reads x once and writes the result once.
    ew = kernels_from_hlo(_hlo(lambda x: jnp.tanh(x * 2.0 + 1.0), x))
    assert sum(b * c for _, b, c in ((k.flops, k.bytes, k.count) for k in ew)) == 2 * 4 * n
    assert all(k.flops == 0 for k in ew)
    seconds = steptime.roofline_excess([(k.flops, k.bytes, k.count) for k in ew], H100)
    assert seconds == pytest.approx(2 * 4 * n / H100.hbm_bandwidth)

    m = 2048
    a = jax.ShapeDtypeStruct((m, m), jnp.bfloat16)
    mm = [k for k in kernels_from_hlo(_hlo(lambda a, b: a @ b, a, a)) if k.flops]
    assert [k.flops for k in mm] == [2.0 * m**3]
    assert mm[0].bytes >= 3 * m * m * 2  # two operands read, the product written
    # Compute-bound: the roofline adds nothing to its flops' time ...
    assert steptime.roofline_excess([(k.flops, k.bytes, k.count) for k in mm], H100) == 0.0
    # ... and a memory-bound kernel's flops do not hide its bytes.
    assert steptime.roofline_excess([(1e9, 1e9, 2.0)], H100) == pytest.approx(2 * (1e9 / H100.hbm_bandwidth - 1e9 / RATE))


def test_a_layer_scan_reads_one_layer_of_its_stack_per_iteration():
    layers, n = 8, 1 << 16
    w = jax.ShapeDtypeStruct((layers, n), jnp.float32)
    x = jax.ShapeDtypeStruct((n,), jnp.float32)

    def f(w, x):
        def body(h, w_l):
            h = jnp.tanh(h * w_l)
            return h, h
        return jax.lax.scan(body, x, w)

    kernels = kernels_from_hlo(_hlo(f, w, x))
    moved = sum(k.bytes * k.count for k in kernels)
    # Per iteration a layer's weights, the carry and the stacked output's slice: of the order of
    # 4 · n bytes each, never the whole (layers, n) stack per iteration.
    assert 3 * 4 * n * layers <= moved < 8 * 4 * n * layers
    assert max(k.count for k in kernels) == layers


def test_the_traced_pass_fuses_elementwise_chains_into_one_kernel_each():
    n = 1 << 16
    w = jax.ShapeDtypeStruct((n,), jnp.float32)
    x = jax.ShapeDtypeStruct((n,), jnp.float32)
    reading = read_program(lambda w, x: jnp.sum(jax.nn.relu(x * w + 1.0) ** 2), w, x,
                           split_of=lambda aval, leaf, manual=frozenset(): (1, 1), n_params=1)
    moved = sum(b * c for _, b, c in reading.kernels)
    # Forward: one reduction reading x and w. Backward: the gradient in w, one kernel reading
    # x and w and writing n floats. Unfused, the jaxpr's ~10 elementwise ops would each move
    # 8-12 bytes per element.
    assert 3 * 4 * n <= moved <= 6 * 4 * n
    assert all(f == 0 for f, _, _ in reading.kernels)
    seconds = steptime.roofline_excess(reading.kernels, H100)
    assert seconds == pytest.approx(moved / H100.hbm_bandwidth)


def test_a_steps_estimate_times_its_normalisation_passes_by_their_bytes():
    """A step whose activations are normalised (a BatchNorm-like pass) before a small matmul:
    ``explain()``'s estimate times the passes over the activations by their bytes (it timed the
    step by its matmul flops alone before, 3.2x under ResNet-50's measured step)."""
    import numpy as np
    import optax

    import shardkit as sk

    rows, d = 4096, 256
    plan = sk.Plan(sk.make_mesh("data=1", devices=jax.devices()[:1]), rules=[(r".*", ())])

    def loss(p, b):
        x = b["x"]
        mean, var = x.mean(0, keepdims=True), x.var(0, keepdims=True)
        h = jax.nn.relu((x - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"][None, :])
        return jnp.mean((h @ p["w"]) ** 2)

    step = sk.train_step(plan, optax.sgd(0.1))(loss)
    state = step.init({"g": jnp.ones((d,)), "w": jnp.ones((d, 8)) * 0.01})
    est = sk.cost.estimate_for_step(step, state, {"x": np.ones((rows, d), np.float32)}, hardware="h100")
    activations = rows * d * 4
    # Statistics, normalisation and its gradient each read the activations at least once.
    assert est.time["memory-bound"] >= 3 * activations / H100.hbm_bandwidth
    flops_time = est.flops / RATE
    assert est.time["compute"] == pytest.approx(flops_time + est.time["memory-bound"])


def test_a_fusion_that_slices_a_bitcast_of_its_operand_reads_the_slice():
    # XLA:GPU slices a layer of a stacked weight through a bitcast to another layout (the fp8
    # 7B's quantisation fusions): the slice is read, not the stack (10x the bytes before).
    hlo = """HloModule m

%fused_ds (param_0: bf16[32,64,128], param_1: s32[]) -> bf16[64,1,128] {
  %param_0 = bf16[32,64,128]{2,1,0} parameter(0)
  %bitcast.1 = bf16[64,32,128]{2,1,0} bitcast(%param_0)
  %param_1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = bf16[64,1,128]{2,1,0} dynamic-slice(%bitcast.1, %c, %param_1, %c), dynamic_slice_sizes={64,1,128}
}

ENTRY %main (p0: bf16[32,64,128], p1: s32[]) -> bf16[64,1,128] {
  %p0 = bf16[32,64,128]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %f = bf16[64,1,128]{2,1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_ds
}
"""
    (kernel,) = kernels_from_hlo(hlo)
    layer = 64 * 128 * 2
    assert kernel.bytes == layer + 4 + layer  # the slice and the index read, the slice written
