"""sk.moe: a dense oracle (every token through its top-k experts, weighted by its gates, no
dispatch) against the block on one device and four expert-parallel layouts, dropless and with
a capacity that drops; the all-to-all traffic; ZeRO over expert weights; bad input;
``sk.constrain`` inside a building block whose shard_map makes every axis manual; and the
block nested in a pipeline's stages beside two compiler-owned axes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import shardkit as sk
import shardkit_test_compile  # tests/_site, on sys.path through conftest.py
from shardkit.cost.compiled.hlo import traffic_from_hlo

E, D, F, B, T, K = 8, 16, 32, 8, 8, 2
CAPACITY = 1.0  # C = ceil(1.0 * 2 * 8 / 8) = 2 per expert per sequence: drops ~1/4
LAYOUTS = ("expert=8", "data=2,expert=4", "expert=4,tensor=2", "fsdp=2,expert=4")


def inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, T, D)).astype(np.float32)
    router = rng.normal(size=(D, E)).astype(np.float32)
    params = {"w1": (rng.normal(size=(E, D, F)) * 0.3).astype(np.float32),
              "w2": (rng.normal(size=(E, F, D)) * 0.3).astype(np.float32)}
    r = rng.normal(size=(B, T, D)).astype(np.float32)
    return x, router, params, r


def expert(p, h_RxD):
    # TP inside the expert on meshes with a tensor axis: the hidden dim is column/row split.
    h_RxF = sk.constrain(jnp.tanh(h_RxD @ p["w1"]), (None, "mlp"))
    return h_RxF @ p["w2"]


# ---- the oracle: no dispatch, no buffers --------------------------------------------------------

def oracle_keep(idx_NxK: np.ndarray, capacity: float | None) -> np.ndarray:
    """The documented drop rule, written out: per sequence, first choices in token order,
    then second choices; an expert takes at most ceil(c·k·T/E) of them."""
    keep = np.ones(idx_NxK.shape, bool)
    if capacity is None:
        return keep
    C = min(T, math.ceil(capacity * K * T / E))
    for b in range(B):
        taken = np.zeros(E, int)
        for j in range(K):
            for t in range(T):
                e = idx_NxK[b * T + t, j]
                keep[b * T + t, j] = taken[e] < C
                taken[e] += 1
    return keep


def oracle(x, router, params, keep):
    logits = (x @ router).reshape(-1, E)
    probs = jax.nn.softmax(logits, -1)
    top, idx = jax.lax.top_k(probs, K)
    gates = top / top.sum(-1, keepdims=True)
    xs = x.reshape(-1, D)
    every = jnp.stack([expert(jax.tree.map(lambda a: a[e], params), xs) for e in range(E)], 1)
    chosen = jnp.take_along_axis(every, idx[..., None], 1)  # (N, K, D)
    y = jnp.einsum("nk,nkd->nd", gates * keep, chosen).reshape(x.shape)
    f = jnp.bincount(idx.reshape(-1), length=E) / idx.size
    aux = {"load_balance": E * jnp.sum(f * probs.mean(0)),
           "z_loss": jnp.mean(jax.nn.logsumexp(logits, -1) ** 2),
           "dropped_fraction": 1.0 - keep.mean(), "tokens_per_expert": f * idx.size}
    return y, aux


def objective(y, aux, r):
    return jnp.sum(y * r) + aux["load_balance"] + 0.1 * aux["z_loss"]


def run_oracle(capacity):
    x, router, params, r = inputs()
    idx = np.asarray(jax.lax.top_k(jax.nn.softmax((x @ router).reshape(-1, E)), K)[1])
    keep = oracle_keep(idx, capacity)

    def f(x, router, params):
        y, aux = oracle(x, router, params, keep)
        return objective(y, aux, r), (y, aux)

    # One jitted program (run op by op, the oracle compiled ~70 small programs per mode).
    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(x, router, params)
    return y, aux, grads


def both_modes(x, router, params, r):
    """Dropless and capacity outputs, aux and gradients, in one compiled program."""
    out = {}
    for name, cf in (("dropless", None), ("capacity", CAPACITY)):
        def f(x, router, params):
            y, aux = sk.moe(x, x @ router, expert, params, top_k=K, capacity_factor=cf)
            return objective(y, aux, r), (y, aux)

        (_, (y, aux)), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(x, router, params)
        out[name] = (y, aux, grads)
    return out


def run_layout(mesh_spec):
    x, router, params, r = inputs()
    if mesh_spec is None:
        compiled = jax.jit(both_modes).lower(x, router, params, r).compile(shardkit_test_compile.AS_RUN)
        return compiled(x, router, params, r), compiled.as_text()
    mesh = sk.make_mesh(mesh_spec)
    tok = P(tuple(a for a in mesh.axis_names if a != "tensor"))
    wspec = {"w1": P("expert", "fsdp" if "fsdp" in mesh.shape else None, "tensor" if "tensor" in mesh.shape else None),
             "w2": P("expert", "tensor" if "tensor" in mesh.shape else None, None)}
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules=sk.AxisRules({"mlp": "tensor"}, drop_missing=True))
    args = (jax.device_put(x, NamedSharding(mesh, tok)), router,
            {k: jax.device_put(v, NamedSharding(mesh, wspec[k])) for k, v in params.items()},
            jax.device_put(r, NamedSharding(mesh, tok)))
    # one compile: the program that runs is the one whose HLO (its collectives) is read;
    # compiled with the emitters the tests run with (AS_RUN: tests/_site)
    with plan.active():
        compiled = jax.jit(both_modes).lower(*args).compile(shardkit_test_compile.AS_RUN)
        return compiled(*args), compiled.as_text()


@pytest.fixture(scope="module")
def reference():
    return {"dropless": run_oracle(None), "capacity": run_oracle(CAPACITY)}


@pytest.fixture(scope="module")
def one_device():
    return run_layout(None)


def assert_close(got, want, rtol=1e-5):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = max(np.max(np.abs(b)), 1e-30)
        assert np.max(np.abs(a - b)) <= rtol * scale, f"max |diff| {np.max(np.abs(a - b)):.3g} vs scale {scale:.3g}"


def test_one_device_equals_the_dense_oracle(one_device, reference):
    (out, _) = one_device
    for mode in ("dropless", "capacity"):
        y, aux, grads = out[mode]
        ry, raux, rgrads = reference[mode]
        assert_close(y, ry)
        assert_close(grads, rgrads)
        for key in raux:
            assert_close(aux[key], raux[key])
    assert float(out["dropless"][1]["dropped_fraction"]) == 0.0
    assert 0.1 < float(out["capacity"][1]["dropped_fraction"]) < 0.5  # the capacity really drops


@pytest.mark.parametrize("mesh_spec", LAYOUTS)
def test_expert_parallel_equals_one_device(mesh_spec, one_device, reference):
    """Same outputs, aux and gradients as one device (and the oracle), same drops; the
    all-to-all carries exactly the formula's bytes and expert weights are never gathered
    under pure EP."""
    out, hlo = run_layout(mesh_spec)
    for mode in ("dropless", "capacity"):
        for got, want in zip(out[mode], one_device[0][mode]):
            assert_close(got, want)
        assert_close(out[mode][2], reference[mode][2])
    sizes = dict(sk.make_mesh(mesh_spec).shape)
    n = sizes["expert"]
    tokens = B * T // math.prod(v for a, v in sizes.items() if a != "tensor")  # per device
    traffic = traffic_from_hlo(hlo, sizes)
    a2a = [t for t in traffic if t.kind == "all-to-all"]
    assert {t.axes for t in a2a} == {("expert",)}
    # Dispatch + combine, forward + backward: 4 buffers of E x S rows of D f32 per mode.
    # Dropless S = the device's tokens; capacity S = groups x C = (tokens / T) x ceil(c·k·T/E).
    s_capacity = tokens // T * math.ceil(CAPACITY * K * T / E)
    expected = 4 * E * (tokens + s_capacity) * D * 4
    assert sum(t.count for t in a2a) == 8 and sum(t.bytes for t in a2a) == expected
    from shardkit.cost.analytic.from_shape import moe_traffic
    assert moe_traffic(tokens=tokens, d_model=D, experts=E, top_k=K, capacity_factor=CAPACITY,
                       group_size=T, bytes_per_element=4, axis_size=n) == 4 * E * s_capacity * D * 4
    if mesh_spec == "expert=8":
        assert not [t for t in traffic if t.kind == "all-gather"], traffic


# ---- ZeRO over expert weights --------------------------------------------------------------------

def test_zero_shards_expert_state_over_the_free_data_axes():
    mesh = sk.make_mesh("data=2,expert=4")
    plan = sk.Plan(mesh, rules=[(r"experts/", ("expert",)), (r".*", ())], zero=1,
                   batch_axes=("data", "expert"))
    params = {"experts": {"w1": jax.ShapeDtypeStruct((E, D, F), jnp.float32)},
              "router": jax.ShapeDtypeStruct((D, E), jnp.float32)}
    opt = jax.eval_shape(optax.adam(1e-3).init, params)
    rows = {r.path: r.spec for r in plan.opt_state_layouts(opt, params)}
    # Expert weights already use `expert`: ZeRO adds only `data`; the router gets both.
    assert rows["0/mu/experts/w1"] == P("expert", None, "data")
    assert rows["0/mu/router"] == P(("data", "expert"))
    assert plan.param_specs(params)["experts"]["w1"] == P("expert")
    # ZeRO-3 beside fsdp: the data axes join fsdp's dim (issue 36) but never the experts' dim,
    # where the batch-order reorder (fsdp before expert) made XLA permute the experts' blocks
    # into sk.moe's shard_map; the router, split over batch axes only, takes their order.
    plan3 = sk.Plan(sk.make_mesh("fsdp=2,expert=4"), rules=[(r"experts/", ("expert",)), (r".*", ())],
                    zero=3, batch_axes=("fsdp", "expert"))
    assert plan3.param_specs(params) == {"experts": {"w1": P("expert", None, "fsdp")},
                                         "router": P(("fsdp", "expert"))}


# ---- bad input ----------------------------------------------------------------------------------

def test_bad_input_names_the_shapes_and_the_fix():
    x, router, params, _ = inputs()
    logits = x @ router
    with pytest.raises(ValueError, match=r"7 experts do not split over the 'expert' axis of size 8"):
        with jax.set_mesh(sk.make_mesh("expert=8")):
            sk.moe(x, logits[..., :7], expert, jax.tree.map(lambda a: a[:7], params))
    with pytest.raises(ValueError, match=r"top_k=9 must be an integer in 1..E=8"):
        sk.moe(x, logits, expert, params, top_k=9)
    with pytest.raises(ValueError, match=r"(?s)leading dimension of E=8.*w1 shape=\(16, 32\)"):
        sk.moe(x, logits, expert, {"w1": params["w1"][0], "w2": params["w2"]})
    with pytest.raises(ValueError, match=r"router_logits has shape \(64, 8\).*needs \(8, 8\) \+ \(E,\)"):
        sk.moe(x, logits.reshape(-1, E), expert, params)
    with pytest.raises(ValueError, match=r"needs group_size"):
        sk.moe(x.reshape(-1, D), logits.reshape(-1, E), expert, params, capacity_factor=1.0)


# ---- constrain inside a building block -----------------------------------------------------------

def test_constrain_under_vmap_inside_an_all_manual_shard_map():
    """Regression: an expert function that constrains, vmapped inside a shard_map over every
    mesh axis, raised 'P(UNCONSTRAINED,) cannot contain P.UNCONSTRAINED'."""
    mesh = sk.make_mesh("expert=8")
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules={"mlp": "expert"})

    def body(x):
        return jax.vmap(lambda row: sk.constrain(row * 2, (None, "mlp")))(x)

    x = jnp.arange(8 * 4 * 8, dtype=jnp.float32).reshape(8, 4, 8)
    with plan.active():
        y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))(x)
    np.testing.assert_array_equal(y, 2 * x)


def test_nested_in_a_pipeline_beside_expert_and_tensor():
    """sk.moe in the stages of a 1F1B pipeline on pipe=2,expert=2,tensor=2 (both compiler-owned
    inside the stages; XLA's partitioner aborted on the combine's gather there before the slot
    buffers were kept whole): loss and gradients equal the un-pipelined stack on one device."""
    x, router, params, _ = inputs()
    layers = {"router": np.stack([router, router[::-1]]), **{k: np.stack([v, v[:, ::-1]]) for k, v in params.items()}}
    t = np.ones((B, T, D), np.float32)

    def layer(lp, h):  # the tokens split over `expert` too, as the recipe's batch is
        h, experts = sk.constrain(h, ("batch", None, None)), {k: lp[k] for k in params}
        return h + sk.moe(h, h @ lp["router"], expert, experts, top_k=K, capacity_factor=CAPACITY)[0]

    def mse(_, y, t):
        return jnp.mean((y - t) ** 2)

    def stacked(layers, x):
        for i in range(2):
            x = layer(jax.tree.map(lambda a, i=i: a[i], layers), x)
        return mse(None, x, t)

    mesh = sk.make_mesh("pipe=2,expert=2,tensor=2")
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules=sk.AxisRules({"mlp": "tensor", "batch": "expert"}))
    spec = {"router": P("pipe"), "w1": P("pipe", "expert", None, "tensor"), "w2": P("pipe", "expert", "tensor")}
    piped = jax.value_and_grad(lambda layers, x: sk.pipeline(layer, layers, x, microbatches=2, schedule="1f1b",
                                                             loss_fn=mse, loss_params=(), targets=t))
    with plan.active():
        got = jax.jit(piped)({k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in layers.items()}, x)
    assert_close(got, jax.jit(jax.value_and_grad(stacked))(layers, x))


# ---- the transformer recipe's MoE layers ----------------------------------------------------------

RECIPE_STEPS = 5


def recipe_cfg(**changes):
    from models.transformer.config import SIZES

    # 4 layers, MoE every 2nd (dense + MoE stacks), capacity that drops ~1/4 of assignments.
    return SIZES["test"].replace(**{"layers": 4, "moe_experts": 8, "moe_top_k": 2, "moe_every": 2,
                                    "moe_capacity": 1.0, **changes})


def recipe_model(cfg):
    """The model with numpy-drawn N(0, 0.02) weights (XLA's sampler would compile per shape)."""
    from flax import nnx

    from models.transformer.model import Transformer

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0.0, 0.02, x.shape).astype(np.float32)),
                         nnx.state(model, nnx.Param))
    nnx.update(model, state)
    return model


