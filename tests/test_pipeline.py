"""Pipelines equal the un-pipelined layer stack: loss, gradients and outputs, every schedule.

Shapes are tiny (d=8, batch 16) and each compile costs about a CPU second, so the file keeps
one compiled program per thing it checks: the full p x m x schedule cross-product on pipe-only
meshes runs with ``--extended``; the default lane keeps m = p and m = 2p per schedule
(tests/conftest.py names what covers each extended case), the data / tensor layouts on one m
each. The new schedules' sweeps (interleaved 1F1B, ZB-H1) keep one case each in the fast lane;
the schedule tables themselves are checked without devices in test_pipeline_schedules.py.
The one-device references are computed once per problem (``sequential_reference``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardkit as sk
from shardkit.pipeline import schedules as sched
from shardkit.mesh import make_mesh
from shardkit.pipeline import pipeline

D, B, OUT = 8, 16, 3
RTOL = 1e-5
SCHEDULES = [("gpipe", 1), ("circular", 2), ("1f1b", 1)]
NEW_SCHEDULES = [("zb-h1", 1), ("interleaved-1f1b", 2), ("zb-v", 2)]


def layer(lp, h_BxD):
    return jnp.tanh(h_BxD @ lp["w"] + lp["b"][None])


def head_loss(hp, y_BxD, t_BxO):
    return jnp.mean((y_BxD @ hp["w"] - t_BxO) ** 2)


@functools.lru_cache(maxsize=None)
def make_problem(n_layers, seed=0):
    """The layers' params, the head, inputs and targets: one problem per (n_layers, seed) for the
    whole file (built once: each eager op on a new shape is a compile on 8 devices)."""
    k = jax.random.split(jax.random.key(seed), 5)
    params = {"w": jax.random.normal(k[0], (n_layers, D, D)) / np.sqrt(D),
              "b": 0.1 * jax.random.normal(k[1], (n_layers, D))}
    head = {"w": jax.random.normal(k[2], (D, OUT)) / np.sqrt(D)}
    x = jax.random.normal(k[3], (B, D))
    t = jax.random.normal(k[4], (B, OUT))
    return params, head, x, t


def sequential(params, x):
    return jax.lax.scan(lambda h, lp: (layer(lp, h), None), x, params)[0]


def sequential_loss(params, head, x, t):
    return head_loss(head, sequential(params, x), t)


@functools.lru_cache(maxsize=None)
def sequential_reference(n_layers, seed=0):
    """The un-pipelined model's loss and (params, head, x) gradients on ``make_problem``, as numpy:
    one jitted program per problem, shared by every schedule and layout checked against it."""
    params, head, x, t = make_problem(n_layers, seed)
    got = jax.jit(jax.value_and_grad(sequential_loss, argnums=(0, 1, 2)))(params, head, x, t)
    return jax.tree.map(np.asarray, got)


def assert_close(got, want, rtol=RTOL):
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = np.asarray(_at(want, path))
        err = np.max(np.abs(np.asarray(g) - w)) / max(np.max(np.abs(w)), 1e-30)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol}"


def _at(tree, path):
    for key in path:
        tree = tree[key.key if hasattr(key, "key") else key.idx]
    return tree


def check_against_sequential(mesh, p, m, schedule, v, params_sharding=None):
    n_layers = 2 * p * v
    params, head, x, t = make_problem(n_layers)
    want_loss, want_grads = sequential_reference(n_layers)
    if params_sharding is not None:
        params = jax.device_put(params, params_sharding)

    def loss(params, head, x):
        return pipeline(layer, params, x, microbatches=m, schedule=schedule, repeats=v,
                        loss_fn=head_loss, loss_params=head, targets=t, mesh=mesh)

    got_loss, got_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, head, x)
    assert_close(got_loss, want_loss)
    assert_close(got_grads, want_grads)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("mult", [1, 2, 4])
@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_loss_and_grads_match_sequential(devices, p, mult, schedule, v):
    mesh = make_mesh(f"pipe={p}", devices=devices[:p])
    check_against_sequential(mesh, p, mult * p, schedule, v)


def _lane(fast, *args):
    # ZB-V's sweep cases (issue 25) beyond its default-lane ones go to --extended: the suite's
    # time budget; the split backward and the V's routes each keep a default-lane case.
    slow = pytest.mark.extended if "zb-v" in args else pytest.mark.slow
    return pytest.param(*args, marks=() if fast else slow)


@pytest.mark.parametrize("p,mult,schedule,v", [
    _lane((p, mult) == (4, 2), p, mult, schedule, v)
    for schedule, v in NEW_SCHEDULES for p in (2, 4) for mult in (1, 2, 4)])
def test_new_schedules_match_sequential(devices, p, mult, schedule, v):
    """ZB-H1 (split B/W backward) and interleaved 1F1B: loss and gradients equal the model's."""
    mesh = make_mesh(f"pipe={p}", devices=devices[:p])
    check_against_sequential(mesh, p, mult * p, schedule, v)


# A table the layer closes over (as the recipe's layers close over RoPE's cos/sin): it varies
# over no manual axis, and a checkpoint policy keeps it as a residual of the layer.
TABLE = jnp.cos(jnp.arange(D, dtype=jnp.float32))


