"""``sk.train_step`` against an independent oracle: a plain-JAX + Optax train step written here.

Why: every other "1-device reference" in the tests is ``sk.train_step`` itself on one device, so a
bug shared by every layout (clipping, ``grad_norm``, microbatch averaging, fp16 unscaling and
skipping, weight-decay masking) passes them all. The oracle below uses no shardkit code: it
differentiates the same loss with ``jax.value_and_grad``, averages microbatches in a Python loop
over the slices shardkit documents (microbatch ``i`` holds rows ``i, i+m, i+2m, ...``), clips with
``optax.clip_by_global_norm``, masks weight decay with ``optax.adamw(mask=...)`` and, for fp16,
runs a dynamic loss scaler written out from ``shardkit/precision.py``'s documentation (scale the
loss, unscale the gradients, skip a step whose loss or gradients are not finite and keep params
and optimizer state, grow the scale by ``growth_factor`` after ``growth_interval`` finite steps,
back off by ``backoff_factor`` on a skipped one, never below 1). ``grad_norm`` is the global norm
of the unscaled gradients *before* clipping; ``loss_scale`` is the scale the step used.

Tolerances:
- fp32, every layout vs the oracle, over ``STEPS`` steps: loss, aux and ``grad_norm`` per step to
  a relative ``1e-5``; parameters and Adam moments after the steps to a relative ``1e-5``, plus an
  absolute ``1e-6`` for parameters near zero (1e-4 of the ``LR`` an Adam step moves a weight) and
  ``1e-9`` for moments near zero. The two programs compute the same thing; only the order of f32
  reductions differs (f32 unit roundoff 6e-8). Measured: losses and norms equal to 1.2e-7.
- bf16 / fp16 compute vs the fp32 oracle: a *derived* first-order bound, not a tuned number. A
  16-bit run rounds a known set of values once each (inputs, targets, weights, the hidden
  activation, and in the backward pass the hidden activation's cotangent and each weight's
  gradient; matmuls accumulate in f32), each by a relative at most the unit roundoff ``u``
  (2^-8 for bf16, 2^-11 for fp16: ~3 significant digits). To first order in ``u`` an output ``f``
  then moves by at most ``u * sum_q |df/d(delta_q)|``, where ``delta_q`` is a relative
  perturbation of rounded value ``q``. The oracle computes those sensitivities in f32 with
  autodiff, per step, at the 16-bit run's own parameters (so drift between the runs does not
  enter): ``|loss_16 - loss_32| <= u * sum|dL/d delta|`` and, gradient element by element,
  ``|g_16 - g_32| <= u * b`` with ``b = sum_q |dg/d delta_q|``; hence
  ``|grad_norm_16 - grad_norm_32| <= u * ||b||`` and, for SGD (an update linear in the gradient;
  clipping is a projection, so it does not enlarge the error), ``||p_16 - p_32|| <= LR * u * ||b||``
  for one step from the same parameters and momentum. Adam is not used there: it divides by
  ``sqrt(v)``, so a gradient element near zero whose sign rounding flips moves by ``2 * LR``
  whatever ``u`` is. Second-order terms (``O(u^2)``) and f32 reduction order are covered by a
  factor ``SLACK`` = 1.5 on these bounds. Being worst cases (every rounding in the unluckiest
  direction) they are loose: the measured differences stay under 5% of them.
- fp16 overflow: the skipped step leaves params and optimizer state bitwise equal; the scale,
  ``finite`` and ``skipped`` sequences equal the hand-written scaler's exactly; the finite steps
  match the oracle's fp16 step within the same bound with ``2u``: both programs round the same
  values, and a different f32 reduction order can move a rounded value by one ulp (``2u``).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit as sk

D, F, B, STEPS = 16, 32, 32, 3
LR, WD, CLIP = 1e-2, 0.1, 0.5
SLACK = 1.5
U = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
# One table for every mesh of the sweep: axes a mesh lacks are dropped, on purpose.
AXIS_RULES = sk.AxisRules({"batch": ("data", "fsdp"), "embed": "fsdp", "mlp": "tensor"}, drop_missing=True)


# ---- the model: an MLP with biases and an RMS-norm scale, written for any compute dtype ---------

def init_params():
    rng = np.random.RandomState(0)
    return {"w1": (rng.randn(D, F) / np.sqrt(D)).astype(np.float32),
            "b1": (0.1 * rng.randn(F)).astype(np.float32),
            "w2": (rng.randn(F, D) / np.sqrt(F)).astype(np.float32),
            "b2": (0.1 * rng.randn(D)).astype(np.float32),
            "scale": (1.0 + 0.1 * rng.randn(D)).astype(np.float32)}


def decay_mask(params):
    """Weight decay on the matrices only: biases and the norm scale are left alone."""
    return {k: v.ndim == 2 for k, v in params.items()}


def _same(name, v):
    return v


def forward(p, x, constrain=lambda v, names: v, point=_same):
    """``(B, D) -> (B, D)``. Matmuls take operands in the parameters' dtype and accumulate in
    f32; everything else runs in f32. ``point`` marks the one activation a 16-bit run rounds."""
    a_BxF = jnp.dot(x, p["w1"], preferred_element_type=jnp.float32) + p["b1"][None, :]
    h_BxF = point("h", jax.nn.gelu(constrain(a_BxF, ("batch", "mlp"))).astype(p["w2"].dtype))
    z_BxD = jnp.dot(h_BxF, p["w2"], preferred_element_type=jnp.float32) + p["b2"][None, :]
    z_BxD = constrain(z_BxD, ("batch", None))
    rms_Bx1 = jnp.sqrt(jnp.mean(z_BxD * z_BxD, axis=-1, keepdims=True) + 1e-6)
    return z_BxD / rms_Bx1 * p["scale"][None, :]


def loss_fn(p, batch, constrain=lambda v, names: v, point=_same):
    err = forward(p, batch["x"], constrain, point) - batch["y"].astype(jnp.float32)
    return jnp.mean(err * err), {"mae": jnp.mean(jnp.abs(err))}


def sk_loss(p, batch):
    """What shardkit trains: the same loss, with activation constraints for the tensor axis."""
    return loss_fn(p, batch, sk.constrain)


def make_batches(n=STEPS, seed=1):
    rng = np.random.RandomState(seed)
    w = rng.randn(D, D).astype(np.float32) / np.sqrt(D)
    out = []
    for _ in range(n):
        x = rng.randn(B, D).astype(np.float32)
        out.append({"x": x, "y": np.tanh(2.0 * x @ w).astype(np.float32)})
    return out


def adamw():
    return optax.adamw(LR, weight_decay=WD, mask=decay_mask)


def sgdw():
    return optax.chain(optax.add_decayed_weights(WD, mask=decay_mask), optax.sgd(LR, momentum=0.9))


# ---- the oracle --------------------------------------------------------------------------------

def _global_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)))


def _microbatches(batch, m):
    """Shardkit's documented split: microbatch ``i`` takes rows ``i, i+m, i+2m, ...``."""
    return [{k: v[i::m] for k, v in batch.items()} for i in range(m)]


