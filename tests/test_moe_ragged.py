"""sk.moe's dropless ragged dispatch (GPU/TPU targets) against the padded form (the CPU path and
the reference): the expert function as grouped matmuls, the sort/count/offset/unsort logic on
CPU with ``ragged_all_to_all`` replaced by an equivalent made of a dense ``all_to_all``, and the
target programs compiled deviceless for 8 H100s and a v5p-8 (the ragged-all-to-all present,
sending the routed rows, not the padded form's E/k times them)."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import shardkit as sk
from shardkit import _moe_ragged
from shardkit._grouped import NotGroupable, grouped_expert
from test_moe import B, D, E, K, T, assert_close, expert, inputs

ROOT = pathlib.Path(__file__).resolve().parents[1]
moe_mod = sys.modules["shardkit.moe"]


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name):
    """``lax.ragged_all_to_all``'s documented semantics on XLA:CPU: each peer's slice padded to
    the operand's rows, one dense all_to_all, written at the receiver's offsets."""
    R = operand.shape[0]
    rows = jnp.arange(R)[None, :]
    take = jnp.clip(input_offsets[:, None] + rows, 0, R - 1)
    chunks = jnp.where((rows < send_sizes[:, None])[..., None], operand[take], 0)  # (n, R, D)
    got = lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # row i: peer i's slice
    start = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    dest = jnp.where(rows < recv_sizes[:, None], start[:, None] + rows, output.shape[0])  # past: dropped
    return output.at[dest.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def test_grouped_expert_equals_each_expert_on_its_rows():
    """The recipe's SwiGLU (einsums, silu, sk.constrain) as ragged_dots: each group of rows
    through its own expert, empty groups and the rows past the groups included."""
    from models.transformer.model import swiglu_expert

    rng = np.random.default_rng(1)
    p = {k: jnp.asarray(rng.normal(size=s).astype(np.float32)) for k, s in
         (("gate", (4, 8, 16)), ("up", (4, 8, 16)), ("down", (4, 16, 8)))}
    x = jnp.asarray(rng.normal(size=(20, 8)).astype(np.float32))
    sizes = jnp.array([3, 0, 7, 5], jnp.int32)
    fn = jax.jit(lambda p, x: grouped_expert(swiglu_expert, p, x, sizes))
    text = str(jax.make_jaxpr(fn)(p, x))
    assert text.count("ragged_dot_general[") == 3, text
    remat = jax.jit(lambda p, x: grouped_expert(jax.checkpoint(swiglu_expert), p, x, sizes))
    assert_close(remat(p, x), fn(p, x))
    got = fn(p, x)
    bounds = np.cumsum([0, *np.asarray(sizes)])
    want = jax.jit(lambda p, x: jnp.concatenate(  # one program: eagerly, each expert's ops compile
        [swiglu_expert(jax.tree.map(lambda a: a[e], p), x[bounds[e]:bounds[e + 1]]) for e in range(4)]))(p, x)
    assert_close(got[:15], want)
    assert not np.any(np.asarray(got[15:]))
    with pytest.raises(NotGroupable, match=r"applies add to the token rows and an expert weight"):
        grouped_expert(lambda p, x: x @ p["w"] + p["b"][None], {"w": p["gate"], "b": p["gate"][:, 0]}, x, sizes)


def run(mesh_spec, dispatch):
    x, router, params, r = inputs()

    def f(x, router, params):
        y, aux = sk.moe(x, x @ router, expert, params, top_k=K, dispatch=dispatch)
        return jnp.sum(y * r) + aux["load_balance"], (y, aux)

    fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))
    if mesh_spec is None:
        return fn(x, router, params)
    mesh = sk.make_mesh(mesh_spec)
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules=sk.AxisRules({"mlp": "tensor"}, drop_missing=True))
    with plan.active():
        return fn(x, router, params)


@pytest.fixture(scope="module")
def padded():
    return run(None, "padded")  # every layout of the padded form equals it (test_moe.py)


# expert=8 (n = 8) is extended: data=2,expert=4 runs the same exchange with n = 4 and a data axis.
# Without an expert axis "auto" pads unless the target's kernel runs (test below): "ragged" here.
@pytest.mark.parametrize("mesh_spec,dispatch", [(None, "ragged"), ("data=2,expert=4", "auto"),
                                                pytest.param("expert=8", "auto", marks=pytest.mark.extended)])
def test_ragged_dispatch_equals_the_padded_form(mesh_spec, dispatch, padded, monkeypatch):
    """Outputs, aux and gradients of the ragged path (traced as for a GPU target, the
    collective emulated) equal the padded path's: the counts' exchange, the receiver-side
    offsets, the re-sort by local expert and the way home are all exercised with n > 1."""
    calls = []

    def spy(*args, **kw):
        calls.append(kw["axis_name"])
        return emulated_ragged_all_to_all(*args, **kw)

    monkeypatch.setattr(moe_mod, "target_platform", lambda: "gpu")
    monkeypatch.setattr(_moe_ragged, "ragged_all_to_all", spy)
    monkeypatch.setattr(_moe_ragged, "grouped_expert", lambda *a: calls.append("grouped") or grouped_expert(*a))
    got = run(mesh_spec, dispatch)
    assert_close(got, padded)
    # the ragged path ran: dispatch, experts, combine (the backward is autodiff's).
    assert calls == (["grouped"] if mesh_spec is None else ["expert", "grouped", "expert"])


def test_ragged_dispatch_refuses_what_it_cannot_run():
    x, router, params, _ = inputs()
    with pytest.raises(ValueError, match=r"dispatch='ragged' is dropless"):
        sk.moe(x, x @ router, expert, params, capacity_factor=1.0, dispatch="ragged")
    with pytest.raises(ValueError, match=r"needs a GPU or TPU target \(XLA:CPU has no ragged-all-to-all\)"):
        with jax.set_mesh(sk.make_mesh("expert=8")):
            sk.moe(x, x @ router, expert, params, dispatch="ragged")
    with pytest.raises(ValueError, match=r"dispatch='fast' must be"):
        sk.moe(x, x @ router, expert, params, dispatch="fast")


@pytest.mark.parametrize("dtype,width,ragged", [(jnp.bfloat16, 128, True), (jnp.float32, 128, False),
                                                (jnp.bfloat16, 96, False)])
def test_auto_without_an_expert_axis_is_ragged_only_with_the_kernel(dtype, width, ragged, monkeypatch):
    """On one device (no traffic to save) "auto" takes the ragged form only where the grouped
    GEMM kernel runs (16-bit, widths multiples of 128): lax.ragged_dot's dense expansion over the
    experts would cost k times the padded form's flops."""
    from shardkit.kernels import grouped

    chosen = []
    monkeypatch.setattr(moe_mod, "target_platform", lambda: "gpu")
    monkeypatch.setattr(grouped, "target_platform", lambda: "gpu")
    monkeypatch.setattr(moe_mod, "ragged_dispatcher", lambda *a: chosen.append(a) or _moe_ragged.ragged_dispatcher(*a))
    x = jax.ShapeDtypeStruct((2, 64, width), dtype)
    w = {"w1": jax.ShapeDtypeStruct((E, width, 256), dtype), "w2": jax.ShapeDtypeStruct((E, 256, width), dtype)}
    jax.eval_shape(lambda x, w: sk.moe(x, x[..., :E], expert, w, top_k=K), x, w)
    assert bool(chosen) == ragged


