"""fp8 matmuls (``sk.fp8``): the quantized matmul against f32 within fp8's error bound, the
amax histories written by the step (not optimized, max over microbatches), refusals, and the
fp8 GEMMs in the program XLA:GPU compiles for H100.

Tolerance: E4M3 keeps 4 significant bits, so rounding x / scale is off by at most 2^-4
relative, uniformly spread: a product of two rounded operands is off by sqrt(2/3)·2^-4 ≈ 0.051
RMS, and a sum of K such products with independent errors is off by 0.051 of the RMS of its
terms times sqrt(K), i.e. 0.051·|x|·|w| for rows x and columns w. The tests allow 2× that.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk

RHO = np.sqrt(2 / 3) * 2.0 ** -4


def _operands(seed=0, shape=(32, 64, 48)):
    k1, k2 = jax.random.split(jax.random.key(seed))
    m, k, n = shape
    return jax.random.normal(k1, (m, k)), jax.random.normal(k2, (k, n)) * 0.05


def test_fp8_einsum_is_within_e4m3s_error_and_its_meta_gradient_is_the_new_history():
    x, w = _operands()
    meta = jnp.zeros((3, 4)).at[:2, 1].set(jnp.stack([jnp.abs(x).max(), jnp.abs(w).max()]))
    g = jax.random.normal(jax.random.key(2), (x.shape[0], w.shape[1])) * 1e-3

    @jax.jit
    def run(x, w, meta, g):
        y, vjp = jax.vjp(lambda a, b, c: sk.fp8.fp8_einsum("mk,kn->mn", a, b, c), x, w, meta)
        return y, vjp(g)

    y, (dx, dw, dmeta) = jax.device_get(run(x, w, meta, g))
    x, w, g = np.asarray(x), np.asarray(w), np.asarray(g)  # the exact side in numpy: no eager compiles
    exact = x @ w
    bound = RHO * np.sqrt((x ** 2) @ (w ** 2))  # RMS error of each output element
    assert float(np.sqrt(np.mean((y - exact) ** 2 / bound ** 2))) < 2.0
    # The gradients: dx, dw in fp8 (E5M2 cotangent) close to exact; d meta = the new histories.
    for got, want in ((dx, g @ w.T), (dw, x.T @ g)):
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < 4 * RHO
    np.testing.assert_allclose(dmeta[:, 0], [np.abs(x).max(), np.abs(w).max(), np.abs(g).max()], rtol=1e-6)
    np.testing.assert_array_equal(dmeta[:, 2:], meta[:, 1:3])  # rolled by one step
    with pytest.raises(ValueError, match="summed within it"):
        sk.fp8.fp8_einsum("mk,jn->mn", x, w, meta)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (16, 64)) / 4, out_sharding=(None, "mlp"))
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (64, 16)) / 8, out_sharding=("mlp", None))
        self.d1, self.d2 = sk.fp8.Fp8Dot(history=4), sk.fp8.Fp8Dot(history=4)

    def __call__(self, x):
        return self.d2("bf,fd->bd", jax.nn.gelu(self.d1("bd,df->bf", x, self.w1[...])), self.w2[...])


def _step(mesh, microbatches):
    plan = sk.Plan(mesh, axis_rules=sk.AxisRules({"mlp": "tensor"}, drop_missing=True), zero=1, precision="fp8")
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    return sk.train_step(plan, optax.adamw(1e-2), microbatches=microbatches, clip_norm=1.0)(loss)


def test_the_step_writes_the_amax_histories_and_takes_their_max_over_microbatches():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.normal(size=(16, 16)).astype(np.float32)}
    batch["x"][3] *= 8  # the largest |x| is in one microbatch's rows only
    step = _step(sk.make_mesh("data=4,tensor=2"), 2)
    state = step.init(lambda: Tiny(nnx.Rngs(0)))
    assert state.opt_state[0].mu["d1"]["meta"].shape == (3, 4)  # a parameter to Optax, never moved
    # ZeRO shards the weights' update, never a history: its gradient is written in the layer
    # (loop), where a sharded one would move (the recipe on H100 had in-loop all-reduces).
    assert step.specs("update")["d1"]["meta"] == jax.sharding.PartitionSpec()
    assert step.specs("update")["w1"] == jax.sharding.PartitionSpec(None, ("tensor", "data"))
    # The whole batch's gradient, as the step's mean over its microbatches.
    grads = jax.jit(jax.grad(step.microbatch_loss(state)))(state.params, batch)
    norm = np.sqrt(sum(float(jnp.sum(grads[k] ** 2)) for k in ("w1", "w2")))
    state, metrics = step(state, batch)
    # The histories are not in the norm (they alone exceed it); each microbatch's gradient is
    # rounded to E5M2 apart, hence 1e-3.
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-3)
    amax_x = float(np.abs(batch["x"].astype(jnp.bfloat16)).max())
    meta = np.asarray(state.params["d1"]["meta"])  # max over the microbatches: the batch's amax
    assert meta[0, 0] == pytest.approx(amax_x, rel=1e-2) and (meta[:, 1:] == 0).all()
    assert not np.asarray(state.opt_state[0].mu["d1"]["meta"]).any()  # never optimized
    state, _ = step(state, batch)
    assert np.asarray(state.params["d1"]["meta"])[0, 1] == pytest.approx(amax_x, rel=1e-2)  # rolled


class Plain(nnx.Module):
    """Unannotated weights: a model a user can build eagerly, outside any mesh."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 16)) / 4)
        self.dot = sk.fp8.Fp8Dot(history=4)

    def __call__(self, x):
        return self.dot("bd,df->bf", x, self.w[...])


