"""Rules, resolution, validation and the Plan's specs — literal expected specs, no compiling."""
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import shardkit as sk

S = jax.ShapeDtypeStruct
f32 = jnp.float32


def params():
    return {"attn": {"q": {"kernel": S((16, 32), f32)}, "o": {"kernel": S((32, 16), f32)}},
            "mlp": {"w1": S((16, 64), f32), "b1": S((64,), f32), "w2": S((64, 16), f32)},
            "norm": {"scale": S((16,), f32)}}


RULES = sk.PathRules([
    (r"attn/q/kernel", (None, "tensor")),
    (r"attn/o/kernel", ("tensor", None)),
    (r"mlp/w1", ("fsdp", "tensor")),
    (r"mlp/b1", ("tensor",)),
    (r"mlp/w2", ("tensor", "fsdp")),
    (r".*", ()),
])


def test_path_rules_first_match_wins_and_report_source():
    mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")
    plan = sk.Plan(mesh, rules=RULES)
    assert plan.param_specs(params()) == {
        "attn": {"q": {"kernel": P(None, "tensor")}, "o": {"kernel": P("tensor", None)}},
        "mlp": {"w1": P("fsdp", "tensor"), "b1": P("tensor"), "w2": P("tensor", "fsdp")},
        "norm": {"scale": P()}}
    sources = {l.path: l.source for l in plan.leaf_layouts(params())}
    assert sources["norm/scale"] == "rule 5: .*"
    assert sources["mlp/w1"] == "rule 2: mlp/w1"


@pytest.mark.parametrize("zero,expected_w1,expected_scale", [
    (0, P("fsdp", "tensor"), P()),
    # the dim fsdp already splits, in the batch axes' order (issue 36: the gradient is then one
    # reduce-scatter over data x fsdp, not an all-reduce of fsdp's shard over data)
    (3, P(("data", "fsdp"), "tensor"), P(("data", "fsdp"))),
])
def test_zero3_adds_the_data_axes_to_params(zero, expected_w1, expected_scale):
    plan = sk.Plan(sk.make_mesh("data=2,fsdp=2,tensor=2"), rules=RULES, zero=zero)
    specs = plan.param_specs(params())
    assert specs["mlp"]["w1"] == expected_w1
    assert specs["norm"]["scale"] == expected_scale


def test_zero2_puts_data_after_fsdp_on_its_dim():
    """Issue 36: ZeRO-1/2 shards keep fsdp major, so the updated shards are gathered back into
    the fsdp layout by one all-gather over data (data-major blocks would need a permute)."""
    plan = sk.Plan(sk.make_mesh("data=2,fsdp=2,tensor=2"), rules=RULES, zero=2)
    assert plan.grad_specs(params())["mlp"]["w1"] == P(("fsdp", "data"), "tensor")
    assert plan.grad_specs(params())["mlp"]["w2"] == P("tensor", ("fsdp", "data"))


def test_opt_state_follows_params_with_zero_axes():
    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r"w", ("data",)), (r".*", ())], zero=1)
    p = {"w": S((16, 8), f32), "v": S((24, 4), f32), "odd": S((3,), f32)}
    opt = jax.eval_shape(optax.adam(1e-3).init, p)
    specs = plan.opt_state_specs(opt, p)
    adam = specs[0]
    assert adam.count == P()
    # 'w' already uses 'data' (no ZeRO axis left); 'v' gets it on its largest dim; 'odd' cannot.
    assert adam.mu == {"w": P("data"), "v": P("data"), "odd": P()}
    assert adam.nu == adam.mu
    notes = {l.path: l.note for l in plan.param_layout(p).leaves}
    assert "ZeRO cannot shard it" in notes["odd"]
    # stage 0 keeps the optimizer state like the params
    assert sk.Plan(plan.mesh, rules=plan.rules, zero=0).opt_state_specs(opt, p)[0].mu["v"] == P()


def test_axis_rules_map_flax_logical_names():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), use_bias=False, rngs=rngs)
            self.down = nnx.Linear(64, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), use_bias=False, rngs=rngs)

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
    plan = sk.Plan(sk.make_mesh("fsdp=4,tensor=2"), axis_rules={"embed": "fsdp", "mlp": "tensor"})
    assert plan.param_specs(model) == {"up": {"kernel": P("fsdp", "tensor")}, "down": {"kernel": P("tensor", "fsdp")}}
    # PathRules win over logical names
    plan2 = sk.Plan(plan.mesh, rules=[(r"down", ())], axis_rules={"embed": "fsdp", "mlp": "tensor"})
    assert plan2.param_specs(model)["down"]["kernel"] == P()
    # a missing logical name is an error naming it
    with pytest.raises(sk.ShardingError, match=r"up/kernel \(16, 64\).*'mlp'.*AxisRules"):
        sk.Plan(plan.mesh, axis_rules={"embed": "fsdp"}).param_specs(model)