def test_auto_pads_with_a_warning_when_the_expert_cannot_be_grouped(monkeypatch):
    x, router, params, _ = inputs()
    biased = dict(params, b=np.zeros((E, D), np.float32))
    monkeypatch.setattr(moe_mod, "target_platform", lambda: "tpu")
    with pytest.warns(sk.RaggedFallbackWarning, match=r"pads every expert's buffer on tpu: .*applies add"):
        y, _ = jax.eval_shape(lambda: sk.moe(x, x @ router, lambda p, h: expert(p, h) + p["b"][None], biased,
                                             top_k=K))
    assert y.shape == (B, T, D)


# ~27 CPU s (two target compilers in a subprocess): extended. The default lane runs the same
# dispatch logic on CPU (test_ragged_dispatch_equals_the_padded_form, n = 8 with the collective
# emulated) and the grouped expert (test_grouped_expert_equals_each_expert_on_its_rows); this
# checks what XLA:GPU and XLA:TPU make of it.
@pytest.mark.extended
@pytest.mark.subprocess
@pytest.mark.targets
def test_the_targets_compile_the_ragged_dispatch_deviceless():
    """One MoE layer's forward+backward on expert=8 compiled for 8 H100s and a v5p-8 (one
    subprocess, ``bench/moe.py --dispatch``; BENCHMARKS.md has the 8,192-token × 64-expert
    figures): four ragged-all-to-alls (dispatch and combine, forward and backward) whose routed
    side holds the N·k routed rows, the padded form's dropless bytes being E/k times that; no
    dense all-to-all but the counts'; the grouped matmuls in the target's kernels."""
    from shardkit.cost.analytic.roles import moe_traffic
    from target_sweep import require

    for target in ("h100", "tpu-v5p"):
        require(target)
    tokens, experts, d, f = 1024, 16, 256, 128
    proc = subprocess.run([sys.executable, "bench/moe.py", "--dispatch", "h100", "tpu-v5p", "--forms", "ragged",
                           "--json", "--tokens", str(tokens), "--experts", str(experts), "--d-model", str(d),
                           "--d-ff", str(f)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["target"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    per_device = tokens // 8
    routed = 4 * per_device * K * d * 2  # bf16 rows, 4 ragged all-to-alls
    padded = moe_traffic(tokens=per_device, d_model=d, experts=experts, top_k=K, capacity_factor=None,
                         group_size=None, bytes_per_element=2, axis_size=8)
    assert padded == routed * experts // K
    for target, (call, count) in {"h100": ("mosaic_gpu_v2", 6), "tpu-v5p": ("tpu_custom_call", 9)}.items():
        r = rows[target]
        assert r["ragged_ops"] == 4 and r["ragged_routed_bytes"] == routed, r
        # The receive buffers: the static worst case, every peer's rows for this device's experts.
        assert r["ragged_buffer_bytes"] == 4 * _moe_ragged.receive_rows(per_device, K, experts, 8) * d * 2, r
        assert r["all_to_all_bytes"] < 1024, r  # only the per-expert counts and offsets
        # H100: forward and input gradient (the weight gradient's kernel needs a real GPU);
        # v5p: Megablox's gmm forward and backward and tgmm.
        assert r["custom_calls"].get(call, 0) >= count, r


@pytest.mark.parametrize("kernel", ["mosaic_gpu", "mosaic_gpu-real", "megablox"])
def test_grouped_matmul_kernels_equal_ragged_dot(kernel, monkeypatch):
    """The target kernels' wiring, forward and gradients, against lax.ragged_dot on CPU: the
    Megablox kernel interpreted; the Mosaic GPU kernels (no CPU interpreter) replaced by their
    references, which here fill the rows past the groups with NaN as a kernel may leave them
    (the weight gradient must not read them), with the weight gradient as compiled deviceless
    and ("-real") on a GPU."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    from jax.experimental.pallas.ops.tpu import megablox
    from shardkit.kernels import grouped

    rng = np.random.default_rng(2)
    dtype = jnp.float32 if kernel == "megablox" else jnp.bfloat16
    x = jnp.asarray(rng.normal(size=(256, 128)), dtype)
    w = jnp.asarray(rng.normal(size=(4, 128, 128)) * 0.1, dtype)
    sizes = jnp.array([100, 0, 60, 40], jnp.int32)  # 56 rows past the groups
    r = jnp.asarray(rng.normal(size=(200, 128)), jnp.float32)
    monkeypatch.setattr(grouped, "target_platform", lambda: "tpu" if kernel == "megablox" else "gpu")
    if kernel == "megablox":
        gmm = megablox.gmm
        monkeypatch.setattr(megablox, "gmm", lambda *a: gmm(*a, None, None, False, True))  # interpret
    else:
        def dot(lhs, rhs, group_sizes, transpose_rhs=False):
            out = lax.ragged_dot(lhs, rhs.swapaxes(1, 2) if transpose_rhs else rhs, group_sizes)
            return jnp.where(jnp.arange(lhs.shape[0])[:, None] < jnp.sum(group_sizes), out, jnp.nan)

        monkeypatch.setattr(grouped, "_kernels", lambda: (dot, transposed_ragged_dot_mgpu.ref_transposed_ragged_dot))
        monkeypatch.setattr(grouped, "_real_gpu", lambda: kernel.endswith("-real"))
    assert grouped.grouped_kernel(x, w) == (kernel.split("-")[0], "")

    def loss(mm):  # two in a row, as an expert's: the second reads the first's rows past the groups
        return lambda x, w: jnp.sum(mm(mm(x, w, sizes), w, sizes)[:200].astype(jnp.float32) * r)

    got = jax.jit(jax.value_and_grad(loss(grouped.grouped_matmul), argnums=(0, 1)))(x, w)
    want = jax.value_and_grad(loss(lax.ragged_dot), argnums=(0, 1))(x, w)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if a.shape == x.shape:  # the input gradient's rows past the groups are the kernel's
            a, b = a[:200], b[:200]
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * np.abs(b).max())
