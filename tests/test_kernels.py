"""``sk.attention``: every implementation against the plain (T, T) form on CPU in fp32
(forward and gradients; GQA, causal, sliding window; batch- and head-split layouts), the
kernel each platform gets, and the target programs compiled deviceless (custom call present,
no (T, T) buffer, temporaries far below the plain form's)."""

import functools
import importlib
import json
import pathlib
import subprocess
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardkit as sk
from shardkit.kernels import blockwise_attention, reference_attention
import repo_files

attention_mod = importlib.import_module("shardkit.kernels.attention")  # the module, not sk.attention
ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 2e-5  # fp32: the blockwise sums run in another order than the plain softmax's


def _qkv(B=2, T=96, H=4, K=2, Q=16, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(ks[0], (B, T, H, Q)), jax.random.normal(ks[1], (B, T, K, Q)),
            jax.random.normal(ks[2], (B, T, K, Q)), jax.random.normal(ks[3], (B, T, H, Q)))


def _value_and_grads(fn, q, k, v, dout, **kw):
    return jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, **kw) * dout), argnums=(0, 1, 2))(q, k, v)


def _jitted_value_and_grads(fn, q, k, v, dout, **kw):
    """``_value_and_grads`` as one compiled program (eagerly, each op would be a compile)."""
    return jax.jit(functools.partial(_value_and_grads, functools.partial(fn, **kw)))(q, k, v, dout)


def _close(a, b, tol=TOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 9), (False, 9)])
def test_blockwise_equals_the_plain_form_with_gradients(causal, window):
    q, k, v, dout = _qkv()  # T=96 with blocks of 40: the last block padded and masked
    want = _jitted_value_and_grads(reference_attention, q, k, v, dout, causal=causal, window=window)
    got = _jitted_value_and_grads(blockwise_attention, q, k, v, dout, block=40, causal=causal, window=window)
    _close(got, want)
    # sk.attention's CPU path is this form
    assert sk.kernels.attention_implementation(q.shape, q.dtype, causal=causal, window=window) == ("blockwise", "")
    _close(_jitted_value_and_grads(sk.attention, q, k, v, dout, causal=causal, window=window), want)


@pytest.mark.parametrize("mesh,spec", [("data=8", P("data")), ("data=2,tensor=4", P("data", None, "tensor")),
                                       ("tensor=8", P(None, None, "tensor"))])
def test_attention_in_batch_and_head_split_layouts(mesh, spec):
    """The recipe's layouts: batch over data, heads (and the kv heads they read) over tensor."""
    q, k, v, dout = _qkv(B=8, T=64, H=8, K=8 if "tensor=8" in mesh else 4)
    want = _jitted_value_and_grads(reference_attention, q, k, v, dout, causal=True)
    m = sk.make_mesh(mesh)
    put = lambda x: jax.device_put(x, NamedSharding(m, spec))  # noqa: E731
    fn = jax.jit(functools.partial(_value_and_grads, functools.partial(sk.attention, block=16), causal=True))
    _close(fn(put(q), put(k), put(v), put(dout)), want)


def test_the_pallas_kernels_run_per_device_in_a_plan(monkeypatch):
    """The Triton kernel's shard_map (interpreted on CPU): each device attends its batch and
    head shard; kv heads repeated for GQA; the plan's logical axes pick the split."""
    q, k, v, dout = _qkv(B=4, T=128, H=4, K=2, Q=16)
    want = _jitted_value_and_grads(reference_attention, q, k, v, dout, causal=True)
    monkeypatch.setattr(attention_mod, "_INTERPRET", True)
    mesh = sk.make_mesh("data=2,tensor=2", devices=jax.devices()[:4])
    plan = sk.Plan(mesh, rules=sk.PathRules([(r".*", ())]),
                   axis_rules=sk.AxisRules({"batch": "data", "heads": "tensor"}))
    seen = []
    real = attention_mod._spec

    def spy(q, mesh, free):
        seen.append(real(q, mesh, free))
        return seen[-1]

    monkeypatch.setattr(attention_mod, "_spec", spy)

    def run(q, k, v, dout):
        with plan.active():
            return _value_and_grads(sk.attention, q, k, v, dout, causal=True, implementation="triton")

    with jax.set_mesh(mesh):
        got = jax.jit(run)(q, k, v, dout)
    _close(got, want, tol=1e-4)  # the interpreted kernel's own f32 block order
    assert seen == [P("data", None, "tensor")]