@functools.cache
def _oracle_grad(compute_name):
    compute = {"fp32": jnp.float32, "fp16": jnp.float16}[compute_name]

    def scaled(p, mb, scale):
        p_c = jax.tree.map(lambda v: v.astype(compute), p)
        mb_c = jax.tree.map(lambda v: v.astype(compute), mb)
        loss, aux = loss_fn(p_c, mb_c)
        loss = loss.astype(jnp.float32)
        return loss * scale, (loss, aux)
    return jax.jit(jax.value_and_grad(scaled, has_aux=True))


class Scaler:
    """fp16 dynamic loss scaling as ``sk.Precision`` documents it, in plain Python."""

    def __init__(self, init_scale, growth_interval, growth_factor=2.0, backoff_factor=0.5):
        self.scale, self.good = float(init_scale), 0
        self.interval, self.growth, self.backoff = growth_interval, growth_factor, backoff_factor

    def adjust(self, finite):
        if not finite:
            self.scale, self.good = max(self.scale * self.backoff, 1.0), 0
        elif self.good + 1 >= self.interval:
            self.scale, self.good = self.scale * self.growth, 0
        else:
            self.good += 1


def oracle_step(params, opt_state, batch, tx, microbatches, clip, compute="fp32", scaler=None):
    """One train step: mean over microbatches, unscale, skip if not finite, clip, update."""
    grad = _oracle_grad(compute)
    scale = scaler.scale if scaler else 1.0
    losses, auxes, grads = [], [], []
    for mb in _microbatches(batch, microbatches):
        (_, (loss, aux)), g = grad(params, mb, jnp.float32(scale))
        losses.append(loss), auxes.append(aux), grads.append(g)
    m = len(grads)
    g = jax.tree.map(lambda *gs: sum(gs) / m, *grads)
    g = jax.tree.map(lambda v: v / scale, g)
    loss = sum(losses) / m
    aux = jax.tree.map(lambda *a: sum(a) / m, *auxes)
    norm = _global_norm(g)
    finite = bool(jnp.isfinite(loss)) and all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))
    record = {"loss": float(loss), "grad_norm": float(norm), "mae": float(aux["mae"]), "finite": finite,
              "loss_scale": scale}
    if scaler:
        scaler.adjust(finite)
    if scaler and not finite:
        return params, opt_state, record
    if clip is not None:
        g, _ = optax.clip_by_global_norm(clip).update(g, optax.EmptyState())
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, record