def table_layer(lp, h_BxD):
    return jnp.tanh((h_BxD * TABLE[None]) @ lp["w"] + lp["b"][None])


@functools.lru_cache(maxsize=None)
def table_reference(n_layers):
    """``sequential_reference`` for ``table_layer``."""
    def loss(params, head, x, t):
        return head_loss(head, jax.lax.scan(lambda h, lp: (table_layer(lp, h), None), x, params)[0], t)

    return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*make_problem(n_layers)))


def lean_table_layer(lp, h_BxD):
    """``table_layer`` with its matmul output named for ``keep="lean"``: the tanh and the
    bias add are recomputed from it, the scaled input from the stage input."""
    z_BxD = checkpoint_name((h_BxD * TABLE[None]) @ lp["w"], "mlp_up")
    return jnp.tanh(z_BxD + lp["b"][None])


@pytest.mark.parametrize("schedule,v,keep", [
    (s, v, k) for s, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))
    for k in ("input", "all", "dots" if s != "1f1b" else jax.checkpoint_policies.dots_saveable, "lean")])
def test_kept_residuals_match_sequential(devices, schedule, v, keep):
    """keep= (the stage input, every residual, a checkpoint policy's saved set, or the values
    named ``sk.LEAN_RESIDUALS``, from F to its B/BW): loss and gradients equal the model's, for
    a layer that closes over a constant table the policy keeps (ZB's B re-binds its layers'
    recompute on the copy read back from the ring, which varies over the manual axes where the
    table did not)."""
    params, head, x, t = make_problem(4 * v)
    want = table_reference(4 * v)
    mesh = make_mesh("pipe=2", devices=devices[:2])
    stage = lean_table_layer if keep == "lean" else table_layer
    got = jax.jit(jax.value_and_grad(
        lambda params, head, x: pipeline(stage, params, x, microbatches=4, schedule=schedule, repeats=v,
                                         keep=keep, loss_fn=head_loss, loss_params=head, targets=t, mesh=mesh),
        argnums=(0, 1, 2)))(params, head, x)
    assert_close(got, want)


