"""The program reader on ``sk.attention``'s Pallas flash kernels (``cost.program.flash``): their
flops counted as flash attention's, no (T, T) buffer, no "not modelled" caveat — and another
Pallas kernel still flagged. Traced for H100 and v5p targets on this CPU host (no compile);
the compiled comparison is BENCHMARKS.md's ("Kernels" section)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.cost.analytic.caveats import unseen_caveats
from shardkit.cost.compiled.simulated import abstract_mesh
from shardkit.cost.program.reader import read_program
import repo_files

B, T, H, Q = 8, 1024, 4, 64  # one sequence a device over data=8; 8 kernel blocks of 128


def _read(target, fn):
    x = jax.ShapeDtypeStruct((B, T, H, Q), jnp.bfloat16)

    def split_of(aval, leaf, manual=frozenset()):  # the batch over data, unless already local
        return (8 if aval.shape and aval.shape[0] == B and "data" not in manual else 1), 1

    with jax.sharding.use_abstract_mesh(abstract_mesh("data=8", target=target)):
        return read_program(fn, (x, x, x), jax.ShapeDtypeStruct((B,), jnp.int32), split_of=split_of, n_params=3)


def _attention(implementation):
    def fn(params, batch):
        q, k, v = params
        out = sk.attention(q, k, v, causal=True, spec=P("data"), implementation=implementation)
        return jnp.sum(out.astype(jnp.float32))
    return fn


# Matmuls of 2·T·H·Q·T (one device's sequence) each: the forward's QKᵀ and PV, the backward
# recomputing QKᵀ and dO·Vᵀ then one a gradient — Triton in one call (2 + 3), Mosaic in a dK/dV
# call (2 + 2) and a dQ call (2 + 1); causal: 36 of the 8 x 8 blocks.
@pytest.mark.parametrize("target,matmuls", [("h100", 2 + 5), ("tpu-v5p", 2 + 4 + 3)])
def test_the_reader_counts_flash_kernels_as_attention(target, matmuls):
    flash, plain = _read(target, _attention("auto")), _read(target, _attention("reference"))
    assert flash.flops == pytest.approx(matmuls * 2 * T * H * Q * T * 36 / 64)
    assert flash.total_flops == pytest.approx(8 * flash.flops)  # 8 devices' shares
    # The plain form's six full T x T matmuls, read off its dots: the convention is one.
    assert plain.flops == pytest.approx(6 * 2 * T * H * Q * T)
    assert "kernel" not in flash.unseen and not unseen_caveats(flash, ("data",))
    # No (T, T) buffer: the plain form keeps f32 scores of every head (16 MiB a device here).
    scores = H * T * T * 4
    assert plain.peak > scores > flash.peak


def test_another_pallas_kernel_is_still_not_modelled():
    def double(x_ref, o_ref):
        o_ref[...] = 2 * x_ref[...]

    def fn(params, batch):
        q = jax.lax.stop_gradient(params[0][0, :8, 0, :8].astype(jnp.float32))  # no VJP: forward only
        out = pl.pallas_call(double, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype))(q)
        return jnp.sum(out) + jnp.sum(params[0].astype(jnp.float32))

    reading = _read("h100", fn)
    assert "kernel" in reading.unseen
    assert "not modelled" in unseen_caveats(reading, ("data",))["flops"]


def test_a_recipe_config_is_estimated_with_the_kernels_it_runs():
    """``sk.cost.estimate`` from a recipe ``Config``: ``attention="auto"`` runs flash on GPU and
    TPU targets (no score term in the activations), the auto ``loss_chunk`` the chunked loss
    (one chunk's logits cotangent and the f32 (V, D) accumulator, not the whole f32 logits)."""
    import dataclasses

    from models.transformer.config import SIZES
    from shardkit.cost.analytic.from_shape import loss_bytes

    cfg = SIZES["7b"]
    plain = dataclasses.replace(cfg, attention="reference", loss_chunk=0)
    ms, ms_plain = sk.cost.model_shape(cfg), sk.cost.model_shape(plain)
    assert (ms.flash_attention, ms.loss_chunk) == (True, 512)
    assert (ms_plain.flash_attention, ms_plain.loss_chunk) == (False, 0)
    lo = sk.cost.Layout(data=8, zero=3, remat="none")
    b, s, h, a, L = 1, cfg.seq, cfg.d_model, cfg.heads, cfg.layers
    assert loss_bytes(ms, lo, b, 2) == (b * 512 * 2 + h * 4) * cfg.vocab
    assert loss_bytes(ms_plain, lo, b, 2) == 2 * b * s * cfg.vocab * 4
    est, est_plain = (sk.cost.estimate(m, lo, "h100", global_batch=8) for m in (ms, ms_plain))
    # A recipe config counts activations as XLA keeps them (ModelShape.activations="xla"): the
    # reference attention keeps q, K, V, the output (8h a token here, K/V heads = heads) and its
    # (T, T) scores (2as, 16-bit); the flash kernels five h-wide tensors (10h) and no scores.
    scores = L * s * b * (2 * a * s - 2 * h)
    assert est_plain.memory["activations"] - est.memory["activations"] == pytest.approx(
        scores + loss_bytes(ms_plain, lo, b, 2) - loss_bytes(ms, lo, b, 2))


def test_the_chunked_loss_is_not_taken_for_a_recurrence():
    """``sk.chunked_cross_entropy``'s scans over token chunks (forward and backward) are one
    loss's chunks: no "recurrence" caveat (which marks memory "not modelled"), and the
    matmuls of every chunk counted: forward logits, the backward's recomputed logits and
    its two gradient products, 4 x 2·T·V·D a sequence."""
    D, V, rows, seq = 64, 512, 8, 256

    def fn(params, batch):
        return sk.chunked_cross_entropy(params[0], params[1], batch, chunk=64)

    x, w = jax.ShapeDtypeStruct((rows, seq, D), jnp.float32), jax.ShapeDtypeStruct((V, D), jnp.float32)
    reading = read_program(fn, (x, w), jax.ShapeDtypeStruct((rows, seq), jnp.int32),
                           split_of=lambda aval, leaf, manual=frozenset(): (1, 1), n_params=2)
    assert "recurrence" not in reading.unseen
    assert reading.flops == pytest.approx(4 * 2 * rows * seq * V * D)



def test_a_loops_carry_is_written_in_place():
    """A ``scan`` carry started from a buffer nothing reads after the loop (zeros: the chunked
    loss's f32 (V, D) gradient accumulator) comes out in that buffer: one buffer, not two (the
    recipe's 125M on 8 H100s at ZeRO-3 read 1198 MiB temporaries with two, 1051 with one,
    against XLA's 967.5)."""
    n = 1 << 20

    def loss(params, batch):
        acc, _ = jax.lax.scan(lambda c, x: (c + x, None), jnp.zeros((n,), jnp.float32), batch)
        return jnp.sum(acc) * params[0]

    reading = read_program(loss, (jax.ShapeDtypeStruct((), jnp.float32),), jax.ShapeDtypeStruct((8, n), jnp.float32),
                           split_of=lambda aval, leaf, manual=frozenset(): (1, 1), n_params=1)
    assert reading.peak == pytest.approx(4 * n, rel=1e-3)  # was 8n: the zeros and the final carry


def _kernel_call(name, result, operands, target, op_name):
    return (f"  %{name} = {result} custom-call({operands}), custom_call_target=\"{target}\", "
            f'metadata={{op_name="{op_name}" stack_frame_id=3}}, backend_config={{ir = "ML\\EFR sk_flash_attention_mosaic_full"}}')


def test_the_compiled_flops_read_the_flash_kernels_custom_calls():
    """``matmul_flops_from_hlo`` on the kernels' custom calls (XLA's lines, their IR cut short):
    the flops ``cost.flash_flops`` gives the reader, through a loop's trip count, by the scope
    in the op's metadata only (not the IR's text); another Triton call adds none; an operand
    it cannot size is an error, not a zero. (tests/test_kernels.py checks a compiled layer.)"""
    from shardkit.cost.compiled.hlo import HloParseError, matmul_flops_from_hlo

    x, lse = "bf16[1,1024,4,128]{3,2,1,0}", "f32[1,4,1024]{2,1,0}"
    triton, mosaic = "__gpu$xla.gpu.triton", "tpu_custom_call"
    forward = "jit(f)/jvp()/shard_map/sk_flash_attention_triton_causal/jit(mha)/mha_forward/pallas_call"
    dq = "jit(f)/transpose(jvp())/shard_map/sk_flash_attention_mosaic_full/jit(flash_attention)/dq"
    xm, f32 = "bf16[1,4,1024,128]{3,2,1,0}", "f32[1,4,1024,128]{3,2,1,0}"  # Mosaic's (B, H, T, Q)

    def hlo(entry_call):
        return "\n".join([
            "HloModule m", "",
            f"%body (p: (s32[], {x})) -> (s32[], {x}) {{",
            f"  %p = (s32[], {x}) parameter(0)",
            "  %i = s32[] get-tuple-element(%p), index=0",
            f"  %q = {x} get-tuple-element(%p), index=1",
            _kernel_call("pallas_call.1", f"({x}, {lse})", "%q, %q, %q", triton, forward),
            "  %o = " + x + " get-tuple-element(%pallas_call.1), index=0",
            _kernel_call("pallas_call.2", x, "%o", triton, "jit(f)/other_kernel/pallas_call"),
            f"  ROOT %t = (s32[], {x}) tuple(%i, %pallas_call.2)",
            "}", "",
            f"ENTRY %main (q: {x}, m: {xm}, l: {f32}) -> {xm} {{",
            f"  %q = {x} parameter(0)",
            f"  %m = {xm} parameter(1)",
            f"  %l = {f32} parameter(2)",
            f"  %init = (s32[], {x}) tuple(%q, %q)",
            f'  %w = (s32[], {x}) while(%init), condition=%cond, body=%body, '
            'backend_config={"known_trip_count":{"n":"3"}}',
            entry_call,
            "}"])

    # Mosaic's dQ call, (B, H, T, Q): q, k, v, l, m, dO, dI in (HLO numbers the sixth on), dQ out.
    text = hlo(_kernel_call("dq", xm, "%m, %m, %m, %l, %l, /*index=5*/%m, %l", mosaic, dq))
    one = 2 * 1024 * 4 * 128 * 1024  # a (T x Q) by (Q x T) matmul of 4 heads
    assert matmul_flops_from_hlo(text) == pytest.approx(3 * 2 * one * 36 / 64 + 3 * one)
    assert matmul_flops_from_hlo(text, fp8_only=True) == 0
    with pytest.raises(HloParseError, match="operand shapes of this flash kernel call"):
        matmul_flops_from_hlo(hlo(_kernel_call("dq", xm, "%m, %nowhere", mosaic, dq)))

# Compiles deviceless for 8 H100s (about a minute): the reader's rules are covered in the
# default lane by test_the_reader_counts_flash_kernels_as_attention; this checks them against
# XLA:GPU's program on a model they were not written against (bench/kernel_cost.py's GPT-2 block).
@pytest.mark.extended
@pytest.mark.targets
def test_a_flash_step_estimate_against_its_h100_compile():
    from target_sweep import require

    require("h100")
    bench = repo_files.load("bench/kernel_cost.py", "kernel_cost")
    d, heads, seq, layers = 256, 4, 512, 1
    step, state, batch = bench.gpt_step("h100", "auto", d=d, heads=heads, layers=layers, vocab=1024, seq=seq)
    rows = {r["quantity"]: r for r in sk.cost.simulate(step, state, batch, "data=8", target="h100",
                                                        estimate=True).comparison()}
    # The compiled figure counts the Triton custom calls as the reader does (7 matmuls, causal
    # over 4 blocks: 10 of 16), so the two agree; without them they differed by exactly that.
    kernel = layers * 7 * 2 * seq * d * seq * 10 / 16
    assert rows["flops"]["estimate"] == pytest.approx(rows["flops"]["compiled"], rel=1e-3)
    assert rows["flops"]["compiled"] > kernel  # the kernels are in it
    for q in ("memory/temporaries", "memory/peak"):
        assert rows[q]["caveat"] is None or not rows[q]["caveat"].startswith("not modelled"), rows[q]
        assert 0.8 < rows[q]["estimate"] / rows[q]["compiled"] < 1.2, rows[q]