def test_a_model_with_fp8_dots_built_eagerly_or_inside_init():
    # Built eagerly, Fp8Dot's history used to fail inside Flax ("An auto mesh context or
    # metadata is required ... out_sharding=P(None, None)"); only step.init(lambda: ...) worked.
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r"^w$", ())], precision="fp8")
    step = sk.train_step(plan, optax.sgd(0.1))(lambda m, b: jnp.mean(m(b) ** 2))
    eager = step.init(Plain(nnx.Rngs(0)))
    lazy = step.init(lambda: Plain(nnx.Rngs(0)))
    for state in (eager, lazy):
        assert state.params["dot"]["meta"].shape == (3, 4)
        assert state.params["dot"]["meta"].sharding.spec == jax.sharding.PartitionSpec()
    np.testing.assert_array_equal(eager.params["w"], lazy.params["w"])


def test_fp8_needs_an_fp8_matmul_in_the_model_and_a_target_with_fp8():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], precision="fp8")
    step = sk.train_step(plan, optax.sgd(0.1))(lambda p, b: jnp.sum(p["w"] * b))
    with pytest.raises(ValueError, match="no fp8 matmul"):
        step.init({"w": jnp.ones(8)})
    # Refused before compiling (no compiler needed).
    step = _step(sk.make_mesh("data=4,tensor=2"), 1)
    state = step.init(lambda: Tiny(nnx.Rngs(0)))
    batch = {"x": np.zeros((16, 16), np.float32), "y": np.zeros((16, 16), np.float32)}
    for target in ("a100", "tpu-v5p"):
        with pytest.raises(sk.cost.TargetError, match=f"{target} has no fp8 matmuls"):
            step.explain(state, batch, mesh="data=8", target=target)


@pytest.mark.extended  # two deviceless H100 compiles of the recipe (~30 s on 2 cores)
def test_the_recipes_dense_matmuls_are_fp8_gemms_on_h100():
    """``--precision fp8`` (remat full) compiled by XLA:GPU for 8 H100s: the attention
    projections and MLP matmuls (forward and both backward GEMMs) have fp8 operands, the rest
    (attention scores, the output head) stays bf16, the step-time model runs the fp8 flops at
    1,979 TFLOP/s, and the amaxes take one all-reduce per step."""
    from target_sweep import require

    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    require("h100")
    cfg = SIZES["test"].replace(seq=64, d_model=128, heads=4, kv_heads=4, remat="full")  # as bench/fp8.py
    jobs = [(*abstract_step(cfg, "data=8", global_batch=16, zero=1, precision=p, target="h100"), "data=8")
            for p in ("bf16", "fp8")]
    bf16, fp8 = sk.cost.simulate_many(jobs, target="h100", estimate=True)
    assert bf16.fp8_matmul_flops == 0 and fp8.matmul_flops == pytest.approx(bf16.matmul_flops, rel=0.01)
    share = fp8.fp8_matmul_flops / fp8.matmul_flops
    assert 0.5 < share < 1.0  # the projections and MLP, not the attention scores or the head
    # The matmuls' time, at the fp8 peak for the fp8 GEMMs (the kernels' memory traffic aside:
    # at d_model 128 fp8's quantization passes cost more than its GEMMs save).
    matmuls = lambda r: r.step_time["compute"] - r.step_time["memory-bound"]  # noqa: E731
    assert matmuls(fp8) < matmuls(bf16)
    assert "in fp8 GEMMs" in str(fp8)
    # The step's amaxes in one all-reduce after the layer scan (test_the_amax_all_reduces_are_
    # combined, on XLA:GPU): the only all-reduce over data that bf16 has not (it was one per
    # layer while the scan's body reduced them).
    assert fp8.role_counts()["grad-reduce"] - bf16.role_counts()["grad-reduce"] == 1