def test_linen_logical_partitioning_through_axis_rules():
    import flax.linen as nn

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(32, kernel_init=k, use_bias=False)(x)

    variables = jax.eval_shape(lambda: Dense().init(jax.random.key(0), jnp.ones((1, 8))))
    plan = sk.Plan(sk.make_mesh("data=4,tensor=2"), axis_rules={"embed": None, "mlp": "tensor"})
    assert plan.param_specs(variables) == {"Dense_0": {"kernel": P(None, "tensor")}}


def test_all_offenders_reported_at_once():
    mesh = sk.make_mesh("data=2,tensor=4")
    rules = [(r"a", ("nope",)), (r"b", ("data", "data")), (r"c", (None, None, "tensor")),
             (r"d", ("tensor",))]
    p = {"a": S((8,), f32), "b": S((8, 8), f32), "c": S((8, 8), f32), "d": S((6,), f32),
         "e": S((4,), f32), "f": S((2, 2), f32)}
    with pytest.raises(sk.ShardingError) as err:
        sk.Plan(mesh, rules=rules).param_specs(p)
    msg = str(err.value)
    assert "2 parameter(s) have no sharding rule" in msg
    assert "e (4,)" in msg and "f (2, 2)" in msg and "(r'.*', ())" in msg
    # fix the unmatched ones; the spec errors are then all listed together
    with pytest.raises(sk.ShardingError) as err:
        sk.Plan(mesh, rules=rules + [(r".*", ())]).param_specs(p)
    msg = str(err.value)
    assert "4 parameter(s) cannot be sharded" in msg
    assert "a shape=(8,)" in msg and "unknown mesh axis 'nope'" in msg and "{'data': 2, 'tensor': 4}" in msg
    assert "b shape=(8, 8)" in msg and "'data' used more than once" in msg
    assert "c shape=(8, 8)" in msg and "3 entries but the array has rank 2" in msg
    assert "d shape=(6,)" in msg and "dim 0 of size 6 is not divisible by tensor=4 (= 4)" in msg


def test_batch_specs_and_errors():
    plan = sk.Plan(sk.make_mesh("data=2,fsdp=2,tensor=2"))
    assert plan.batch_axes == ("data", "fsdp")
    assert plan.batch_specs({"x": S((8, 3), f32), "n": S((), f32)}) == {"x": P(("data", "fsdp")), "n": P()}
    with pytest.raises(sk.ShardingError, match=r"batch leaf 'x' shape=\(6, 3\): leading dim 6 is not divisible by 4"):
        plan.batch_specs({"x": S((6, 3), f32)})
    with pytest.raises(sk.ShardingError, match=r"not divisible by 16 \(batch axes data=2 x fsdp=2 x 4 microbatches\)"):
        plan.batch_specs({"x": S((8, 3), f32)}, microbatches=4)
    assert sk.Plan(plan.mesh, batch_axes=()).batch_specs({"x": S((3,), f32)}) == {"x": P()}
    with pytest.raises(ValueError, match=r"batch_axes \['rows'\] are not mesh axes"):
        sk.Plan(plan.mesh, batch_axes=("rows",))


@pytest.mark.parametrize("kwargs,match", [
    ({"zero": 4}, r"unknown ZeRO stage 4"),
    ({"zero": True}, r"unknown ZeRO stage True"),
    ({"precision": "fp4"}, r"unknown precision 'fp4'; choose one of \['fp32', 'bf16', 'bf16-pure', 'fp16', 'fp8'\]"),
    ({"rules": [("(", ())]}, r"not a valid regex"),
    ({"rules": [("a",)]}, r"each entry is a \(regex, spec\) pair"),
    # a bare string used to unpack into two characters: regex 'w', spec P('1')
    ({"rules": ["w1"]}, r"PathRules entry 0 is 'w1'; each entry is a \(regex, spec\) pair"),
    ({"rules": [(3, ())]}, r"PathRules entry 0 is \(3, \(\)\)"),
    ({"rules": "w1"}, r"PathRules takes \(regex, spec\) pairs or a \{regex: spec\} dict"),
    ({"axis_rules": ["ab"]}, r"AxisRules entry 0 is 'ab'"),
])
def test_plan_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sk.Plan(sk.make_mesh("data=8"), **kwargs)