def test_kept_residuals_remove_the_recompute(devices):
    """1F1B's compiled program (CPU, pipe=2, m=4): with the residuals kept (all, or the matmul
    outputs, or the ones named ``sk.LEAN_RESIDUALS`` and each layer's input) the backward op
    runs no forward matmul —
    the matmul flops are exactly F + 2F of the layers and the head, per device — and the
    temporaries grow with what is kept: input < dots < all."""
    from shardkit.cost.compiled.hlo import matmul_flops_from_hlo
    from shardkit.cost.pipeline_note import pipeline_branch_weights

    d, rows = 64, 64
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (4, d, d)) / np.sqrt(d), "b": jnp.zeros((4, d))}
    head = {"w": jax.random.normal(k[1], (d, OUT)) / np.sqrt(d)}
    x, t = jax.random.normal(k[2], (rows, d)), jax.random.normal(k[3], (rows, OUT))
    mesh = make_mesh("pipe=2", devices=devices[:2])
    weights = pipeline_branch_weights({"schedule": "1f1b", "stages": 2, "microbatches": 4})
    flops, temp = {}, {}
    def lean_layer(lp, h_BxD):  # two matmuls, the second's output (the next layer's input) not named
        return h_BxD + jnp.tanh(checkpoint_name(h_BxD @ lp["w"], "mlp_up") + lp["b"][None]) @ lp["w"]

    for keep in ("input", "dots", "all", "lean"):
        stage = lean_layer if keep == "lean" else layer
        compiled = jax.jit(jax.grad(
            lambda params, head: pipeline(stage, params, x, microbatches=4, schedule="1f1b", keep=keep,
                                          loss_fn=head_loss, loss_params=head, targets=t, mesh=mesh),
            argnums=(0, 1))).lower(params, head).compile()
        flops[keep] = matmul_flops_from_hlo(compiled.as_text(), weights)
        temp[keep] = compiled.memory_analysis().temp_size_in_bytes
    m, per_stage = 4, 2  # 4 layers on 2 stages; the head on one stage of two
    forward = m * per_stage * 2 * (rows // m) * d * d + m * 2 * (rows // m) * d * OUT / 2
    assert flops["all"] == flops["dots"] == 3 * forward
    # lean: each layer's input is kept too (the pipeline's layer scan names it), so the
    # second layer of a stage does not rebuild it through the first one's matmuls
    assert flops["lean"] == 3 * (forward + m * per_stage * 2 * (rows // m) * d * d)
    assert flops["input"] > 3 * forward  # the recompute (XLA:CPU keeps part of it)
    assert temp["input"] < temp["dots"] < temp["all"], temp


@pytest.mark.parametrize("mesh_spec,schedule,v", [
    _lane(fast, spec, schedule, v) for schedule, v in NEW_SCHEDULES
    for spec, fast in (("data=2,pipe=4", schedule == "zb-h1"), ("pipe=4,tensor=2", False),
                       ("data=2,pipe=2,tensor=2", schedule == "interleaved-1f1b"))])
def test_new_schedules_beside_data_and_tensor(devices, mesh_spec, schedule, v):
    """Data axes manual beside pipe, stage weights sharded over a compiler-managed `tensor`."""
    mesh = make_mesh(mesh_spec, devices=devices)
    p = mesh.shape["pipe"]
    sharding = None
    if "tensor" in mesh_spec:
        sharding = {"w": NamedSharding(mesh, P("pipe", None, "tensor")),
                    "b": NamedSharding(mesh, P("pipe", "tensor"))}
    check_against_sequential(mesh, p, 2 * p, schedule, v, params_sharding=sharding)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_with_data_axis(devices, schedule, v):
    check_against_sequential(make_mesh("data=2,pipe=4", devices=devices), 4, 8, schedule, v)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_with_tensor_parallel_stage(devices, schedule, v):
    """Stage weights sharded over `tensor` (compiler-managed inside the pipe-manual shard_map)."""
    mesh = make_mesh("pipe=4,tensor=2", devices=devices)
    sharding = {"w": NamedSharding(mesh, P("pipe", None, "tensor")), "b": NamedSharding(mesh, P("pipe", "tensor"))}
    check_against_sequential(mesh, 4, 4, schedule, v, params_sharding=sharding)


def test_explicit_schedule_beside_two_compiler_owned_axes(devices):
    """1F1B over pipe with `context` and `tensor` both left to the compiler (issue 37: refused
    before, as XLA's partitioner aborted on the loss's gather, docs/upstream/): the stage splits
    rows over `context` and the weights' columns over `tensor`, the loss's logits both ways,
    and the loss, gradients and inputs' gradient equal the un-pipelined model's. The recipe on
    this mesh, every explicit schedule: tests/test_transformer.py (extended)."""
    mesh = make_mesh("pipe=2,context=2,tensor=2", devices=devices)
    params, head, x, _ = make_problem(4)
    head = {"w": jnp.tile(head["w"], (1, 2))}  # 6 classes
    labels = jnp.arange(B, dtype=jnp.int32) % 6
    def ce(hp, y_BxD, t_B, split=lambda a, *rest: a):
        return jnp.mean(sk.kernels.cross_entropy(split(y_BxD @ hp["w"], "tensor"), t_B))

    def loss(params, head, x, run):
        if not run:
            return ce(head, sequential(params, x), labels)
        rows = lambda a, *rest: jax.lax.with_sharding_constraint(a, P("context", *rest))  # noqa: E731
        return pipeline(lambda lp, h: rows(layer(lp, rows(h, None)), None), params, x, microbatches=2,
                        schedule="1f1b", loss_fn=functools.partial(ce, split=rows), loss_params=head,
                        targets=labels, mesh=mesh)

    sharding = {"w": NamedSharding(mesh, P("pipe", None, "tensor")), "b": NamedSharding(mesh, P("pipe", "tensor"))}
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(grad, run=True))(jax.device_put(params, sharding), head, x)
    assert_close(got, jax.jit(functools.partial(grad, run=False))(params, head, x))


def test_circular_more_repeats(devices):
    check_against_sequential(make_mesh("pipe=2", devices=devices[:2]), 2, 2, "circular", 4)


@pytest.mark.parametrize("schedule,v", SCHEDULES[:2])
@pytest.mark.parametrize("mult", [1, 2])
def test_output_matches_sequential(devices, schedule, v, mult):
    p = 4
    mesh = make_mesh(f"pipe={p}", devices=devices[:p])
    params, _, x, _ = make_problem(2 * p * v)
    got = jax.jit(lambda params, x: pipeline(layer, params, x, microbatches=mult * p, schedule=schedule,
                                             repeats=v, mesh=mesh))(params, x)
    assert_close(got, jax.jit(sequential)(params, x))


def noisy_layer(lp, h_BxD, *, extras, rng):
    keep_BxD = jax.random.bernoulli(rng, 0.8, h_BxD.shape)
    return jnp.where(keep_BxD, layer(lp, h_BxD), 0.0) * extras["mask_B"][:, None]


EXTRAS_P, EXTRAS_M, EXTRAS_KEY = 2, 8, 7  # a tick's activations (k layers x 2 rows x D) < one D x D weight


def extras_problem():
    params, head, x, t = make_problem(4)
    return params, head, x, t, (jnp.arange(B) % 3 != 0).astype(jnp.float32), jax.random.key(EXTRAS_KEY)


@functools.lru_cache(maxsize=None)
def extras_reference():
    """The per-microbatch loop the pipeline must equal (microbatch i holds rows i, i+m, ...; the
    key folded with the global layer, then the microbatch): loss and gradients, one jitted
    program for every schedule."""
    params, head, x, t, mask, key = extras_problem()
    m = EXTRAS_M

    def microbatches(a):  # (m, B / m, ...): microbatch i is the rows i, i+m, ... (a[i::m])
        return a.reshape(B // m, m, *a.shape[1:]).swapaxes(0, 1)

    def reference(params, head, x):
        def one_microbatch(i, h, mask_b, t_b):
            for l in range(4):
                k = jax.random.fold_in(jax.random.fold_in(key, l), i)
                h = noisy_layer(jax.tree.map(lambda a: a[l], params), h, extras={"mask_B": mask_b}, rng=k)
            return head_loss(head, h, t_b)
        return jnp.mean(jax.vmap(one_microbatch)(jnp.arange(m), microbatches(x), microbatches(mask),
                                                 microbatches(t)))

    return jax.tree.map(np.asarray, jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(params, head, x))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), _lane(False, "zb-h1", 1),
                                        _lane(False, "interleaved-1f1b", 2)])
