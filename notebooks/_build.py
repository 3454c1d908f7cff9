"""Writes notebooks/01..08 *executed* with nbformat + nbclient: ``python notebooks/_build.py``
(a few minutes on 2 cores; ``python notebooks/_build.py 03_zero_memory`` rebuilds one; 07
takes about 20 minutes: ``--timeout 2400``).

The notebooks are generated so that they stay reproducible and reviewable as code, and they are
committed with their outputs (text, tables, small PNGs) so that they read where the repository
is browsed. Each runs top to bottom on 8 simulated CPU devices and ends with a cell of checks:
the figures its prose states, asserted. tests/test_notebooks.py checks that the committed files
match this builder and re-executes them, checks included.
"""

from __future__ import annotations

import pathlib

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).parent
SETUP = "import shardkit as sk; sk.use_cpu_devices(8)"

MLP = '''import jax, jax.numpy as jnp, optax

D, F, L, B = 256, 1024, 2, 64

def init():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w1": jax.random.normal(k1, (L, D, F)) * 0.02, "w2": jax.random.normal(k2, (L, F, D)) * 0.02}

def loss(p, batch):
    def layer(x, w):
        h = sk.constrain(jnp.tanh(x @ w[0]), ("batch", "mlp"))
        return sk.constrain(x + h @ w[1], ("batch", None)), None
    x, _ = jax.lax.scan(layer, batch["x"], (p["w1"], p["w2"]))
    return jnp.mean(x ** 2)

batch = {"x": jnp.ones((B, D))}'''