def recipe_train(layout, model, devices=None, compiled=True):
    """Losses and router statistics of RECIPE_STEPS steps; with ``compiled``, also the step's
    HLO and the state's shard bytes, for the cost model's comparison."""
    from models.transformer import data as data_lib
    from models.transformer.layouts import make_plan
    from models.transformer.model import PipelineSpec, moe_loss_fn
    from shardkit.explain import shard_bytes

    mesh = sk.make_mesh(layout.mesh, devices=devices)
    plan = make_plan(mesh, model.cfg, zero=layout.zero)
    pipe = PipelineSpec(4, layout.schedule, layout.repeats) if "pipe" in mesh.shape else None
    step = sk.train_step(plan, optax.adamw(3e-3, b2=0.95))(lambda m, b: moe_loss_fn(m, b, pipe))
    state = step.init(model)
    batches = data_lib.Batches(data_lib.stdlib_corpus(max_bytes=1 << 20)[0], 16, model.cfg.seq, seed=0)
    batch = next(batches)
    # The step's own program, lowered once: it runs the steps and its HLO is the one read (a
    # second lowering of the recipe's MoE step costs as much as the first). The test reads its
    # collectives and shard bytes (partitioning's), so it compiles with the emitters the tests
    # run with (AS_RUN): the same figures in fewer CPU seconds.
    program = step.lower(state, batch).compile(shardkit_test_compile.AS_RUN) if compiled else None
    losses, aux = [], None
    for _ in range(RECIPE_STEPS):
        if program is None:
            state, metrics = step(state, batch)
        else:
            state, metrics = program(state, step.place_batch(batch)[0])
        losses.append(float(metrics["loss"]))
        aux = metrics["aux"]
        batch = next(batches)
    if program is None:
        return np.array(losses), aux, None
    return np.array(losses), aux, {"hlo": program.as_text(), "mesh": dict(mesh.shape),
                                   "params": shard_bytes(state.params), "opt_state": shard_bytes(state.opt_state)}