def test_extras_and_rng(devices, schedule, v):
    """extras are split like x; the key is folded with the global layer, then the microbatch."""
    mesh = make_mesh(f"pipe={EXTRAS_P}", devices=devices[:EXTRAS_P])
    params, head, x, t, mask, key = extras_problem()

    def loss(params, head, x):
        return pipeline(noisy_layer, params, x, microbatches=EXTRAS_M, schedule=schedule, repeats=v,
                        loss_fn=head_loss, loss_params=head, targets=t, extras={"mask_B": mask},
                        rng=key, mesh=mesh)

    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, head, x)
    assert_close(got, extras_reference())


@pytest.mark.parametrize("remat,schedule", [("full", "gpipe"), ("dots", "circular")])
def test_remat(devices, remat, schedule):
    mesh = make_mesh("pipe=2", devices=devices[:2])
    params, head, x, t = make_problem(4)
    want_loss, want_grads = sequential_reference(4)
    want = (want_loss, want_grads[:2])
    got = jax.jit(jax.value_and_grad(
        lambda params, head: pipeline(layer, params, x, microbatches=2, schedule=schedule, remat=remat,
                                      loss_fn=head_loss, loss_params=head, targets=t, mesh=mesh),
        argnums=(0, 1)))(params, head)
    assert_close(got, want)


def test_a_self_checkpointing_layer_is_not_wrapped_again(devices):
    """A layer under its own ``jax.checkpoint`` (a recipe's remat="full") keeps only its inputs
    inside the stage: wrapped again by the stage's save-all checkpoint it saved every
    intermediate (the outer policy reaches into the nested checkpoint). Exact on circular,
    whose chunk then recomputes (the per-tick slice of its groups is not saved)."""
    from jax._src.ad_checkpoint import saved_residuals

    from shardkit.pipeline.stage import chunk_runner, layer_facts

    own = jax.checkpoint(layer)
    params, head, x, t = make_problem(4)
    one = jax.tree.map(lambda a: a[0], params)
    assert layer_facts(own, one, x)[0] and not layer_facts(layer, one, x)[0]
    stack = jax.tree.map(lambda a: a[None, :2], params)  # (v=1, k=2, ...)
    chunk = chunk_runner(own, 2, False, None, "none", own_remat=True)
    res = saved_residuals(lambda P_, h: chunk(P_, 0, h, 0, 0, None), stack, x)
    assert sorted(tuple(a.shape) for a, where in res if "argument" not in where) == [(2, D), (2, D, D), (2, B, D)]
    mesh = make_mesh("pipe=2", devices=devices[:2])
    want_loss, want_grads = sequential_reference(4)
    want = (want_loss, want_grads[:2])
    got = jax.jit(jax.value_and_grad(
        lambda params, head: pipeline(own, params, x, microbatches=2, schedule="circular", repeats=2,
                                      loss_fn=head_loss, loss_params=head, targets=t, mesh=mesh),
        argnums=(0, 1)))(params, head)
    assert_close(got, want)


@pytest.mark.parametrize("schedule,v", [pytest.param("interleaved-1f1b", 2, marks=pytest.mark.extended), ("zb-v", 2)])
def test_stage_major_storage(devices, schedule, v):
    """Layers stored as the schedule reads them (``layer_order="stage-major"``): the same loss,
    and the gradients in the stored order; the helpers convert either way."""
    p = 2
    mesh = make_mesh(f"pipe={p}", devices=devices[:p])
    params, head, x, t = make_problem(2 * p * v)
    stored = sk.pipeline_layers_stage_major(params, p, schedule, v)
    assert np.array_equal(sk.pipeline_layer_order(8, p, schedule, v),
                          [0, 1, 6, 7, 2, 3, 4, 5] if schedule == "zb-v" else [0, 1, 4, 5, 2, 3, 6, 7])
    assert_close(sk.pipeline_layers_natural(stored, p, schedule, v), params, rtol=0)
    want_loss, (want_grads, _, _) = sequential_reference(2 * p * v)
    got_loss, got_grads = jax.jit(jax.value_and_grad(
        lambda w: pipeline(layer, w, x, microbatches=2 * p, schedule=schedule, repeats=v, loss_fn=head_loss,
                           loss_params=head, targets=t, mesh=mesh, layer_order="stage-major")))(stored)
    assert_close(got_loss, want_loss)
    assert_close(sk.pipeline_layers_natural(got_grads, p, schedule, v), want_grads)