def test_path_rules_as_a_dict_keep_their_order():
    # Plan(rules={...}) used to read each key as a pair of characters ("unknown mesh axis '1'").
    p = {"w1": S((16, 64), f32), "w2": S((64, 16), f32), "b": S((64,), f32)}
    plan = sk.Plan(sk.make_mesh("fsdp=4,tensor=2"), rules={r"w1": ("fsdp", "tensor"), r"w\d": ("tensor", "fsdp"),
                                                           r".*": ()})
    assert plan.param_specs(p) == {"w1": P("fsdp", "tensor"), "w2": P("tensor", "fsdp"), "b": P()}
    assert [rx.pattern for rx, _ in plan.rules.rules] == ["w1", r"w\d", ".*"]


def test_describe_is_a_table_with_every_leaf():
    from rich.console import Console

    plan = sk.Plan(sk.make_mesh("data=2,fsdp=2,tensor=2"), rules=RULES, zero=3)
    console = Console(record=True, width=200)
    console.print(plan.describe(params()))
    text = console.export_text()
    assert "mlp/w1" in text and "(4, 32)" in text  # per-device block of w1 under ZeRO-3 + TP


def test_describe_state_params_of_nnx_and_linen_models():
    # state.params is a plain tree: Flax's logical names are gone, and describe used to raise
    # "no PathRules entry matches and it has no logical axis names".
    import flax.linen as nn

    class MLP(nnx.Module):
        def __init__(self, rngs):
            init = nnx.initializers.lecun_normal()
            self.up = nnx.Linear(16, 64, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")), use_bias=False,
                                 rngs=rngs)

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            k = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(64, kernel_init=k, use_bias=False)(x)

    plan = sk.Plan(sk.make_mesh("fsdp=4,tensor=2"), rules=[(r"params/.*/bias", ())],
                   axis_rules={"embed": "fsdp", "mlp": "tensor"})
    step = sk.train_step(plan, optax.sgd(0.1))(lambda m, b: 0.0)
    with nnx.use_eager_sharding(False):
        state = step.init(MLP(nnx.Rngs(0)))
    text = str(plan.describe(state.params))
    assert "up/kernel" in text and "P('fsdp', 'tensor')" in text and "logical ('embed', 'mlp')" in text
    assert plan.param_specs(state.params) == {"up": {"kernel": P("fsdp", "tensor")}}
    # Linen: the rules see 'params/...' paths, as the step did
    variables = jax.eval_shape(lambda: Dense().init(jax.random.key(0), jnp.ones((1, 16))))
    state = step.abstract_state(variables)
    assert plan.param_specs(state.params) == {"Dense_0": {"kernel": P("fsdp", "tensor")}}
    assert "params/Dense_0/kernel" in str(plan.describe(state.params))
    # a tree the plan never laid out still needs rules
    with pytest.raises(sk.ShardingError, match="no PathRules entry matches"):
        plan.describe({"up": {"kernel": S((16, 32), f32)}})


def test_precision_presets():
    assert sk.Precision.preset("bf16").compute == jnp.bfloat16
    assert sk.Precision.preset("bf16").params == jnp.float32
    assert sk.Precision.preset("fp16").loss_scaling
    assert sk.Precision.preset("bf16-pure").opt_state == jnp.bfloat16
    assert sk.Precision.resolve("bf16").name == "bf16"