@pytest.fixture(scope="module")
def recipe_reference():
    """One device; the router losses off, as under a pipeline (whose stages return activations
    only), so every EP layout, ep_pp included, is compared with the same run."""
    from models.transformer.layouts import Layout

    model = recipe_model(recipe_cfg(moe_aux_weight=0.0, moe_z_weight=0.0))
    return model, recipe_train(Layout("data=1"), model, devices=jax.devices()[:1], compiled=False)


@pytest.mark.parametrize("name", ["ep"] + [pytest.param(n, marks=pytest.mark.slow)
                                            for n in ("ep_dp", "ep_tp", "ep_fsdp", "ep_pp")])
def test_recipe_ep_layouts_match_one_device(name, recipe_reference):
    from models.transformer.layouts import LAYOUTS

    model, (ref, ref_aux, _) = recipe_reference
    losses, aux, compiled = recipe_train(LAYOUTS[name], model, compiled=name != "ep_pp")
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    if name == "ep_pp":  # the pipeline's stages return no router statistics
        return
    assert 0.05 < float(aux["moe/dropped_fraction"]) < 0.5  # the capacity drops
    np.testing.assert_allclose(aux["moe/tokens_per_expert"], ref_aux["moe/tokens_per_expert"], rtol=1e-5)
    np.testing.assert_allclose(aux["moe/dropped_fraction"], ref_aux["moe/dropped_fraction"], rtol=1e-5)
    # The analytic cost model against the compiled program: all-to-all bytes, and the
    # per-device parameter and optimizer-state bytes (expert weights split over `expert`,
    # ZeRO over the data axes they do not use) within 10%.
    from shardkit.cost.analytic.from_shape import estimate
    from shardkit.cost.terms import Layout as CostLayout

    sizes = compiled["mesh"]
    est = estimate(model.cfg, CostLayout(**sizes, zero=LAYOUTS[name].zero), "h100", global_batch=16,
                   precision="fp32")
    traffic = traffic_from_hlo(compiled["hlo"], sizes)
    a2a = sum(t.bytes for t in traffic if t.kind == "all-to-all")
    if name == "ep":  # pure EP: the experts stay where they are
        assert not [t for t in traffic if t.kind == "all-gather" and "expert" in t.axes], traffic
    assert a2a > 0 and est.collectives["expert-all-to-all"] == pytest.approx(a2a, rel=0.1)
    for kind in ("params", "opt_state"):
        assert est.memory[kind] == pytest.approx(compiled[kind], rel=0.1), kind