def test_errors(devices):
    mesh = make_mesh("data=2,pipe=4", devices=devices)
    params, head, x, t = make_problem(8)
    run = lambda **kw: pipeline(layer, **{"stage_params": params, "x": x, "microbatches": 4,  # noqa: E731
                                          "mesh": mesh, **kw})
    cases = [
        (dict(microbatches=2), "microbatches >= 4"),
        (dict(x=x[:12]), "multiple of 8"),
        (dict(stage_params=jax.tree.map(lambda a: a[:6], params)), "multiple of 4"),
        (dict(schedule="circular", repeats=3), "multiple of 12"),
        (dict(axis="stage"), "not in the mesh"),
        (dict(schedule="1f1b"), "needs loss_fn"),
        (dict(schedule="zigzag"), "unknown pipeline schedule"),
        (dict(remat="some"), "unknown remat"),
        (dict(repeats=2), "needs schedule='circular'"),
        (dict(schedule="zb-h1"), "needs loss_fn"),
        (dict(schedule="interleaved-1f1b", repeats=2, microbatches=6, x=x[:12], loss_fn=head_loss,
              loss_params=head, targets=t[:12]), "multiple of 4"),
    ]
    explicit = dict(schedule="1f1b", loss_fn=head_loss, loss_params=head, targets=t)
    cases += [
        (dict(keep="everything", **explicit), "unknown keep 'everything'.*'input', 'all', 'dots'"),
        (dict(keep=3, **explicit), "keep must be one of"),
        (dict(keep="all"), "keep='all' is for the explicit schedules"),
        (dict(keep="dots", remat="full", **explicit), "keep='dots' with remat='full'"),
        # a layer that names nothing would keep nothing and recompute all: said, not run
        (dict(keep="lean", **explicit), "keep='lean' keeps the values.*names none of them"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            run(**kw)
    with pytest.raises(ValueError, match="data-like mesh axes"):
        run(batch_axes=("pipe",))
    with pytest.raises(ValueError, match="with rng"):
        run(batch_axes="data", rng=jax.random.key(0))
    with pytest.raises(ValueError, match="keep the microbatch shape"):
        pipeline(lambda lp, h: h[:, :4], params, x, microbatches=4, mesh=mesh)
    with pytest.raises(ValueError, match="no mesh"):
        pipeline(layer, params, x, microbatches=4)


def _train_losses(mesh_spec, devices, schedule, v, zero, steps=10):
    mesh = make_mesh(mesh_spec, devices=devices)
    plan = sk.Plan(mesh, rules=sk.PathRules([(r"layers", ("pipe",)), (r".*", ())]), zero=zero)
    params, head, x, t = make_problem(8 * v, seed=1)

    @sk.train_step(plan, optax.sgd(0.1))
    def step(model, batch):
        return pipeline(layer, model["layers"], batch["x"], microbatches=4, schedule=schedule, repeats=v,
                        loss_fn=head_loss, loss_params=model["head"], targets=batch["t"])

    state = step.init({"layers": params, "head": head})
    losses = []
    for i in range(steps):
        batch = {"x": jnp.roll(x, i, axis=0), "t": jnp.roll(t, i, axis=0)}
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@functools.lru_cache(maxsize=None)
def _one_device_losses(schedule, v):
    """The pipe=1 run a schedule's layouts are compared with: the same for each of its layouts."""
    return _train_losses("pipe=1", jax.devices()[:1], schedule, v, 0)


@pytest.mark.parametrize("mesh_spec,schedule,v,zero", [
    ("pipe=4", "1f1b", 1, 0),
    ("data=2,pipe=4", "circular", 2, 1),
    ("data=2,pipe=4", "1f1b", 1, 1),
    ("data=2,pipe=4", "gpipe", 1, 3),  # ZeRO-3 params gathered at the pipeline boundary
    ("data=2,pipe=4", "zb-h1", 1, 1),
    ("data=2,pipe=4", "zb-h1", 1, 3),
    _lane(False, "data=2,pipe=4", "interleaved-1f1b", 2, 1),
    ("data=2,pipe=4", "interleaved-1f1b", 2, 3),
])
def test_train_step_matches_one_device(devices, mesh_spec, schedule, v, zero):
    """10 SGD steps through sk.train_step (mesh found via jax.set_mesh) equal a pipe=1 run."""
    n = 8 if "data" in mesh_spec else 4
    got = _train_losses(mesh_spec, devices[:n], schedule, v, zero)
    want = _one_device_losses(schedule, v)
    assert got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=RTOL)


def data_pipe_step(devices, zero, schedule, v, m):
    """A train step on data=2,pipe=4 pipelining 8·v layers with the head's loss inside."""
    mesh = make_mesh("data=2,pipe=4", devices=devices)
    plan = sk.Plan(mesh, rules=[(r"layers", ("pipe",)), (r".*", ())], zero=zero)
    problem = params, head, _, _ = make_problem(4 * 2 * v)

    @sk.train_step(plan, optax.sgd(0.1))
    def step(model, batch):
        return pipeline(layer, model["layers"], batch["x"], microbatches=m, schedule=schedule, repeats=v,
                        loss_fn=head_loss, loss_params=model["head"], targets=batch["t"])

    return step, step.init({"layers": params, "head": head}), problem


@pytest.mark.parametrize("schedule,v", SCHEDULES + [_lane(False, *sv) for sv in NEW_SCHEDULES])
def test_stage_grads_reduced_over_data_once_per_step(devices, schedule, v, older_emitters_ahead_of_time):
    """On data=2,pipe=4 the compiled step all-reduces the gradients over `data` once, after the
    pipeline loop: about (stage params + head) bytes per device, not ticks x the stage (which
    is what a compiler-managed data axis gives: a reduction on every tick / backward op)."""
    m = 8
    step, state, (params, head, x, t) = data_pipe_step(devices, 1, schedule, v, m)
    batch = {"x": x, "t": t}
    report = step.explain(state, batch)
    stage_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) // 4
    head_bytes = sum(a.nbytes for a in jax.tree.leaves(head))
    over_data = [tr for tr in report.traffic if tr.kind == "all-reduce" and "data" in tr.axes]
    reduced = sum(tr.operand_bytes for tr in over_data)
    assert stage_bytes + head_bytes <= reduced <= 1.25 * (stage_bytes + head_bytes) + 64, over_data
    assert sum(tr.count for tr in over_data) <= 2, over_data  # O(1) ops, not O(ticks)
    ticks = sched.forward_table(4, m, v).item.shape[0] if schedule not in sched.EXPLICIT else m
    assert ticks * stage_bytes / v > 3 * reduced  # the per-tick figure this test rules out
    # The loss still equals the un-pipelined model's.
    _, metrics = step(state, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(sequential_reference(4 * 2 * v)[0]), rtol=RTOL)