def _kernel_like(causal, scale):
    """A stand-in with the Pallas Triton kernel's interface (a ``jax.custom_vjp`` called as
    ``op(q, k, v, segment_ids, *fixed)``; residuals q, k, v, None, out and a (B, H, T)
    log-sum-exp in base 2, as Triton keeps it; a backward rule whose gradients carry no manual
    axes' type), computed by the plain form: the Pallas interpreter cannot run inside a
    type-checked shard_map. Queries and keys may differ in length (a ring's block pairs);
    ``causal`` masks by position within the pair."""
    import functools

    def out_lse(q, k, v):
        s = jnp.einsum("bthq,bshq->bhts", q, k) * scale
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf) if causal else s
        lse = jax.nn.logsumexp(s, axis=-1)
        return jnp.einsum("bhts,bshq->bthq", jnp.exp(s - lse[..., None]), v), lse

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def op(q, k, v, segment_ids, tag):
        return out_lse(q, k, v)[0]

    def fwd(q, k, v, segment_ids, tag):
        out, lse = out_lse(q, k, v)
        return out, (q, k, v, segment_ids, out, lse * np.log2(np.e))

    def bwd(tag, res, g):  # written out, as a kernel's is (Dao et al. 2022, alg. 2)
        q, k, v, _, out, lse2 = res
        s = jnp.einsum("bthq,bshq->bhts", q, k) * scale
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf) if causal else s
        p = jnp.exp2(s * np.log2(np.e) - lse2[..., None])
        dp = jnp.einsum("bthq,bshq->bhts", g, v)
        ds = p * (dp - jnp.einsum("bthq,bthq->bht", g, out)[..., None]) * scale
        return (jnp.einsum("bhts,bshq->bthq", ds, k), jnp.einsum("bhts,bthq->bshq", ds, q),
                jnp.einsum("bhts,bthq->bshq", p, g), None)

    op.defvjp(fwd, bwd)
    return op, ("tag",), (None,)


@pytest.mark.parametrize("free", [True, False], ids=["data-left-to-the-compiler", "all-manual"])
def test_a_flash_kernel_runs_inside_a_type_checked_manual_region(monkeypatch, free):
    """A pipeline stage's shard_map (manual over ``pipe``, types checked): the kernel runs by
    its own forward and backward rules in a nested region, its residuals split like the
    queries (the log-sum-exp like their batch and heads), and its gradients come back typed
    as varying over ``pipe`` — in jax 0.10.2 the Pallas kernels' custom VJPs alone fail that
    check, and sk.attention fell back to the blockwise form there. Values and gradients equal
    the plain form's, per stage."""
    monkeypatch.setattr(attention_mod, "_rules", lambda impl, q, causal, scale: _kernel_like(causal, scale))
    q, k, v, dout = _qkv(B=4, T=32, H=4, K=2, Q=16)
    want = [_jitted_value_and_grads(reference_attention, *(a[2 * i:2 * i + 2] for a in (q, k, v, dout)),
                                    causal=True) for i in range(2)]
    shape, names = ((2, 2), ("pipe", "data")) if free else ((2,), ("pipe",))
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices()[:2 * len(shape)])

    def stage(q, k, v, dout):
        val, grads = _value_and_grads(sk.attention, q, k, v, dout, causal=True, implementation="triton",
                                      spec=P("data") if free else None)
        return val[None], grads

    run = jax.shard_map(stage, mesh=mesh, in_specs=P("pipe"), out_specs=P("pipe"), axis_names={"pipe"},
                        check_vma=True)
    with jax.set_mesh(mesh):
        vals, grads = jax.jit(run)(q, k, v, dout)
    for i in range(2):
        _close((vals[i], tuple(g[2 * i:2 * i + 2] for g in grads)), want[i])