@pytest.fixture(scope="module")
def every_layer_moe_reference():
    """An MoE in every layer (4 layer groups: 2 stages x 2 chunks for interleaved 1F1B and ZB-V),
    the router losses off as under a pipeline, and its one-device losses."""
    from models.transformer.layouts import Layout

    model = recipe_model(recipe_cfg(moe_every=1, moe_aux_weight=0.0, moe_z_weight=0.0))
    return model, recipe_train(Layout("data=1"), model, devices=jax.devices()[:1])[0]


@pytest.mark.extended  # default lane: test_nested_in_a_pipeline_beside_expert_and_tensor (1F1B)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v"])
def test_recipe_pipe_expert_tensor_matches_one_device(schedule, every_layer_moe_reference):
    """MoE with TP inside the experts, in every explicit pipeline schedule (pipe=2,expert=2,
    tensor=2: two compiler-owned axes beside the pipe axis, refused before issue 37; sk.moe
    nested there keeps its slot buffers whole, as XLA's partitioner aborts on the combine's
    gather otherwise, and its routing whole, which XLA:TPU otherwise permuted inside the
    per-stage branch: target_sweep's ep_tp_pp): the same losses as one device."""
    import dataclasses

    from models.transformer.layouts import LAYOUTS

    model, ref = every_layer_moe_reference
    layout = dataclasses.replace(LAYOUTS["ep_tp_pp"], schedule=schedule,
                                 repeats=2 if schedule == "interleaved-1f1b" else 1)
    losses, _, _ = recipe_train(layout, model)
    np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=schedule)