class Layers(nnx.Module):
    """``layers`` fp8 matmuls with stacked weights and histories, run in a Python loop or, as
    the recipe's layer stack, a rematerialised ``lax.scan``."""

    def __init__(self, layers, scan, rngs):
        self.scan = scan
        self.w = nnx.Param(jax.random.normal(rngs.params(), (layers, 16, 16)) / 4)
        self.meta = sk.fp8.Fp8Meta(jnp.zeros((layers, 3, 4)), out_sharding=(None, None, None), eager_sharding=False)

    def __call__(self, x):
        layer = lambda x, wm: (jax.nn.gelu(sk.fp8.fp8_einsum("bd,df->bf", x, *wm)), None)  # noqa: E731
        if self.scan:
            return jax.lax.scan(jax.checkpoint(layer), x, (self.w[...], self.meta[...]))[0]
        for w, meta in zip(self.w[...], self.meta[...]):
            x = layer(x, (w, meta))[0]
        return x


def _amax_all_reduces(hlo: str) -> float:
    """All-reduces taking a max (the amaxes: nothing else in the step does), through loops."""
    from shardkit.cost.compiled.hlo.collectives import _collective_ops
    from shardkit.cost.compiled.hlo.text import _walk

    maxes = {name for name, lines in _walk(hlo)[0].items() if any("ROOT" in ln and " maximum(" in ln for ln in lines)}
    return sum(m for kind, m, _, line in _collective_ops(hlo)
               if kind == "all-reduce" and re.search(r"to_apply=%?([\w.\-]+)", line).group(1) in maxes)


@pytest.mark.parametrize("layers, scan, mesh, zero", [(2, False, "data=8", 1), (4, False, "data=8", 1),
                                                    (3, True, "data=8", 1), (3, True, "fsdp=8", 3)])
def test_the_amax_all_reduces_are_combined(layers, scan, mesh, zero):
    # Each tensor's amax is a max over the data-sharded batch. Inside the step each device
    # reduces its own rows (the row grid, sk.fp8.with_row_grid) and the step's amaxes cross
    # devices once, after the loops: one all-reduce per step, in a Python loop of layers or a
    # layer scan, however deep. Before, a scan's amaxes were reduced in its body: one
    # all-reduce per iteration (3 here); before that, the gradient's scale was read from the
    # updated histories, which chained each matmul's gradient to the forward amaxes'. Under
    # ZeRO-3 the kernels are split over fsdp too: each device reduces its own blocks of them.
    plan = sk.Plan(sk.make_mesh(mesh), rules=[(r".*", ())], precision="fp8", zero=zero)
    step = sk.train_step(plan, optax.sgd(0.1))(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    state = step.init(lambda: Layers(layers, scan, nnx.Rngs(0)))
    batch = {"x": np.ones((16, 16), np.float32), "y": np.zeros((16, 16), np.float32)}
    hlo = step.lower(state, batch).compile().as_text()
    assert _amax_all_reduces(hlo) == 1


def test_the_row_grids_amaxes_are_the_global_ones():
    # The step's histories (row blocks reduced after the layer scan) hold exactly the values
    # fp8_einsum's own gradient writes with whole-tensor maxes: the same math, unsharded.
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(16, 16)).astype(np.float32), "y": rng.normal(size=(16, 16)).astype(np.float32)}
    batch["x"][5] *= 8  # the largest |x| in one device's rows
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], precision="fp8")
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    step = sk.train_step(plan, optax.sgd(0.1))(loss)
    model = Layers(3, True, nnx.Rngs(0))
    w, meta = model.w[...], model.meta[...]
    state = step.init(lambda: model)

    def reference(meta):  # the same step's loss in bf16, whole tensors, one device
        m = Layers(3, True, nnx.Rngs(0))
        m.w[...], m.meta[...] = w.astype(jnp.bfloat16), meta.astype(jnp.bfloat16)
        return loss(m, jax.tree.map(lambda a: a.astype(jnp.bfloat16), batch)).astype(jnp.float32)

    want = np.asarray(jax.jit(jax.grad(reference))(meta).astype(jnp.float32))
    assert want[:, :, 0].min() > 0  # every layer's three amaxes
    state, _ = step(state, batch)
    np.testing.assert_array_equal(np.asarray(state.params["meta"]), want)