@pytest.mark.parametrize("schedule,v", [("zb-h1", 1), _lane(False, "gpipe", 1), _lane(False, "1f1b", 1),
                                        _lane(False, "interleaved-1f1b", 2)])
def test_zero3_stage_weights_gathered_once_per_step(devices, schedule, v, older_emitters_ahead_of_time):
    """ZeRO-3 stage weights (sharded over `data`) are all-gathered at the pipeline's shard_map
    boundary: one stage's weights (+ the head) per step in the compiled program, never per
    microbatch or tick (m = 8 here: a per-microbatch gather would be 8x)."""
    step, state, (params, head, x, t) = data_pipe_step(devices, 3, schedule, v, 8)
    report = step.explain(state, {"x": x, "t": t})
    stage_bytes = sum(a.nbytes for a in jax.tree.leaves(params)) // 4
    head_bytes = sum(a.nbytes for a in jax.tree.leaves(head))
    gathers = [tr for tr in report.traffic if tr.kind == "all-gather" and "data" in tr.axes]
    gathered = sum(tr.bytes for tr in gathers)  # result bytes: the whole gathered weights
    assert stage_bytes <= gathered <= stage_bytes + head_bytes, gathers
    assert sum(tr.count for tr in gathers) <= 3, gathers  # one per leaf, not per tick