def test_recipe_moe_config_counts_and_errors():
    from models.transformer.model import flops_per_token, param_count

    cfg = recipe_cfg()
    dense = cfg.replace(moe_experts=0)
    D, F, E = cfg.d_model, cfg.d_ff, cfg.moe_experts
    # Two MoE layers: E experts' weights and a router each; flops count k active experts.
    assert param_count(cfg) - param_count(dense) == 2 * ((E - 1) * 3 * D * F + D * E)
    assert flops_per_token(cfg) - flops_per_token(dense) == 6 * 2 * ((K - 1) * 3 * D * F + D * E)
    assert sum(x.size for x in jax.tree.leaves(nnx_params(recipe_model(cfg)))) == param_count(cfg)
    with pytest.raises(ValueError, match="moe_top_k=9 must be in 1..moe_experts=8"):
        cfg.replace(moe_top_k=9)
    with pytest.raises(ValueError, match="moe_every=3 must be a positive divisor of layers=4"):
        cfg.replace(moe_every=3)


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


GOLDEN_EP = {"ep": "expert=8", "ep_dp": "data=2,expert=4", "ep_tp": "expert=4,tensor=2",
             "ep_fsdp": "fsdp=2,expert=4", "ep_pp": "expert=4,pipe=2"}


@pytest.mark.parametrize("name", sorted(GOLDEN_EP))
def test_recipe_golden_sharding(name):
    """Every parameter's spec of a ~125M-wide MoE (8 experts every 2nd layer), from abstract
    params; regenerate deliberate changes with SHARDKIT_UPDATE_GOLDEN=1."""
    import json
    import os
    import pathlib

    from models.transformer.config import SIZES
    from models.transformer.layouts import make_plan
    from models.transformer.model import abstract_model

    cfg = SIZES["125m"].replace(moe_experts=8, moe_every=2)
    model = abstract_model(cfg)
    plan = make_plan(sk.make_mesh(GOLDEN_EP[name]), cfg)
    specs = jax.tree_util.tree_flatten_with_path(plan.param_specs(model), is_leaf=lambda x: isinstance(x, P))[0]
    shapes = jax.tree.leaves(nnx_params(model))
    got = {"/".join(str(getattr(k, "key", k)) for k in path): [list(leaf.shape), [list(e) if isinstance(e, tuple) else e for e in spec]]
           for (path, spec), leaf in zip(specs, shapes)}
    path = pathlib.Path(__file__).parent / "golden" / f"transformer_moe_125m_{name}.json"
    if os.environ.get("SHARDKIT_UPDATE_GOLDEN"):
        rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in got.items())
        path.write_text(f'{{"mesh": {json.dumps(GOLDEN_EP[name])}, "params": {{\n{rows}\n}}}}\n')
    assert got == json.loads(path.read_text())["params"], (
        f"sharding of the 125M MoE transformer under {name} changed; if deliberate, regenerate with "
        "SHARDKIT_UPDATE_GOLDEN=1")