def test_a_flash_kernel_in_a_zero_bubble_stage_with_kept_residuals(monkeypatch):
    """ZB-H1 with ``keep="dots"`` on a stage that calls the kernel (the stand-in, as above):
    F keeps the policy's residuals, B re-binds the layer's backward on them and leaves W its
    reads, some of which the kernel's region makes from constants alone; the W ring's slot is
    typed as the ring (it failed the schedule's switch on H100). Loss and gradients equal the
    sequential model's with the plain form."""
    monkeypatch.setattr(attention_mod, "_rules", lambda impl, q, causal, scale: _kernel_like(causal, scale))
    T, H, Q, L = 16, 2, 8, 2
    ks = jax.random.split(jax.random.key(1), 4)
    params = {n: jax.random.normal(k, (L, H * Q, H * Q)) / np.sqrt(H * Q) for n, k in zip("qkvo", ks)}
    x = jax.random.normal(jax.random.key(2), (4, T, H * Q))

    def layer(impl):
        def one(lp, h):
            q, k, v = ((h @ lp[n]).reshape(h.shape[:2] + (H, Q)) for n in "qkv")
            return h + sk.attention(q, k, v, causal=True, implementation=impl).reshape(h.shape) @ lp["o"]
        return one

    def loss(y, _t=None):
        return jnp.mean(y ** 2)

    want = jax.jit(jax.value_and_grad(lambda p: loss(jax.lax.scan(
        lambda h, lp: (layer("reference")(lp, h), None), x, p)[0])))(params)
    mesh = sk.make_mesh("pipe=2", devices=jax.devices()[:2])
    got = jax.jit(jax.value_and_grad(lambda p: sk.pipeline(
        layer("triton"), p, x, microbatches=2, schedule="zb-h1", keep="dots", mesh=mesh,
        loss_fn=lambda _, y, t: loss(y), loss_params={}, targets=jnp.zeros((4,)))))(params)
    _close(got, want, tol=1e-4)


def _dots(jaxpr) -> int:
    """dot_generals in ``jaxpr`` and every jaxpr nested in it (each equation once)."""
    return sum((e.primitive.name == "dot_general") + sum(_dots(j) for j in jax.extend.core.jaxprs_in_params(e.params))
               for e in jaxpr.eqns)


_LEAN_PATHS = {  # mesh, how the layer's attention runs on it
    "triton": ("data=2", lambda q, k, v: sk.attention(q, k, v, causal=True, implementation="triton")),
    "triton-in-a-stage": ("pipe=2", lambda q, k, v: sk.attention(q, k, v, causal=True, implementation="triton")),
    "blockwise": ("data=2", functools.partial(sk.attention, causal=True, implementation="blockwise", block=8)),
    "ring": ("data=2,context=2", lambda q, k, v: sk.context_attention(
        q, k, v, causal=True, order="zigzag", implementation="triton")),
}