def oracle_run(batches, tx, microbatches, clip, compute="fp32", scaler=None):
    params = jax.tree.map(jnp.asarray, init_params())
    opt_state = tx.init(params)
    records = []
    for batch in batches:
        params, opt_state, rec = oracle_step(params, opt_state, batch, tx, microbatches, clip, compute, scaler)
        records.append(rec)
    return records, params, opt_state


@functools.cache
def fp32_oracle(microbatches):
    """The oracle's AdamW run, computed once per microbatch count and shared by the layouts."""
    return oracle_run(make_batches(), adamw(), microbatches, CLIP)


# ---- shardkit ----------------------------------------------------------------------------------

def megatron_rules(mesh):
    """Megatron MLP: w1 split by columns and w2 by rows over 'tensor'; FSDP on the embed dim."""
    ax = lambda a: a if a in mesh.axis_names else None
    return [(r"w1", (ax("fsdp"), ax("tensor"))), (r"b1", (ax("tensor"),)),
            (r"w2", (ax("tensor"), ax("fsdp"))), (r".*", ())]


def shardkit_run(mesh_spec, zero, microbatches, tx, batches, precision="fp32", clip=CLIP, keep_history=False):
    mesh = sk.make_mesh(mesh_spec)
    plan = sk.Plan(mesh, rules=megatron_rules(mesh), axis_rules=AXIS_RULES, zero=zero, precision=precision)
    step = sk.train_step(plan, tx, microbatches=microbatches, clip_norm=clip)(sk_loss)
    state = step.init(init_params())
    host = lambda s: (jax.tree.map(np.asarray, s.params), jax.tree.map(np.asarray, s.opt_state))
    history, metrics = [host(state)] if keep_history else [], []
    for batch in batches:
        state, m = step(state, batch)
        metrics.append(jax.tree.map(np.asarray, m))
        if keep_history:
            history.append(host(state))
    return metrics, state, history


# ---- first-order error bound of a 16-bit run (see the module docstring) ------------------------

@jax.custom_vjp
def _rounded(v, d_fwd, d_bwd):
    """``v`` rounded by a relative ``d_fwd``; its cotangent is rounded by a relative ``d_bwd``."""
    return v * (1 + d_fwd)


def _rounded_fwd(v, d_fwd, d_bwd):
    return v * (1 + d_fwd), (v, d_bwd)