def test_axis_rules_naming_an_axis_the_mesh_lacks_is_an_error_unless_dropped_on_purpose():
    # The case: the mesh spells 'tensr', the table 'tensor'; every MLP used to be
    # replicated silently (and sk.constrain(x, ("batch", "mlp")) ran without a word).
    with pytest.raises(sk.ShardingError, match=r"(?s)name mesh axes the mesh .*'tensr': 2.* lacks:\n"
                                               r"  - 'mlp' -> 'tensor': the mesh has no 'tensor'.*drop_missing=True"):
        sk.Plan(sk.make_mesh("data=2,fsdp=2,tensr=2"), rules=[(r".*", ())], axis_rules=sk.AxisRules({"mlp": "tensor"}))
    mesh = sk.make_mesh("data=8")
    with pytest.raises(sk.ShardingError) as err:  # every offender at once
        sk.Plan(mesh, axis_rules={"batch": ("data", "fsdp"), "mlp": "tensor"})
    assert "'batch' -> ('data', 'fsdp'): the mesh has no 'fsdp'" in str(err.value)
    assert "'mlp' -> 'tensor'" in str(err.value)
    # a repeated name needs one entry the mesh has ((name, None) is one)
    with pytest.raises(sk.ShardingError, match=r"'embed': none of its entries \[\('fsdp',\), \('tensor',\)\]"):
        sk.Plan(mesh, axis_rules=[("embed", "fsdp"), ("embed", "tensor")])
    assert sk.Plan(mesh, axis_rules=[("embed", "fsdp"), ("embed", None)]).logical_spec(("embed",)) == P()
    # sk.constrain resolves through AxisRules.spec, which refuses the same table
    with pytest.raises(sk.ShardingError, match=r"\['mlp'\] map to mesh axes the mesh \{'data': 8\} lacks"):
        sk.AxisRules({"mlp": "tensor"}).spec(("mlp",), (8,), {"data": 8})
    # one table for several meshes, on purpose: the axes a mesh lacks are dropped and listed
    portable = sk.AxisRules({"batch": ("data", "fsdp"), "mlp": "tensor"}, drop_missing=True)
    plan = sk.Plan(mesh, rules=[(r".*", ())], axis_rules=portable)
    assert plan.logical_spec(("batch", "mlp")) == P("data")
    text = " ".join(str(plan.describe({"w": S((8,), f32)})).split())  # the caption wraps
    assert "dropped (drop_missing=True): 'batch' -> ('data', 'fsdp'): the mesh has no 'fsdp'" in text
    with pytest.raises(ValueError, match=r"neither in the mesh .* 'mlp' -> 'tensr'"):  # typos still caught
        sk.Plan(mesh, axis_rules=sk.AxisRules({"mlp": "tensr"}, drop_missing=True))


def test_a_mesh_axis_nothing_uses_is_an_error_before_compiling():
    # `--mesh data=2,tensr=4`: every parameter P(), batch over data, 4 devices repeating the work.
    mesh = sk.make_mesh("data=2,tensr=4")
    loss = lambda p, b: jnp.mean((b @ p["w"]) ** 2)  # noqa: E731
    batch = jnp.ones((8, 8))
    step = sk.train_step(sk.Plan(mesh, rules=[(r".*", ())]), optax.sgd(0.1))(loss)
    state = step.init({"w": jnp.ones((8, 8))})
    with pytest.raises(sk.ShardingError, match=r"(?s)'tensr' \(size 4\) used by nothing.*"
                                               r"Plan\(\.\.\., unused_axes=\('tensr',\)\)"):
        step(state, batch)
    with pytest.raises(sk.ShardingError, match="'tensr'"):
        sk.jit(loss, sk.Plan(mesh, rules=[(r".*", ())]), args=("params", "batch"))({"w": jnp.ones((8, 8))}, batch)
    # kept on purpose: named in the Plan, listed by describe
    plan = sk.Plan(mesh, rules=[(r".*", ())], unused_axes="tensr")
    step = sk.train_step(plan, optax.sgd(0.1))(loss)
    state, metrics = step(step.init({"w": jnp.ones((8, 8))}), batch)
    assert float(metrics["loss"]) == 64.0
    text = " ".join(str(plan.describe(state.params)).split())  # the caption wraps at the table's width
    assert "left unused on purpose (their devices repeat the work" in text and "['tensr']" in text
    # an axis used by a parameter's own names (no rule), by sk.constrain or by a building block counts
    uses = {"constrain": lambda p, b: loss(p, sk.constrain(b, ("data", "tensr"))),
            "block": lambda p, b: jnp.mean(sk.pipeline(lambda w, x: jnp.tanh(x @ w), p["w"][None].repeat(4, 0),
                                                       b, microbatches=4, axis="tensr") ** 2)}
    for name, fn in uses.items():
        step = sk.train_step(sk.Plan(mesh, rules=[(r".*", ())]), optax.sgd(0.1))(fn)
        step(step.init({"w": jnp.ones((8, 8))}), batch)
    with pytest.raises(ValueError, match=r"unused_axes \['tensor'\] are not mesh axes"):
        sk.Plan(mesh, unused_axes=("tensor",))
    with pytest.raises(ValueError, match=r"unused_axes \['data'\] are used by the plan's rules or batch axes"):
        sk.Plan(mesh, unused_axes=("data", "tensr"))


# ---- AxisRules: a repeated logical name is an ordered list of fallbacks ----------------------

def logical_params(shapes_and_names):
    """Linen-style boxed leaves carrying logical names, as ShapeDtypeStructs."""
    import flax.linen as nn

    return {k: nn.LogicallyPartitioned(S(shape, f32), names) for k, (shape, names) in shapes_and_names.items()}