@pytest.mark.parametrize("path", list(_LEAN_PATHS))
def test_lean_keeps_the_flash_kernels_output_and_log_sum_exp(monkeypatch, path):
    """remat / keep "lean" (``sk.lean_policy``): a layer's backward reads the flash kernel's
    output and log-sum-exp as kept, and never runs the kernel's forward again (its custom
    VJP's residuals are named ``attention_out``, ``attention_lse``; unnamed, the policy
    recomputed them, and the kernel's forward with them, in the backward): the grad program
    holds as many matmuls as the one that recomputes nothing, the layer keeps q, k, v, one
    output (the kernel's residual and the next matmul's input are one buffer) and the
    log-sum-exp, and gradients equal full recompute's (keep "input"). The single-device
    kernel (the Triton stand-in of the tests above), the same in a pipeline stage's manual
    region, the blockwise form, and the context ring with a kernel per step."""
    from jax.ad_checkpoint import checkpoint_name
    from jax._src.ad_checkpoint import saved_residuals

    monkeypatch.setattr(attention_mod, "_rules",
                        lambda impl, q, causal, scale, kv_len=None: _kernel_like(causal, scale))
    spec, attend = _LEAN_PATHS[path]
    mesh = sk.make_mesh(spec, devices=jax.devices()[:2 * spec.count(",") + 2])
    B, T, H, Q = 2, 16, 2, 8
    ks = jax.random.split(jax.random.key(3), 4)
    w = {n: jax.random.normal(k, (H * Q, H * Q)) / np.sqrt(H * Q) for n, k in zip("qkvo", ks)}
    x = jax.random.normal(jax.random.key(4), (B, T, H * Q))

    def layer(w, x):
        q, k, v = (checkpoint_name((x @ w[n]).reshape(B, T, H, Q), f"attention_{n}") for n in "qkv")
        return jnp.sum(attend(q, k, v).reshape(B, T, H * Q) @ w["o"])  # linear: keeps no product

    saved = []
    if path == "triton-in-a-stage":  # a stage's region: manual over pipe, types checked
        inner = layer

        def stage(w, x):
            saved.append(saved_residuals(jax.checkpoint(inner, policy=sk.lean_policy()), w, x))
            return inner(w, x)[None]

        layer = lambda w, x: jax.shard_map(  # noqa: E731
            stage, in_specs=(P(), P("pipe")), out_specs=P("pipe"), axis_names={"pipe"},
            check_vma=True)(w, jnp.concatenate([x, x]))[0]
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules=sk.AxisRules(
        {"batch": "data" if "data" in spec else None, "heads": None}))

    def grads(policy):
        fn = layer if policy == "none" else jax.checkpoint(layer, policy=policy)
        return jax.grad(fn, argnums=(0, 1))

    with jax.set_mesh(mesh), plan.active():
        lean = sk.lean_policy()
        dots = {p: _dots(jax.make_jaxpr(grads(p))(w, x).jaxpr) for p in ("none", lean)}
        assert dots[lean] == dots["none"], dots  # before: the kernel's forward matmuls again
        saved = saved[0] if saved else saved_residuals(jax.checkpoint(layer, policy=lean), w, x)
        named = sorted(s.split("'")[1] for _, s in saved if s.startswith("named"))
        assert named == sorted(["attention_q", "attention_k", "attention_v", "attention_out", "attention_lse"]), saved
        got, want = jax.jit(lambda w, x: (grads(lean)(w, x), grads(None)(w, x)))(w, x)
    _close(got, want, tol=1e-6)


def test_each_platform_gets_its_kernel_and_a_fallback_says_why():
    pick = sk.kernels.attention_implementation
    assert pick((8, 4096, 16, 128), jnp.bfloat16, causal=True, platform="gpu") == ("triton", "")  # deviceless
    assert pick((8, 4096, 16, 128), jnp.bfloat16, causal=True, platform="tpu") == ("mosaic", "")
    assert pick((8, 4096, 16, 128), jnp.float32, causal=True, platform="cpu") == ("blockwise", "")
    impl, why = pick((8, 4096, 16, 128), jnp.bfloat16, causal=True, window=1024, platform="tpu")
    assert impl == "blockwise" and "sliding window" in why
    impl, why = pick((8, 1000, 16, 128), jnp.bfloat16, causal=True, platform="gpu")
    assert impl == "blockwise" and "1000 is not a multiple" in why
    # Triton's tiles in shared memory: f32 at head_dim 128 and block 128 asks 262,144 bytes, over
    # the 232,448 of an H100 and an H200 (refused by both compilers); it takes block 64 instead,
    # so its sequence need only be a multiple of 64.
    assert pick((8, 4096, 16, 128), jnp.float32, causal=True, platform="gpu") == ("triton", "")
    assert pick((8, 192, 16, 128), jnp.float32, causal=True, platform="gpu") == ("triton", "")
    impl, why = pick((8, 192, 16, 128), jnp.bfloat16, causal=True, platform="gpu")
    assert impl == "blockwise" and "block of 128" in why
    assert pick((8, 4096, 16, 128), jnp.float32, causal=True, platform="tpu") == ("mosaic", "")
    # A fallback traced for a GPU target warns, naming the reason.
    from shardkit.cost.compiled.simulated import abstract_mesh
    am = abstract_mesh("data=8", target="h100")
    q = jax.ShapeDtypeStruct((8, 100, 4, 16), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(am), pytest.warns(sk.kernels.KernelFallbackWarning,
                                                          match="100 is not a multiple.*platform gpu"):
        jax.eval_shape(lambda q: sk.attention(q, q, q, causal=True), q)


def test_bad_calls_say_what_is_wrong():
    q, k, v, _ = _qkv(H=3, K=2)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        sk.attention(q, k, v, causal=True)
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="implementation='flash' is not one of"):
        sk.attention(q, k, v, causal=True, implementation="flash")
    with pytest.raises(ValueError, match="window=0 must be a positive int"):
        sk.attention(q, k, v, causal=True, window=0)
    with pytest.raises(TypeError):
        sk.attention(q, k, v)  # causal is required: a decoder that forgets it sees the future