NOTEBOOKS = {
    "01_mesh_and_devices": [
        ("md", "# 01 — Meshes and devices\n\nEight simulated CPU devices stand in for a GPU node. "
               "A mesh names the axes a layout uses; inner axes are the fast ones."),
        ("code", SETUP + "\nimport jax\njax.devices()"),
        ("code", 'mesh = sk.make_mesh("data=2,fsdp=2,tensor=2")\nprint(sk.describe_mesh(mesh))'),
        ("md", "One size may be `-1` (inferred). `dcn=` adds outer axes over the slow network; a "
               "DCN axis with the same name as a fast one is merged into it, outermost."),
        ("code", 'print(sk.describe_mesh(sk.make_mesh("data=-1,tensor=2")))\n'
                 'print(sk.describe_mesh(sk.make_mesh("data=2,tensor=2", dcn="data=2")))'),
        ("code", 'try:\n    sk.make_mesh("data=3,tensor=2")\nexcept ValueError as e:\n    print(e)'),
        ("md", "Which device holds which block of an array, for a few specs:"),
        ("code", 'from shardkit import viz\nmesh = sk.make_mesh("data=2,tensor=4")\n'
                 'viz.array_layout((8, 16), ("data", "tensor"), mesh)'),
        ("code", 'viz.array_layout((8, 16), (None, "tensor"), mesh)'),
    ],
    "02_rules_and_specs": [
        ("md", "# 02 — Rules and specs\n\nPath rules (regex → spec, first match wins), then "
               "logical axis names, else an error. Errors list every offender and the fix."),
        ("code", SETUP + '\nimport jax, jax.numpy as jnp\nmesh = sk.make_mesh("data=4,tensor=2")\n'
                 'params = {"attn": {"q": {"kernel": jnp.zeros((64, 128))}, "o": {"kernel": jnp.zeros((128, 64))}},\n'
                 '          "norm": {"scale": jnp.zeros((64,))}}'),
        ("code", 'rules = sk.PathRules([(r"attn/q/kernel", (None, "tensor")), (r"attn/o/kernel", ("tensor", None)), (r".*", ())])\n'
                 'plan = sk.Plan(mesh, rules=rules)\nplan.param_specs(params)'),
        ("code", "plan.describe(params)"),
        ("md", "ZeRO-3 adds the data axes to each leaf's largest divisible dimension:"),
        ("code", "sk.Plan(mesh, rules=rules, zero=3).param_specs(params)"),
        ("md", "## The error messages\nNo rule for a leaf:"),
        ("code", 'try:\n    sk.Plan(mesh, rules=[(r"attn/.*", ())]).param_specs(params)\nexcept sk.ShardingError as e:\n    print(e)'),
        ("md", "A spec that does not fit the mesh or the shape (all offenders at once):"),
        ("code", 'bad = sk.PathRules([(r"attn/q", ("expert", "tensor")), (r"norm", ("tensor", "tensor")), (r".*", ("data", None, None))])\n'
                 'try:\n    sk.Plan(mesh, rules=bad).param_specs(params)\nexcept sk.ShardingError as e:\n    print(e)'),
        ("code", 'try:\n    sk.Plan(mesh, rules=[(r".*", ())]).batch_specs({"x": jnp.zeros((6, 3))})\nexcept sk.ShardingError as e:\n    print(e)'),
    ],
    "03_zero_memory": [
        ("md", "# 03 — ZeRO memory\n\nPer-device bytes of a two-layer MLP under ZeRO-0..3 on "
               "`data=8`: the compiled program (`step.explain`) beside the analytic estimate "
               "(ZeRO paper: 12Ψ → 4Ψ + 8Ψ/N → 12Ψ/N for f32 master + Adam)."),
        ("code", SETUP + "\n" + MLP),
        ("code", 'reports = {}\nfor zero in (0, 1, 2, 3):\n'
                 '    plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], axis_rules={"batch": "data", "mlp": None}, zero=zero)\n'
                 '    step = sk.train_step(plan, optax.adam(1e-3))(loss)\n'
                 '    reports[f"ZeRO-{zero}"] = step.explain(step.init(init), batch)\n'
                 'reports["ZeRO-3"]'),
        ("code", 'rows = []\nfor name, r in reports.items():\n'
                 '    for row in r.comparison():\n'
                 '        if row["quantity"] in ("memory/params", "memory/opt_state", "memory/peak", "collective/grad-reduce", "collective/param-gather"):\n'
                 '            rows.append((name, row["quantity"], row["estimate"], row["compiled"], row["estimate"] / max(row["compiled"], 1),\n'
                 '                         row["caveat"] or ""))  # e.g. a peak estimated more than 10% under the compiled one\n'
                 'for r in rows:\n    print(f"{r[0]:7s} {r[1]:26s} est {r[2]:12,.0f}  compiled {r[3]:12,.0f}  ratio {r[4]:.2f}  {r[5]}")'),
        ("code", 'from shardkit import viz\nviz.memory_bars({k: {**{q: v for q, v in r.memory.items()}} for k, r in reports.items()}, title="compiled per-device memory")'),
        ("code", 'viz.estimate_vs_compiled(reports["ZeRO-3"].comparison(), title="ZeRO-3: estimate / compiled")'),
        ("md", "## The same step on 64 devices\n\nThis machine has 8 devices. `step.explain(state, batch, "
               "mesh=...)` compiles the *same step* (your loss, optimizer, rules) for a mesh that is not "
               "here: a subprocess with 64 simulated XLA:CPU devices compiles it from abstract inputs "
               "(nothing is allocated) and XLA reports the memory. The figures are compiled; the "
               "estimate beside them is modelled, and the report says which is which. ZeRO-3's share "
               "per device falls with N: 12Ψ/64."),
        ("code", 'plan = sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())], axis_rules={"batch": "data", "mlp": None}, zero=3)\n'
                 'step = sk.train_step(plan, optax.adam(1e-3))(loss)\nstate = step.init(init)\n'
                 'big = step.explain(state, {"x": jnp.ones((512, D))}, mesh="data=64")\n'
                 'psi = 2 * L * D * F\nprint(f"params per device {big.memory[\'params\']:,} = 4Ψ/64 = {4 * psi / 64:,.0f}")\nbig'),
    ],
    "04_tensor_parallel_collectives": [
        ("md", "# 04 — Tensor-parallel collectives\n\nMegatron: the first weight split by "
               "columns, the second by rows, one all-reduce of the activations after each block "
               "in the forward pass and one in the backward. `explain()` reads them off the "
               "compiled program and attributes each to the mesh axes it runs over."),
        ("code", SETUP + "\n" + MLP),
        ("code", 'rules = [("w1", (None, None, "tensor")), ("w2", (None, "tensor", None))]\n'
                 'plan = sk.Plan(sk.make_mesh("data=4,tensor=2"), rules=rules, axis_rules={"batch": "data", "mlp": "tensor"})\n'
                 'step = sk.train_step(plan, optax.adam(1e-3))(loss)\nreport = step.explain(step.init(init), batch)\nreport'),
        ("code", 'for t in report.traffic:\n    print(f"{t.kind:15s} over {t.axes}: {t.count} executions, {t.bytes:,} bytes")'),
        ("md", "Per layer: one forward all-reduce (row-parallel `w2`) and one backward (`w1`'s "
               "input gradient), each of (tokens per device × d_model):"),
        ("code", 'tokens = B // 4\nprint("expected", 2 * L * tokens * D * 4, "bytes; compiled", report.roles()["tensor-reduce"])'),
        ("md", "The analytic estimate reads the same reductions off the traced program (every matmul "
               "that contracts a tensor-split dimension leaves partial sums), so it holds on a model "
               "it was not written for. On a 64-device `data=8,tensor=8` mesh, compiled in a "
               "subprocess, each device reduces the same bytes per token, over 8 devices now:"),
        ("code", 'big = step.explain(step.init(init), {"x": jnp.ones((8 * B // 4, D))}, mesh="data=8,tensor=8")\n'
                 'for t in big.traffic:\n    print(f"{t.kind:15s} over {t.axes}: group {t.group}, {t.count} executions, {t.bytes:,} bytes")\n'
                 '[r for r in big.comparison() if r["quantity"] == "collective/tensor-reduce"]'),
    ],
    "05_pipeline_schedules": [
        ("md", "# 05 — Pipeline schedules and bubbles\n\nGPipe's bubble is (p−1)/(m+p−1) of the "
               "time; circular with v repeats (p−1)/(v·m+p−1); 1F1B has GPipe's bubble but keeps "
               "at most p microbatches of activations; interleaved 1F1B and ZB-H1 shrink the bubble "
               "further at 1F1B's memory."),
        ("code", SETUP + "\nimport jax, jax.numpy as jnp\nimport numpy as np\nfrom shardkit.pipeline import schedules as sched"),
        ("code", 'p, m = 4, 8\nfor name, v in (("gpipe", 1), ("circular", 2)):\n'
                 '    tab = sched.forward_table(p, m, v)\n    busy = tab.item >= 0\n'
                 '    print(f"{name:9s} ticks={busy.shape[0]} bubble={1 - busy.mean():.3f} formula={(p - 1) / (v * m + p - 1):.3f}")'),
        ("code", 'import matplotlib.pyplot as plt\nfig, ax = plt.subplots(figsize=(7, 2))\n'
                 'ax.imshow((sched.forward_table(4, 8).item.T >= 0), aspect="auto", cmap="Greens")\n'
                 'ax.set_xlabel("tick"); ax.set_ylabel("stage"); ax.set_title("GPipe forward: busy cells"); plt.show()'),
        ("md", "The explicit-backward schedules run their backward inside the pipeline, from a table "
               "the compiled scan executes cell by cell: `sk.pipeline_schedule` returns it. 1F1B "
               "fuses a microbatch's backward (BW); interleaved 1F1B (Narayanan et al. 2021) gives "
               "each device v layer chunks, bubble (p−1)/(v·m) of the ideal time; ZB-H1 (Qi et al., "
               "ICLR 2024) splits the backward into B (input gradient, sent upstream at once) and W "
               "(weight gradient) and fills the cool-down bubble with W: a third of 1F1B's bubble "
               "with 1F1B's p live microbatch inputs."),
        ("code", 'print(sk.pipeline_schedule("zb-h1", stages=4, microbatches=8))\n'
                 'for name, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)):\n'
                 '    t = sk.pipeline_schedule(name, stages=4, microbatches=8, repeats=v)\n'
                 '    print(f"{name:17s} bubble {t.bubble_fraction:.3f} (formula {t.formula_bubble:.3f}) "\n'
                 '          f"peak live inputs per stage {list(t.peak_activations)}")'),
        ("md", "Drawn as the papers draw them: one row per device, F (light), B (mid) and W / fused BW "
               "(dark) cells coloured per microbatch, `/c` the chunk, white the bubble. ZB-V (Qi et al. "
               "2024, \"Pipeline Parallelism with Controllable Memory\") gives device s the layer groups "
               "s and 2p−1−s: a microbatch goes down the devices and comes back up (the loss on device "
               "0), and the W's fill what is left: bubble (p−1)/(6m+p−1) in its half-stage slots, at "
               "1F1B's peak of p whole-stage microbatches (2p chunks)."),
        ("code", 'from matplotlib.figure import Figure\n'
                 'fig = Figure(figsize=(10, 6), layout="constrained")\n'
                 'axes = fig.subplots(4, 1)\n'
                 'for ax, (name, v) in zip(axes, (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))):\n'
                 '    sk.viz.pipeline_schedule(sk.pipeline_schedule(name, stages=4, microbatches=4, repeats=v), ax=ax)\n'
                 'fig'),
        ("md", "Running one on the simulated devices: 4 layers over `pipe=4`, equal to the plain loop."),
        ("code", 'mesh = sk.make_mesh("data=2,pipe=4")\nW = jax.random.normal(jax.random.key(0), (4, 16, 16)) * 0.3\n'
                 'x = jax.random.normal(jax.random.key(1), (8, 16))\nlayer = lambda w, h: jnp.tanh(h @ w)\n'
                 'with jax.set_mesh(mesh):\n    y = jax.jit(lambda W, x: sk.pipeline(layer, W, x, microbatches=4))(W, x)\n'
                 'ref = x\nfor l in range(4):\n    ref = layer(W[l], ref)\nprint(np.abs(np.asarray(y) - np.asarray(ref)).max())'),
        ("md", "What the cost model predicts for the bubble of a 1B model on 64 H100s:"),
        ("code", 'for m in (4, 8, 16, 32):\n    lo = sk.cost.Layout(data=16, pipe=4, zero=1, microbatches=m)\n'
                 '    e = sk.cost.estimate("1b", lo, "h100", global_batch=512, memory_limit=1e12)\n'
                 '    print(f"m={m:3d} bubble {e.time[\'bubble\'] / e.step_time:.1%} of the step, step {e.step_time:.3f}s, MFU {e.mfu:.1%}")'),
        ("md", "And what a pipelined step costs per device on a mesh that is not here: the small "
               "pipeline above on `data=4,pipe=4` (16 simulated devices), compiled:"),
        ("code", 'import optax\nplan = sk.Plan(mesh, rules=[(r"W", ("pipe", None, None)), (r".*", ())])\n'
                 'step = sk.train_step(plan, optax.sgd(0.1))(lambda p, b: jnp.mean(sk.pipeline(layer, p["W"], b["x"], microbatches=4) ** 2))\n'
                 'state = step.init({"W": W})\nr = step.explain(state, {"x": jnp.ones((16, 16))}, mesh="data=4,pipe=4")\n'
                 'print(r.compiled_on); r.roles()'),
    ],
    "06_layouts_7b_256_gpus": [
        ("md", "# 06 — Exploring layouts for a 7B transformer on 256 H100s\n\nThe search is "
               "analytic (seconds on a laptop): matmuls at an achievable fraction of peak "
               "(`sk.cost.EFFICIENCY`: 52% on H100, fitted on Megatron-LM's H100 runs), a "
               "transformer's memory-bound kernels at HBM speed, most data-axis traffic overlapped "
               "with compute, most TP traffic and the pipeline bubble not (BENCHMARKS.md compares it "
               "with 22 published runs it was not fitted to). Then the best layouts are *compiled* "
               "for 256 simulated devices to check their memory with XLA itself."),
        ("code", SETUP),
        ("code", 'result = sk.search("7b", devices=256, hardware="h100", global_batch=512)\nresult.table(12)'),
        ("code", 'sk.viz.compare_layouts(result, top=10)'),
        ("code", 'best = result.best\nprint(best.layout, f"step {best.step_time:.3f}s MFU {best.mfu:.1%} peak {best.memory[\'peak\'] / 1e9:.1f} GB")\n'
                 'sk.viz.memory_bars({str(e.layout.mesh) + f" z{e.layout.zero} {e.layout.remat}": e for e in result.estimates[:5]}, limit=80e9)'),
        ("md", "Predicted weak scaling of the chosen layout from 8 to 256 GPUs (2 sequences per GPU):"),
        ("code", 'for r in sk.cost.weak_scaling("7b", best.layout, "h100", per_device_batch=2, devices=(8, 16, 32, 64, 128, 256)):\n'
                 '    print(f"{r[\'devices\']:4d} {r[\'layout\']:44s} {r[\'tokens_per_s_per_device\']:9,.0f} tok/s/GPU  eff {r[\'efficiency\']:.1%}")'),
        ("md", "The same question with pure data parallelism only (ZeRO-1), to see why it does not fit:"),
        ("code", 'sk.search("7b", devices=256, global_batch=512, tensor=[1], pipe=[1], fsdp=[1], zero=(1,)).table(5)'),
        ("md", "## Checking the winner with the compiler\n\n`sk.search(..., verify=k, build=...)` compiles "
               "the analytic top k for 256 simulated devices (a subprocess; abstract inputs, nothing "
               "allocated) and re-ranks them by compiled memory and traffic. `build(layout)` returns "
               "the step to compile: here the transformer recipe at the 1B size (the 7B's compile "
               "takes minutes on a laptop; the 1B's about 10 s per layout)."),
        ("code", 'import jax, numpy as np, optax\nfrom flax import nnx\n'
                 'from models.transformer.config import SIZES\nfrom models.transformer.layouts import make_plan\n'
                 'from models.transformer.model import Transformer, loss_fn\n'
                 'cfg = SIZES["1b"]\n\ndef build(lo):\n'
                 '    plan = make_plan(sk.cost.abstract_mesh(lo.mesh), cfg, zero=lo.zero, precision="bf16")\n'
                 '    step = sk.train_step(plan, optax.adamw(3e-4))(lambda m, b: loss_fn(m, b, None))\n'
                 '    state = step.abstract_state(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))\n'
                 '    batch = {k: jax.ShapeDtypeStruct((256, cfg.seq), np.int32) for k in ("inputs", "targets")}\n'
                 '    return step, state, batch\n\n'
                 'checked = sk.search("1b", devices=256, global_batch=256, pipe=[1], remat=("none",), verify=2, build=build)\n'
                 'checked.table(4)'),
    ],
    "07_compile_for_the_cluster": [
        ("md", "# 07 — Which layouts fit on 256 H100s, or a v5p-256, and what a step costs\n\n"
               "The analytic search ranks thousands of layouts in seconds; then the best few are "
               "*compiled by the compiler of the accelerator you would rent* — XLA:GPU for H100s, "
               "XLA:TPU for a TPU v5p slice — on this CPU-only machine, without the devices "
               "(deviceless ahead-of-time compilation: `target=`). What comes back is that "
               "compiler's per-device memory against the device's (fits, and by how much), the "
               "collectives it emits, and a step time from the step-time model fed with the "
               "compiled flops and collectives. The model is the transformer recipe at its 1B size "
               "(16 layers, d=2048, seq 2048), 256 sequences per step, without pipelines (their "
               "compiles take longer)."),
        ("code", SETUP),
        ("code", 'from models.transformer.config import SIZES\nfrom models.transformer.plan import builder\n\n'
                 'cfg = SIZES["1b"]\n'
                 'def verified(hardware, target, k=3):\n'
                 '    return sk.search("1b", devices=256, hardware=hardware, global_batch=256, pipe=[1], verify=k,\n'
                 '                     target=target, build=builder(cfg, global_batch=256, target=target))\n\n'
                 'h100 = verified("h100", "h100")\nh100.table(6)'),
        ("md", "Each compiled layout's report: its peak against the H100's 80 GB, the collectives "
               "XLA:GPU chose (reduce-scatters where XLA:CPU would all-reduce and slice), and the "
               "step time re-timed on the compiled traffic beside the analytic one:"),
        ("code", 'from shardkit.cost.search.rank import compiled_flags\n\n'
                 'def summary(result):\n'
                 '    for e, v in zip(result.estimates, result.verified):\n'
                 '        if v is None:\n'
                 '            continue\n'
                 '        if v.report is None:\n'
                 '            print(e.layout.mesh, "did not compile:", v.error[:160])\n'
                 '            continue\n'
                 '        r = v.report\n'
                 '        kinds = ", ".join(f"{c.kind} x{c.count}" for c in r.collectives)\n'
                 '        sp = "+sp" if e.layout.sequence_parallel else ""\n'
                 '        print(f"{e.layout.mesh + sp:26s} zero={e.layout.zero} remat={e.layout.remat:5s} "\n'
                 '              f"peak {r.memory[\'peak\'] / 2**30:6.2f} GiB of {r.device_memory / 2**30:5.1f} "\n'
                 '              f"(estimated {e.memory[\'peak\'] / 2**30:5.2f}; {\'fits\' if r.fits else \'OVER\'}); "\n'
                 '              f"step {v.step_time * 1e3:7.1f} ms (analytic {e.step_time * 1e3:7.1f}); {kinds}")\n'
                 '        for flag in compiled_flags(e, v):  # an estimate more than 10% under what compiling found\n'
                 '            print("    !", flag)\n\n'
                 'summary(h100)'),
        ("md", "The same question for a TPU v5p slice of 256 chips (`v5p:4x8x8`), compiled by XLA:TPU "
               "(libtpu); the mesh's axes are laid onto the torus where they map onto its physical "
               "axes:"),
        ("code", 'v5p = verified("tpu-v5p", "tpu-v5p")\nsummary(v5p)\n'
                 'print(next(v.report for v in v5p.verified if v and v.report).notes[0])'),
    ],
}