MAXTEXT_LIKE = [("embed", "fsdp"), ("embed", "data"), ("mlp", "tensor")]


@pytest.mark.parametrize("mesh_spec,expected", [
    # the first entry for 'embed' wins (the last one used to: data, absent here, so P(None, 'tensor'))
    ("fsdp=4,tensor=2", {"up": P("fsdp", "tensor"), "down": P("tensor", "fsdp")}),
    # no fsdp axis here: the next entry for 'embed' wins
    ("data=4,tensor=2", {"up": P("data", "tensor"), "down": P("tensor", "data")}),
    ("data=2,fsdp=2,tensor=2", {"up": P("fsdp", "tensor"), "down": P("tensor", "fsdp")}),
])
def test_axis_rules_fallbacks_follow_the_mesh(mesh_spec, expected):
    p = logical_params({"up": ((16, 64), ("embed", "mlp")), "down": ((64, 16), ("mlp", "embed"))})
    assert sk.Plan(sk.make_mesh(mesh_spec), axis_rules=MAXTEXT_LIKE).param_specs(p) == expected


def test_axis_rules_fallback_skips_an_axis_another_dim_uses():
    mesh = sk.make_mesh("data=2,fsdp=4")
    # 'mlp' is fixed to fsdp, so 'embed' cannot take it: its next entry, data, wins
    rules = [("mlp", "fsdp"), ("embed", "fsdp"), ("embed", "data"), ("embed", None)]
    p = logical_params({"up": ((16, 64), ("embed", "mlp")), "norm": ((16,), ("embed",))})
    assert sk.Plan(mesh, axis_rules=rules).param_specs(p) == {"up": P("data", "fsdp"), "norm": P("fsdp")}
    # two fallback names compete in table order: 'embed' is listed first and takes fsdp
    rules = [("embed", "fsdp"), ("embed", "data"), ("mlp", "fsdp"), ("mlp", "data")]
    assert sk.Plan(mesh, axis_rules=rules).param_specs(p) == {"up": P("fsdp", "data"), "norm": P("fsdp")}


def test_axis_rules_fallback_skips_an_axis_that_does_not_divide():
    mesh = sk.make_mesh("data=2,fsdp=4")
    rules = [("embed", "fsdp"), ("embed", "data"), ("embed", None)]
    p = logical_params({"a": ((6, 8), ("embed", None)), "b": ((8, 8), ("embed", None)), "c": ((7,), ("embed",))})
    assert sk.Plan(mesh, axis_rules=rules).param_specs(p) == {"a": P("data"), "b": P("fsdp"), "c": P()}
    # without the explicit (name, None), a dim nothing fits is an error naming every entry and why
    with pytest.raises(sk.ShardingError) as err:
        sk.Plan(mesh, axis_rules=rules[:2]).param_specs(p)
    msg = str(err.value)
    assert ("c (7,): no AxisRules entry fits logical axis 'embed' (dim 0, size 7): ('fsdp',) (= 4) does not "
            "divide 7, ('data',) (= 2) does not divide 7 (add ('embed', None) as its last entry") in msg
    assert "a (6, 8)" not in msg and "1 parameter(s)" in msg


def test_axis_rules_fallbacks_for_activations():
    mesh = sk.make_mesh("data=2,fsdp=4")
    plan = sk.Plan(mesh, axis_rules=[("batch", ("data", "fsdp")), ("embed", "fsdp"), ("embed", "data"),
                                     ("embed", None)])
    assert plan.logical_spec(("embed",)) == P("fsdp")
    assert plan.logical_spec(("batch", "embed")) == P(("data", "fsdp"))  # fsdp and data taken by batch
    assert plan.axis_rules.mapping["embed"] == ("fsdp",)  # a name's first entry
    assert plan.axis_rules.fallbacks == frozenset({"embed"})


def test_axis_rules_single_entries_are_unchanged():
    # A name listed once is fixed: a clash is still reported by validation, not resolved away.
    mesh = sk.make_mesh("data=2,fsdp=4")
    p = logical_params({"w": ((8, 8), ("embed", "mlp"))})
    with pytest.raises(sk.ShardingError, match=r"w shape=\(8, 8\) .*'fsdp' used more than once"):
        sk.Plan(mesh, axis_rules={"embed": "fsdp", "mlp": "fsdp"}).param_specs(p)
    with pytest.raises(ValueError, match=r"AxisRules entry 0 is 'embed'; each entry is a \(logical name, mesh axes\) pair"):
        sk.AxisRules(["embed"])