FLASH_TARGETS = {"h100": "__gpu$xla.gpu.triton", "tpu-v5p": "tpu_custom_call"}


def _kernel_rows(*what: str) -> dict:
    """bench/kernels_memory.py's rows for every target whose compiler is installed, from ONE
    subprocess (each start of JAX and the targets' plugins costs seconds): target -> rows."""
    from target_sweep import require

    available = []
    for target in FLASH_TARGETS:
        try:
            require(target)
            available.append(target)
        except pytest.skip.Exception:
            pass
    if not available:
        return {}
    # The ring's pieces at T=2048 over data=2,context=4: 512 and 256 tokens (apart from head_dim
    # 128, so a buffer with two such dims is a block's scores or mask).
    proc = subprocess.run([sys.executable, "bench/kernels_memory.py", "--target", *available, "--json",
                           "--seq", "1024", "--heads", "4", "--kv-heads", "2", "--what", *what,
                           "--context-mesh", "data=2,context=4", "--context-seq", "2048"],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for r in json.loads(proc.stdout.strip().splitlines()[-1]):
        name = r["program"].split(" ")[0] + (" manual" if "manual over" in r["program"] else "")
        if r["what"] == "context":
            name = f"ring {r['implementation']}"
        rows.setdefault(r["target"], {})[name] = r
    return rows


@pytest.fixture(scope="module")
def flash_rows():
    return _kernel_rows("attention")


@pytest.fixture(scope="module")
def ring_rows():
    return _kernel_rows("context")


@pytest.mark.subprocess
@pytest.mark.targets
@pytest.mark.parametrize("target,call", sorted(FLASH_TARGETS.items()))
def test_the_target_compiles_its_flash_kernel_deviceless(flash_rows, target, call):
    """One attention layer's forward+backward, batch over 8 devices, bf16: the kernel's custom
    call, no (T, T) buffer, and temporaries a fraction of the plain form's (bench/kernels_memory.py;
    BENCHMARKS.md has the T=4096 figures)."""
    from target_sweep import require

    require(target)
    rows = flash_rows[target]
    plain, kernel = rows["plain"], rows["sk.attention"]
    assert kernel["implementation"] == ("triton" if target == "h100" else "mosaic")
    assert kernel["custom_calls"].get(call, 0) >= 3  # forward, and the backward's dq and dk/dv kernels
    assert plain["TxT_buffer"] and not kernel["TxT_buffer"]
    assert kernel["temporaries_mib"] < plain["temporaries_mib"] / 2  # T=1024: 2.5x (v5p), 4096: 12-80x
    # Inside a type-checked shard_map manual over data (a pipeline stage's kind): the same
    # kernels, the same temporaries (it fell back to the blockwise form there before).
    manual = rows["sk.attention manual"]
    assert manual["custom_calls"] == kernel["custom_calls"] and not manual["TxT_buffer"]
    assert manual["temporaries_mib"] == pytest.approx(kernel["temporaries_mib"], rel=0.05)



@pytest.mark.subprocess
@pytest.mark.targets
@pytest.mark.parametrize("target,call", sorted(FLASH_TARGETS.items()))
def test_the_context_ring_runs_the_targets_flash_kernel_per_step(ring_rows, target, call):
    """A causal CP attention layer's forward+backward (data=2,context=4, zig-zag ring, T=2048):
    each ring step calls the target's flash kernel, and no buffer holds a ring block's scores
    or mask, which the blockwise ring's program has (bench/kernels_memory.py --what context;
    BENCHMARKS.md has the 7B-sized layer at 32K and 128K)."""
    from target_sweep import require

    require(target)
    rows = ring_rows[target]
    kernel = "triton" if target == "h100" else "mosaic"
    blockwise, flash = rows["ring blockwise"], rows[f"ring {kernel}"]
    assert call not in blockwise["custom_calls"] and blockwise["ring_block_buffer"]
    # forward and backward, on each kind of block pair
    assert flash["custom_calls"].get(call, 0) >= 6 and not flash["ring_block_buffer"], flash


@pytest.mark.subprocess
@pytest.mark.targets
@pytest.mark.parametrize("target", sorted(FLASH_TARGETS))
def test_the_compiled_flops_count_the_flash_kernels_as_the_reader_does(flash_rows, target):
    """The compiled matmul flops of the flash layer (``hlo.matmul_flops_from_hlo``, on the
    kernels' custom calls, which no compiler counts) equal the program reader's count of the
    same layer traced for the target (``cost.flash_flops`` on the ``pallas_call``\\ s): the
    Triton forward 2 + backward 5 matmuls, Mosaic's 2 + 4 + 3, causal 36 of 8 x 8 blocks.
    Exact up to float rounding: one formula on the same shapes, and the layer has no other
    matmul (the kv heads are repeated, not multiplied)."""
    from target_sweep import require

    from shardkit.cost.compiled.simulated import abstract_mesh
    from shardkit.cost.program.reader import read_program

    require(target)
    B, T, H, K, Q = 8, 1024, 4, 2, 128  # flash_rows' layer: one sequence a device over data=8
    spec = P("data", None, None, None)

    def fn(params, batch):
        return jnp.sum(sk.attention(*params, causal=True, spec=spec).astype(jnp.float32))

    q, kv = (jax.ShapeDtypeStruct((B, T, n, Q), jnp.bfloat16) for n in (H, K))
    split_of = lambda aval, leaf, manual=frozenset(): (8 if aval.shape[:1] == (B,) and "data" not in manual else 1, 1)  # noqa: E731
    with jax.sharding.use_abstract_mesh(abstract_mesh("data=8", target=target)):
        reading = read_program(fn, (q, kv, kv), jax.ShapeDtypeStruct((B,), jnp.int32), split_of=split_of, n_params=3)
    matmuls = 2 + 5 if target == "h100" else 2 + 4 + 3
    assert reading.flops == pytest.approx(matmuls * 2 * T * H * Q * T * 36 / 64)
    assert flash_rows[target]["sk.attention"]["matmul_flops"] == pytest.approx(reading.flops, rel=1e-9)

# ---- the chunked loss -------------------------------------------------------------------------

@pytest.mark.parametrize("mesh,chunk", [(None, 8), (None, 37), ("data=2,tensor=4", 8)])
def test_chunked_cross_entropy_equals_the_plain_loss(mesh, chunk):
    """Loss and gradients (hidden states, output matrix) against the whole-logits form, fp32:
    chunks that do not divide T=37 (padded, masked), one chunk, and the vocabulary split over
    ``tensor`` with the sequences over ``data`` (the recipe's vocab-parallel head)."""
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (4, 37, 16))
    w = jax.random.normal(ks[1], (64, 16))
    t = jax.random.randint(ks[2], (4, 37), 0, 64)
    grads = lambda fn: jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))  # noqa: E731
    want = grads(sk.kernels.reference_cross_entropy)(x, w, t)
    if mesh is not None:
        m = sk.make_mesh(mesh)
        x, t = (jax.device_put(a, NamedSharding(m, P("data"))) for a in (x, t))
        w = jax.device_put(w, NamedSharding(m, P("tensor")))
    got = grads(functools.partial(sk.chunked_cross_entropy, chunk=chunk))(x, w, t)
    _close(got, want, tol=1e-5)
    with pytest.raises(ValueError, match="chunk=0 must be a positive int"):
        sk.chunked_cross_entropy(x, w, t, chunk=0)