def _rounded_bwd(res, ct):
    v, d_bwd = res
    return ct * (1 + d_bwd), ct * v, jnp.zeros_like(d_bwd)


_rounded.defvjp(_rounded_fwd, _rounded_bwd)


@functools.partial(jax.jit, static_argnums=2)
def sensitivities(params, batch, microbatches):
    """``(sum_q |dL/d delta_q|, b)``: the f32 loss's and each gradient element's first-order
    sensitivity to a relative rounding ``delta_q`` of every value a 16-bit run rounds.

    Weights are cast once per microbatch to the same values (one ``delta`` shared); inputs,
    targets, the hidden activation, its cotangent and each weight's gradient are rounded per
    microbatch (the gradient's cast back to f32 and the f32 accumulation are exact)."""
    mbs = _microbatches(batch, microbatches)
    zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
    deltas = {"w": zeros(params),
              "mb": [{"x": zeros(mb["x"]), "y": zeros(mb["y"]),
                      "h": jnp.zeros((mb["x"].shape[0], F)), "h_ct": jnp.zeros((mb["x"].shape[0], F)),
                      "g": zeros(params)} for mb in mbs]}

    def loss(p, mb, d_w, dm):
        p_r = jax.tree.map(_rounded, p, d_w, dm["g"])
        mb_r = {"x": mb["x"] * (1 + dm["x"]), "y": mb["y"] * (1 + dm["y"])}
        return loss_fn(p_r, mb_r, point=lambda name, v: _rounded(v, dm["h"], dm["h_ct"]))[0]

    def loss_and_grad(d):
        losses, grads = [], []
        for mb, dm in zip(mbs, d["mb"]):
            l, g = jax.value_and_grad(loss)(params, mb, d["w"], dm)
            losses.append(l), grads.append(g)
        m = len(mbs)
        flat = jnp.concatenate([jnp.ravel(sum(gs) / m) for gs in zip(*[jax.tree.leaves(g) for g in grads])])
        return sum(losses) / m, flat

    abs_sum = lambda t, axis: sum(jnp.sum(jnp.abs(v).reshape(v.shape[:axis] + (-1,)), axis=-1)
                                  for v in jax.tree.leaves(t))
    loss_sens = abs_sum(jax.grad(lambda d: loss_and_grad(d)[0])(deltas), 0)
    grad_sens = abs_sum(jax.jacrev(lambda d: loss_and_grad(d)[1])(deltas), 1)
    return loss_sens, grad_sens


# ---- fp32: every layout against the oracle ------------------------------------------------------

LAYOUTS = [  # (mesh, ZeRO stage, microbatches)
    ("data=8", 0, 1), ("data=8", 0, 4), ("data=8", 1, 2), ("data=8", 2, 4), ("data=8", 3, 2),
    ("fsdp=8", 3, 4), ("tensor=8", 0, 2), ("data=2,tensor=4", 1, 2),
    ("data=2,fsdp=2,tensor=2", 3, 2), ("data=2,fsdp=2,tensor=2", 2, 4),
    # Issue 36: ZeRO-1 reducing one microbatch into its shard; data beside fsdp on one dim.
    ("data=2,fsdp=2,tensor=2", 1, 1), ("data=4,fsdp=2", 2, 1),
]