def test_constrain_inside_a_stage_skips_the_manual_pipe_axis(devices):
    """sk.constrain in a stage function (inside the pipe shard_map) constrains only the
    compiler-managed axes and leaves the result unchanged: the un-pipelined model's loss."""
    mesh = make_mesh("data=2,pipe=4", devices=devices[:8])
    plan = sk.Plan(mesh, rules=[(r"layers", ("pipe",)), (r".*", ())], axis_rules={"batch": ("data", "pipe")})
    params, head, x, t = make_problem(8, seed=1)

    def constrained_layer(lp, h_BxD):
        return layer(lp, sk.constrain(h_BxD, ("batch", None)))

    def loss(model, batch):
        return pipeline(constrained_layer, model["layers"], batch["x"], microbatches=4, schedule="gpipe",
                        loss_fn=head_loss, loss_params=model["head"], targets=batch["t"])

    step = sk.train_step(plan, optax.sgd(0.1))(loss)
    state = step.init({"layers": params, "head": head})
    state, m = step(state, {"x": x, "t": t})
    np.testing.assert_allclose(float(m["loss"]), float(sequential_reference(8, seed=1)[0]), rtol=RTOL)


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("circular", 2)])
def test_weights_are_not_saved_per_tick(devices, schedule, v):
    """Autodiff of the tick loop saves activations per tick, never the layer's weights or what
    it derives from them (here a reshape): circular slices its layer group per tick, and a
    saved slice would cost one copy of the group per tick."""
    from jax._src.ad_checkpoint import saved_residuals

    p, m = 2, 8  # a tick's activations (k layers x 2 rows x D) stay smaller than one D x D weight
    mesh = make_mesh(f"pipe={p}", devices=devices[:p])
    params, _, x, _ = make_problem(4)

    def reshaping_layer(lp, h_BxD):
        w = lp["w"].reshape(D, 2, D // 2)
        return jnp.tanh(jnp.einsum("bd,dhq->bhq", h_BxD, w).reshape(h_BxD.shape) + lp["b"][None])

    def loss(params):
        y = pipeline(reshaping_layer, params, x, microbatches=m, schedule=schedule, repeats=v, mesh=mesh)
        return jnp.sum(y ** 2)

    ticks = len(sched.forward_table(p, m, v).item)
    per_tick = [a.str_short() for a, _ in saved_residuals(loss, params)
                if a.ndim and a.shape[0] == p * ticks and a.size // a.shape[0] >= D * D]
    assert not per_tick, per_tick
    want = jax.jit(jax.grad(lambda params: jnp.sum(jax.lax.scan(
        lambda h, lp: (reshaping_layer(lp, h), None), x, params)[0] ** 2)))(params)
    assert_close(jax.jit(jax.grad(loss))(params), want)


def test_kept_residual_rings_and_pictures():
    """The kept-residual ring holds the most chunk-microbatches in flight (F to B/BW) on a
    stage: 1F1B's p on its first stage; the picture marks the ops that recompute the forward."""
    one = sched.pipeline_schedule("1f1b", 4, 8)
    assert one.res_ring == 4 and one.loss_res_ring == 1
    zb = sched.pipeline_schedule("zb-h1", 2, 2)
    assert zb.picture("input").splitlines()[1].split() == ["stage", "0:", "F0", "F1", ".", "B0*", "W0", "B1*", "W1"]
    assert zb.picture("dots").splitlines()[2].split()[4] == "B0~"
    assert "*" not in zb.picture("all") and "~" not in zb.picture("all")


def _tick_scan_carry(closed) -> list:
    """The avals of the explicit executor's tick scan carry (the scan whose body holds the
    per-tick switch), found anywhere in a traced program."""
    def scans(jaxpr):
        for eqn in jaxpr.eqns:
            body = eqn.params.get("jaxpr") if eqn.primitive.name == "scan" else None
            if body is not None and any(e.primitive.name == "cond" for e in body.jaxpr.eqns):
                start = eqn.params["num_consts"]
                yield [v.aval for v in body.jaxpr.invars[start:start + eqn.params["num_carry"]]]
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        yield from scans(inner)

    (carry,) = list(scans(closed.jaxpr))
    return carry


@pytest.mark.parametrize("keep", ["all", "dots"])
def test_the_chunked_loss_keeps_its_own_residuals_in_the_loss_ring(devices, keep):
    """Issue 37: with residuals kept the loss's F keeps its pullback's residuals in the loss ring
    (``Schedule.loss_res_ring`` slots, on every stage; the executor's scan carry ends with it).
    For ``sk.chunked_cross_entropy`` that is what its custom VJP keeps, per device (rows over
    ``data``): the hidden states, the labels and each position's log-sum-exp as (chunks, rows,
    positions per chunk) f32 — not the (rows, T, V) logits the chunking exists to avoid; the
    output matrix is not stored (the backward op has it again). Under ``keep="dots"`` too: the
    policy reached into the loss's forward and kept every chunk's f32 logits instead of the
    log-sum-exp (``Kept.loss_shapes`` keeps whichever stores less). Traced, not compiled."""
    D_, T, V, rows, chunk, m = 8, 8, 32, 8, 4, 4
    mesh = make_mesh("data=2,pipe=2", devices=devices[:4])
    params, head = {"w": jnp.zeros((4, D_, D_), jnp.bfloat16)}, {"w": jnp.zeros((V, D_), jnp.bfloat16)}
    x, t = jnp.zeros((rows, T, D_), jnp.bfloat16), jnp.zeros((rows, T), jnp.int32)

    def loss(params, head):
        return pipeline(lambda lp, h: jnp.tanh(h @ lp["w"]), params, x, microbatches=m, schedule="1f1b",
                        keep=keep, mesh=mesh, loss_params=head, targets=t,
                        loss_fn=lambda hp, y, t: sk.chunked_cross_entropy(y, hp["w"], t, chunk=chunk))

    carry = _tick_scan_carry(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, head))
    slots = sched.pipeline_schedule("1f1b", 2, m).loss_res_ring
    local, n = rows // m // 2, T // chunk  # a microbatch's rows on one data shard; the loss's chunks
    want = [((slots, local, T, D_), jnp.bfloat16), ((slots, local, T), jnp.int32),
            ((slots, n, local, chunk), jnp.float32)]
    assert [(tuple(a.shape), a.dtype) for a in carry[-len(want):]] == want, carry


def test_the_executor_under_lean_keeps_the_loss_matmul_output(devices):
    """Issue 37: under ``keep="lean"`` the executor's loss F keeps its matmul output (the
    logits: ``dots_saveable``), as the trace note that sizes the estimate says, instead of
    only its input, which made the backward op recompute the head's matmul (the recipe's 1F1B
    lean program on H100 ran the logits' matmul again inside the loss's checkpoint and held no
    logits in its loss ring, where the estimate counted them). Traced, not compiled."""
    rows, V, m = 8, 64, 4
    mesh = make_mesh("pipe=2", devices=devices[:2])
    params, head = make_problem(4)[0], {"w": jnp.zeros((D, V))}
    x, t = make_problem(4)[2][:rows], jnp.zeros((rows,), jnp.int32)

    def ce(hp, y, t):  # its plain residuals (the softmax) store more than its logits
        logits = y @ hp["w"]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, t[:, None], -1)[:, 0])

    def loss(params, head):
        return pipeline(lean_table_layer, params, x, microbatches=m, schedule="1f1b", keep="lean", mesh=mesh,
                        loss_params=head, targets=t, loss_fn=ce)

    carry = _tick_scan_carry(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, head))
    slots = sched.pipeline_schedule("1f1b", 2, m).loss_res_ring
    assert (slots, rows // m, V) in [tuple(a.shape) for a in carry], carry


def test_kept_pullbacks_store_nothing_shared_and_lean_keeps_the_loss_matmul():
    """Issue 37: a chunk's residual that depends on no per-microbatch value — a table the
    layer closes over (the recipe's RoPE tables: 4 MiB per slot at Llama 3 405B, 8K), a value
    of the weights alone (the layer scan's bf16 weight slices: 760 MiB per slot there under
    keep="all") — is not stored in the ring but computed again by the backward op, with the
    same gradients; and under ``keep="lean"`` the loss keeps its matmul output (``dots``), not
    nothing (which recomputes the head's matmul). Traced, two small CPU jits."""
    from shardkit.pipeline.keep import Kept, Pullbacks

    policy = jax.checkpoint_policies.dots_saveable
    lp, x = jax.tree.map(lambda a: a[0], make_problem(2)[0]), make_problem(2)[2]

    def doubled_layer(lp, h_BxD):  # table_layer on twice the table and half the weights
        return table_layer({"w": 0.5 * lp["w"], "b": lp["b"]}, 2.0 * h_BxD)

    for fn in (jax.checkpoint(lean_table_layer, policy=policy), doubled_layer):
        pulls = Pullbacks()

        @jax.jit
        def grads(lp, x):
            stored = pulls.shapes(lambda _: fn, (lp, x), (), reuse_at=(0, 1))  # noqa: B023
            # per-microbatch values only (lean: the matmul output): no (D,) table, no (D, D) weights
            assert stored and all(a.shape == x.shape for a in stored), stored
            y, res = pulls.vjp(fn, (lp, x), (lp, x))  # noqa: B023
            return pulls.pullback(res, (lp, x))(jnp.ones_like(y))  # noqa: B023

        assert_close(grads(lp, x), jax.vjp(table_layer, lp, x)[1](jnp.ones_like(x)))
    head, t = make_problem(2)[1], make_problem(2)[3]
    kept = Kept(head_loss, sk.lean_policy(), policy).loss_shapes(head, x, t)
    assert (x.shape[0], OUT) in [a.shape for a in kept], kept


def test_a_pending_w_says_which_of_its_values_the_forward_made():
    """What one pending W holds (``SplitBackward.saved_local``), per value: a residual of the
    layer's forward (its input, which the weight's gradient matmul multiplies) or a value B
    computed (the cotangent arriving at that matmul, which is also the bias's gradient per
    row). The estimate counts B's new slot less the forward's residuals where B runs that
    forward itself (``cost.analytic.pipeline_cost.one_f_one_b_loop``)."""
    from shardkit.pipeline.split import SplitBackward

    split = SplitBackward(lambda lp, h, j, group, mb, extras: layer(lp, h), 2)
    params_s = {"w": jax.ShapeDtypeStruct((2, 1, 2, D, D), jnp.float32),
                "b": jax.ShapeDtypeStruct((2, 1, 2, D), jnp.float32)}
    saved = split.saved_local(params_s, jax.ShapeDtypeStruct((4, B, D), jnp.float32), None, 2)
    forwarded = split.forwarded()
    assert len(forwarded) == len(saved) and sum(forwarded) == 1, (saved, forwarded)
    assert all(s == ((2, B // 2, D), jnp.float32) for s in saved)  # stacked over the chunk's 2 layers, rows / 2


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_switch_never_carries_the_f32_weight_gradient_accumulator(devices, schedule, v,
                                                                       older_emitters_ahead_of_time):
    """Handed through the per-tick ``lax.switch`` whole, the f32 accumulator of the stage's
    weight gradients was held twice (the conditional's operand and its result: XLA:GPU, Llama 3
    405B at 8K, ~12 GiB of 87). The branches now return the op's gradient in the compute dtype
    and one add after the switch updates the accumulator in place (``explicit._accumulate``):
    no f32 buffer of the accumulator's shape is a result of the compiled conditional."""
    import re

    p, m, wide = 2, 2, 64
    n = 2 * p * v
    mesh = make_mesh(f"pipe={p}", devices=devices[:p])
    params = {"w": jnp.zeros((n, wide, wide), jnp.bfloat16)}
    x, t = jnp.zeros((4, wide), jnp.bfloat16), jnp.zeros((4, OUT))

    def loss(params, head):
        return pipeline(lambda lp, h: jnp.tanh(h @ lp["w"]), params, x, microbatches=m, schedule=schedule,
                        repeats=v, loss_fn=lambda hp, y, t: jnp.mean((y @ hp["w"] - t) ** 2),
                        loss_params=head, targets=t, mesh=mesh)

    hlo = jax.jit(jax.grad(loss)).lower(params, {"w": jnp.zeros((wide, OUT))}).compile().as_text()
    results = [line.split(" conditional(")[0] for line in hlo.splitlines() if " conditional(" in line]
    assert results, "no conditional in the compiled program: the executor's switch is gone"
    acc = f"f32[{v},{n // (p * v)},{wide},{wide}]"  # the (v, k, ...) accumulator of one stage
    assert not [r for r in results if acc in re.sub(r"\{[^}]*\}", "", r)], results