def test_cross_entropy_picks_the_label_without_a_gather():
    """``sk.kernels.cross_entropy``: optax's values bit for bit and the same gradient (the
    label's logit as a masked sum: one term, zeros), with no gather in the program (the gather
    XLA's partitioner aborts on inside a pipeline stage, docs/upstream/); bad labels refused."""
    import optax

    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
    labels = rng.integers(0, 11, (3, 5)).astype(np.int32)
    ours = jax.value_and_grad(lambda z: jnp.sum(sk.kernels.cross_entropy(z, labels)))
    want = jax.value_and_grad(lambda z: jnp.sum(optax.softmax_cross_entropy_with_integer_labels(z, labels)))
    both = jax.jit(lambda z: (sk.kernels.cross_entropy(z, labels),
                              optax.softmax_cross_entropy_with_integer_labels(z, labels), ours(z), want(z)))
    got, expected, got_grad, want_grad = both(logits)
    np.testing.assert_array_equal(got, expected)
    _close(got_grad, want_grad, tol=1e-6)
    assert "gather(" not in jax.jit(ours).lower(logits).as_text(dialect="hlo")
    with pytest.raises(ValueError, match=r"integer labels \(\.\.\.\); got logits \(3, 5, 11\).*labels \(3, 4\)"):
        sk.kernels.cross_entropy(logits, labels[:, :4])