# The figures each notebook's prose states, asserted in its last cell (names from its cells).
CHECKS = {
    "01_mesh_and_devices": '''# -1 is inferred from the 8 devices; a DCN axis named like a fast one is merged into it
assert dict(sk.make_mesh("data=-1,tensor=2").shape) == {"data": 4, "tensor": 2}
assert dict(sk.make_mesh("data=2,tensor=2", dcn="data=2").shape) == {"data": 4, "tensor": 2}
try:
    sk.make_mesh("data=3,tensor=2")
    raise AssertionError("data=3,tensor=2 cannot fit 8 devices")
except ValueError as e:
    assert "needs 6 devices" in str(e) and "8 are available" in str(e)''',
    "02_rules_and_specs": '''from jax.sharding import PartitionSpec as P
# first match wins: each kernel gets its own rule, the norm the catch-all
assert plan.param_specs(params) == {"attn": {"q": {"kernel": P(None, "tensor")}, "o": {"kernel": P("tensor", None)}},
                                    "norm": {"scale": P()}}
# ZeRO-3 adds the data axes to each leaf's largest divisible dimension
assert sk.Plan(mesh, rules=rules, zero=3).param_specs(params) == {
    "attn": {"q": {"kernel": P(None, ("tensor", "data"))}, "o": {"kernel": P(("tensor", "data"),)}},
    "norm": {"scale": P("data")}}
# errors list every offender at once: four problems in the three leaves of `bad`
try:
    sk.Plan(mesh, rules=bad).param_specs(params)
    raise AssertionError("the bad rules must fail")
except sk.ShardingError as e:
    problems = [line.split()[1] for line in str(e).splitlines() if line.startswith("  - ")]
    assert len(problems) == 4 and set(problems) == {"attn/o/kernel", "attn/q/kernel", "norm/scale"}''',
    "03_zero_memory": '''psi = 2 * L * D * F  # parameters
held = {name: r.memory["params"] + r.memory["opt_state"] - 4 for name, r in reports.items()}  # less Adam's step count
assert held["ZeRO-0"] == 12 * psi                                   # 12 bytes per parameter: f32 master + Adam's 2 moments
assert held["ZeRO-1"] == held["ZeRO-2"] == 4 * psi + 8 * psi // 8   # 4Ψ + 8Ψ/N, N = 8
assert held["ZeRO-3"] == 12 * psi // 8                              # 12Ψ/N
assert big.memory["params"] == 4 * psi // 64 and big.memory["params"] + big.memory["opt_state"] - 4 == 12 * psi // 64
for name, quantity, est, compiled, ratio, flag in rows:             # the estimate is exact for the state
    if quantity in ("memory/params", "memory/opt_state"):
        assert est == compiled, (name, quantity)''',
    "04_tensor_parallel_collectives": '''expected = 2 * L * tokens * D * 4  # one forward + one backward all-reduce per layer, f32
compiled = report.roles()["tensor-reduce"]
assert expected <= compiled <= expected + 64, (expected, compiled)  # + a scalar or two (the loss)
# on data=8,tensor=8 each device reduces the same bytes over its 8-device tensor group
tp = [t for t in big.traffic if t.axes == ("tensor",)]
assert len(tp) == 1 and tp[0].group == 8 and tp[0].bytes == compiled''',
    "05_pipeline_schedules": '''for v in (1, 2):  # GPipe (p-1)/(m+p-1), circular (p-1)/(v*m+p-1), counted in the schedule tables
    busy = sched.forward_table(4, 8, v).item >= 0
    assert abs((1 - busy.mean()) - 3 / (v * 8 + 3)) < 1e-12
assert np.abs(np.asarray(y) - np.asarray(ref)).max() < 1e-5  # the pipeline equals the plain loop
share = [e.time["bubble"] / e.step_time for e in (
    sk.cost.estimate("1b", sk.cost.Layout(data=16, pipe=4, zero=1, microbatches=m), "h100", global_batch=512,
                     memory_limit=1e12) for m in (4, 8, 16, 32))]
assert share == sorted(share, reverse=True)  # more microbatches, a smaller bubble
assert r.roles()["pipe-permute"] > 0
one, zb = (sk.pipeline_schedule(n, stages=4, microbatches=8) for n in ("1f1b", "zb-h1"))
idle = lambda t: t.bubble_fraction / (1 - t.bubble_fraction)  # bubble over the ideal time
assert abs(idle(zb) - idle(one) / 3) < 1e-12 and max(zb.peak_activations) == max(one.peak_activations) == 4
vee = sk.pipeline_schedule("zb-v", stages=4, microbatches=8)
assert abs(vee.bubble_fraction - 3 / (6 * 8 + 3)) < 1e-12 and max(vee.peak_activations) == 8
drawn = [sk.pipeline_schedule(n, stages=4, microbatches=4, repeats=v).op.size
         for n, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2))]
assert [len(ax.patches) for ax in axes] == drawn  # one cell per (tick, device)''',
    "06_layouts_7b_256_gpus": '''assert sk.cost.EFFICIENCY["h100"].matmul == 0.52
assert best.fits and best.memory["peak"] < 80e9  # the winner fits an 80 GB H100
dp_only = sk.search("7b", devices=256, global_batch=512, tensor=[1], pipe=[1], fsdp=[1], zero=(1,))
assert not any(e.fits for e in dp_only.estimates)  # pure data parallelism does not fit
assert sum(v is not None for v in checked.verified) == 2 and all(v.report is not None for v in checked.verified if v)''',
    "07_compile_for_the_cluster": '''compiled = [v for r in (h100, v5p) for v in r.verified if v is not None and v.report is not None]
assert len(compiled) == 6  # three layouts per target, each compiled by that target's compiler
assert all("XLA:GPU" in v.report.compiled_on for v in h100.verified if v and v.report)
assert all("XLA:TPU" in v.report.compiled_on for v in v5p.verified if v and v.report)
assert any(v.fits for v in compiled) and all(v.step_time > 0 for v in compiled)
# the H100 compiler reduce-scatters data-parallel gradients under ZeRO (XLA:CPU never does)
assert any("reduce-scatter" in {c.kind for c in v.report.collectives} for v in h100.verified if v and v.report)
# every compiled peak the estimate is more than 10% under is flagged where it is shown
for r in (h100, v5p):
    for e, v in zip(r.estimates, r.verified):
        if v is not None and v.report is not None and e.memory["peak"] < 0.9 * v.peak:
            assert any("under the compiled peak" in f for f in compiled_flags(e, v)), e.layout
''',
}