def assert_tree_close(actual, expected, rtol, atol, what):
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("mesh_spec,zero,microbatches", LAYOUTS)
def test_fp32_layout_matches_the_oracle(mesh_spec, zero, microbatches):
    records, params, opt_state = fp32_oracle(microbatches)
    metrics, state, _ = shardkit_run(mesh_spec, zero, microbatches, adamw(), make_batches())
    assert any(r["grad_norm"] > CLIP for r in records)  # clipping is exercised
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([float(m[key]) for m in metrics], [r[key] for r in records], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose([float(m["aux"]["mae"]) for m in metrics], [r["mae"] for r in records], rtol=1e-5)
    assert_tree_close(state.params, params, 1e-5, 1e-6, "params")
    assert_tree_close(state.opt_state, opt_state, 1e-5, 1e-9, "opt_state")
    assert int(state.skipped) == 0


def test_weight_decay_mask_reaches_the_update():
    """The mask matters in this model: decaying biases and the norm scale too moves them by more
    than the layout tests' tolerance, so a layout that dropped the mask would fail there."""
    _, params, _ = fp32_oracle(2)
    unmasked = optax.adamw(LR, weight_decay=WD)
    _, other, _ = oracle_run(make_batches(), unmasked, 2, CLIP)
    for k in ("b1", "b2", "scale"):
        assert not np.allclose(np.asarray(params[k]), np.asarray(other[k]), rtol=1e-5, atol=1e-6), k


def test_clipping_matches_optax_at_small_gradient_norms():
    """Near a minimum (gradient norm ~6e-4) a clipped step has norm exactly ``clip_norm``, as
    with ``optax.clip_by_global_norm``: no epsilon shrinks the clipped gradient (an epsilon of
    1e-6 beside the norm did, by 1e-6 / 6e-4 = 0.2%).

    SGD with a learning rate of 1e3 makes the move (norm ~0.3) large against the f32 resolution
    of the parameters. Near a minimum the residuals (~1e-3) are differences of outputs ~1, whose
    f32 rounding (6e-8) is ~1e-4 of a residual: ``grad_norm`` and the clipped gradient (norm-wise)
    are compared to the oracle's to 1e-3 (measured 2e-5 and 1.8e-4); the clipped step's norm,
    ``clip_norm`` by construction whatever the gradient's rounding, to 1e-5."""
    lr = 1e3
    params = jax.tree.map(jnp.asarray, init_params())
    rng = np.random.RandomState(2)
    x = rng.randn(B, D).astype(np.float32)
    y = np.asarray(forward(params, x)) + 1e-3 * rng.randn(B, D).astype(np.float32)
    batch = {"x": x, "y": y}
    tx = optax.sgd(lr)
    norm = oracle_step(params, tx.init(params), batch, tx, 1, None)[2]["grad_norm"]
    clip = norm / 2
    expected, _, record = oracle_step(params, tx.init(params), batch, tx, 1, clip)
    metrics, state, _ = shardkit_run("data=2,fsdp=2,tensor=2", 3, 1, tx, [batch], clip=clip)
    assert 1e-4 < norm < 1e-3
    np.testing.assert_allclose(float(metrics[0]["grad_norm"]), record["grad_norm"], rtol=1e-3)
    moved = jax.tree.map(lambda a, b: (np.asarray(a) - np.asarray(b)) / -lr, state.params, params)
    np.testing.assert_allclose(float(_global_norm(moved)), clip, rtol=1e-5)
    expected_moved = jax.tree.map(lambda a, b: (np.asarray(a) - np.asarray(b)) / -lr, expected, params)
    np.testing.assert_allclose(float(_global_norm(expected_moved)), clip, rtol=1e-5)  # the oracle too
    diff = jax.tree.map(lambda a, b: a - b, moved, expected_moved)
    assert float(_global_norm(diff)) < 1e-3 * clip


# ---- 16-bit compute against the fp32 oracle, within the derived bound -------------------------

PRECISION_CASES = [  # (precision, mesh, ZeRO stage, microbatches)
    ("fp16", "data=4,tensor=2", 1, 2), ("fp16", "fsdp=4,tensor=2", 3, 1),
    ("bf16", "data=2,fsdp=2,tensor=2", 3, 2), ("bf16", "tensor=8", 0, 1),
]


def assert_step_within_bound(t, metrics, history, batch, microbatches, u, compute="fp32", scale=None):
    """Step ``t`` of a 16-bit run against the oracle's SGD step from the run's own parameters and
    momentum: loss, grad_norm and the new parameters within ``SLACK * u * sensitivity``."""
    params, opt_state = jax.tree.map(jnp.asarray, history[t])
    scaler = Scaler(scale, 1) if scale is not None else None
    expected, _, record = oracle_step(params, opt_state, batch, sgdw(), microbatches, CLIP, compute, scaler)
    loss_sens, grad_sens = sensitivities(params, batch, microbatches)
    loss_bound = SLACK * u * float(loss_sens)
    grad_bound = SLACK * u * float(jnp.linalg.norm(grad_sens))
    d_loss = abs(float(metrics[t]["loss"]) - record["loss"])
    d_norm = abs(float(metrics[t]["grad_norm"]) - record["grad_norm"])
    d_params = float(_global_norm(jax.tree.map(lambda a, b: a - b, history[t + 1][0], expected)))
    why = (f"step {t}: |loss diff| {d_loss:.2e} (bound {loss_bound:.2e}), |grad_norm diff| {d_norm:.2e} "
           f"(bound {grad_bound:.2e}), ||params diff|| {d_params:.2e} (bound {LR * grad_bound:.2e})")
    assert record["finite"] and bool(metrics[t].get("finite", True)), f"{why}: the bound assumes no overflow"
    assert d_loss <= loss_bound and d_norm <= grad_bound and d_params <= LR * grad_bound, why


@pytest.mark.parametrize("precision,mesh_spec,zero,microbatches", PRECISION_CASES)
def test_16bit_compute_is_within_the_derived_bound_of_fp32(precision, mesh_spec, zero, microbatches):
    batches = make_batches()
    metrics, _, history = shardkit_run(mesh_spec, zero, microbatches, sgdw(), batches, precision, keep_history=True)
    for t, batch in enumerate(batches):
        assert_step_within_bound(t, metrics, history, batch, microbatches, U[precision])


# ---- fp16: an overflowing gradient with a finite loss is skipped -------------------------------

def test_fp16_overflow_is_skipped_like_the_hand_written_scaler():
    """Step 2's targets are 1000: the loss (~1e6, computed in f32) stays finite, but its scaled
    gradients pass fp16's 65504 where the weight gradients are rounded, so the step is skipped:
    params and optimizer state bitwise untouched, the scale backed off, the skip counted."""
    prec = sk.Precision(compute=jnp.float16, loss_scaling=True, init_scale=2.0 ** 12, growth_interval=2)
    batches = make_batches(5, seed=3)
    batches[2] = {"x": batches[2]["x"], "y": np.full((B, D), 1000.0, np.float32)}
    records, _, _ = oracle_run(batches, sgdw(), 2, CLIP, "fp16", Scaler(2.0 ** 12, 2))
    f32 = oracle_step(jax.tree.map(jnp.asarray, init_params()), sgdw().init(init_params()), batches[2],
                      sgdw(), 2, CLIP)[2]
    assert f32["finite"] and f32["grad_norm"] * 2.0 ** 13 > 65504  # f32 has it: only fp16 overflows

    metrics, state, history = shardkit_run("data=2,fsdp=2,tensor=2", 3, 2, sgdw(), batches, prec, keep_history=True)
    assert [bool(m["finite"]) for m in metrics] == [r["finite"] for r in records] == [True, True, False, True, True]
    assert [float(m["loss_scale"]) for m in metrics] == [r["loss_scale"] for r in records] == [
        2.0 ** 12, 2.0 ** 12, 2.0 ** 13, 2.0 ** 12, 2.0 ** 12]  # grows after 2 finite steps, backs off
    assert float(state.loss_scale.scale) == 2.0 ** 13
    assert [int(m["skipped"]) for m in metrics] == [0, 0, 1, 1, 1] and int(state.streak) == 0
    assert np.isfinite(float(metrics[2]["loss"])) and not np.isfinite(float(metrics[2]["grad_norm"]))
    for before, after in zip(jax.tree.leaves(history[2]), jax.tree.leaves(history[3])):
        np.testing.assert_array_equal(after, before)  # params and every optimizer-state leaf
    for t in (0, 1, 3, 4):  # both programs round the same values; reduction order may move one by an ulp
        assert_step_within_bound(t, metrics, history, batches[t], 2, 2 * U["fp16"], "fp16", records[t]["loss_scale"])