@pytest.mark.slow
def test_the_gpu_bench_dry_run_writes_its_table(tmp_path):
    """``bench/kernels_gpu.py --dry-run``: the GPU bench's code at tiny sizes on CPU, so the
    command the GPU lease runs cannot rot (accuracy rows within bf16/fp32 bounds, timings).
    Its ``main`` runs in this process (the script's ``__main__`` only calls it): a subprocess
    would start JAX again for the same code."""
    bench = repo_files.load("bench/kernels_gpu.py", "kernels_gpu_bench")
    bench.main(["--dry-run", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "kernels_gpu-dry-run.json").read_text())
    assert result["dry_run"] and not any(k.endswith("_error") for k in result)
    for r in result["accuracy"]:
        bound = 2e-2 if r["dtype"] == "bfloat16" else 1e-5  # bf16 roundings of inputs and p; fp32
        assert "error" not in r and max(r["out"], r["dq"], r["dk"], r["dv"]) < bound * max(1.0, r["scale"]), r
    assert [r["implementation"] for r in result["timing"]] == ["xla", "auto", "blockwise"]
    assert all(r["ms"] > 0 for r in result["timing"]) and result["timing"][0]["vs_xla"] == 1.0
    assert "| 256 | 1 | blockwise |" in (tmp_path / "kernels_gpu-dry-run.md").read_text()


def test_a_plan_without_batch_or_heads_names_says_how_to_split_the_kernel():
    """A GPU-target trace whose plan maps no ``heads``: the error names the fix (no silent
    replication of the kernel's work)."""
    from shardkit.cost.compiled.simulated import abstract_mesh

    am = abstract_mesh("data=8", target="h100")
    plan = sk.Plan(am, rules=sk.PathRules([(r".*", ())]), axis_rules=sk.AxisRules({"batch": "data"}))
    q = jax.ShapeDtypeStruct((8, 128, 4, 64), jnp.bfloat16)
    with plan.active(), jax.sharding.use_abstract_mesh(am), pytest.raises(
            sk.ShardingError, match="Map 'batch' and 'heads' there, or pass spec="):
        jax.eval_shape(lambda q: sk.attention(q, q, q, causal=True), q)