def _sibling(name: str):
    """A cells module beside this file (loaded by path: the tests load this builder by path too)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_nb_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# 08 reads the 7B's compiled figures from bench/results (its cells live in their own module).
_seq = _sibling("_seq_memory_cells")
NOTEBOOKS[_seq.NAME], CHECKS[_seq.NAME] = _seq.CELLS, _seq.CHECK

CHECKS_MD = ("md", "### Checks\nThe figures stated above, asserted; the tests re-run this notebook.")


def cells_of(name: str) -> list[tuple[str, str]]:
    """The notebook's cells: its sections, then its checks."""
    return NOTEBOOKS[name] + [CHECKS_MD, ("code", CHECKS[name])]


def execute(nb, timeout: int = 600) -> None:
    """Runs ``nb`` in a fresh ``python3`` kernel that imports this checkout, drawing off-screen
    (raises ``CellExecutionError`` naming the failing cell)."""
    import os
    import tempfile

    import nbclient

    env = {"PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with tempfile.TemporaryDirectory() as cwd:
            # IPython's inline backend renders returned matplotlib Figures (sk.viz's) as PNGs
            nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout,
                                    extra_arguments=["--IPKernelApp.matplotlib=inline"],
                                    resources={"metadata": {"path": cwd}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _strip(nb) -> None:
    """Drops what changes from run to run without changing what a reader sees (timings,
    kernel versions), so rebuilding an unchanged notebook leaves a small diff; and the CUDA
    plugin's start-up log lines (stderr, where the target compilers are installed)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not (
                o.get("name") == "stderr" and all("absl::InitializeLog" in line or "cudart_stub" in line
                                                  for line in o.get("text", "").splitlines() if line.strip()))]
    nb.metadata.pop("widgets", None)
    nb.metadata.get("language_info", {}).pop("version", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)


def build(names=None, timeout: int = 600) -> list[pathlib.Path]:
    """Executes and writes the notebooks ``names`` (all by default); ``timeout``: seconds per
    cell (07's v5p cell, three 256-chip compiles, needs more on a loaded 2-core machine:
    ``python notebooks/_build.py --timeout 2400 07_compile_for_the_cluster``)."""
    out = []
    for name in names or NOTEBOOKS:
        nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src)
                                 for kind, src in cells_of(name)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        execute(nb, timeout=timeout)
        _strip(nb)
        path = HERE / f"{name}.ipynb"
        nbformat.write(nb, path)
        out.append(path)
    return out


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Execute and write notebooks/0*.ipynb from this builder.")
    ap.add_argument("names", nargs="*", help="notebooks to rebuild (default: all), e.g. 03_zero_memory")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    args = ap.parse_args()
    for p in build(args.names or None, timeout=args.timeout):
        print(p)
