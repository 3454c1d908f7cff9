"""Test session setup: 8 simulated CPU devices, set before JAX starts, and one persistent
compilation cache for the session.

Every test file sees the same 8 devices; a test that needs fewer builds its mesh from a
slice of ``jax.devices()``. The compilation cache lives in a temporary directory made for this
session and is inherited by every subprocess the tests start (the recipes' command lines,
resumed runs, multi-process meshes, notebook kernels, simulated meshes): a step compiled once
is read back instead of compiled again. Nothing outlives the session.
"""
import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="shardkit-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Cache every program worth more than a tenth of a second (JAX's default is 1 s).
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.1"
# XLA:CPU spends most of a test's compile in LLVM's optimisation passes; the tests check what a
# layout computes and which collectives it runs (HLO, before LLVM), not how fast the machine
# code is, so they compile at LLVM -O0: about a third less compile time, same programs. Set
# here, before JAX starts, and inherited by every worker and subprocess of the session.
_FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
# The same for the deviceless XLA:GPU compiles (the target sweeps, `shardkit plan --verify`, the
# flash kernels): ptxas at -O0. Only the kernels' machine code changes; the report the tests read
# (memory, collectives, flops, kernels) is identical on the H100 sweep's six default programs,
# in about a tenth fewer CPU seconds (2026-11-28).
_FAST_COMPILE += ["--xla_gpu_disable_gpuasm_optimizations=true"]
# One LLVM module per program: XLA:CPU splits each program into parallel codegen units by
# default, which on 2 cores shared by two workers costs more than it saves. The same program
# (collectives, bytes, flops and buffer assignment identical on the recipe's layouts) in about
# a fifth fewer CPU seconds (tests/test_context.py: 57 -> 46 CPU s, 2026-11-27).
# XLA aborts on a flag it does not know, so this is set only for the jaxlib it was
# measured with (the test extras pin jax 0.10.2).
try:
    from importlib.metadata import version as _version

    if _version("jaxlib").startswith("0.10."):
        _FAST_COMPILE += ["--xla_cpu_parallel_codegen_split_count=1"]
except ImportError:  # pragma: no cover — jaxlib is a dependency of jax
    pass
os.environ["XLA_FLAGS"] = " ".join([*os.environ.get("XLA_FLAGS", "").split(),
                                    *(f for f in _FAST_COMPILE if f.split("=")[0] not in os.environ.get("XLA_FLAGS", ""))])

import shardkit._quiet  # noqa: E402,F401 — imports JAX without the CUDA plugin's start-up lines
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# Programs the tests run compile with XLA:CPU's older emitters, programs compiled ahead of time
# (every compiled figure read) as users get them: tests/_site/shardkit_test_compile.py, here
# and, through tests/_site/sitecustomize.py on PYTHONPATH, in every Python process the tests
# start (recipes, launched processes, notebook kernels, simulated meshes).
import sys  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site"))
import shardkit_test_compile  # noqa: E402

os.environ["PYTHONPATH"] = os.pathsep.join([shardkit_test_compile.SITE,
                                            *filter(None, [os.environ.get("PYTHONPATH")])])

shardkit_test_compile.install()
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402

# The two lanes. `python -m pytest -q` runs everything (CI, the README's command); the fast lane
# `python -m pytest -q -m "not slow"` is for development. A test marks itself slow where it is
# written; the layout sweeps below keep their listed cases in the fast lane (one or two that
# cover the sweep's machinery) and run the rest only in the full suite.
FAST_CASES = {
    "test_transformer.py::test_layout_matches_one_device": {"zero3", "pp_interleaved"},
    "test_transformer.py::test_bf16_layout_close_to_one_device": set(),
    "test_cost.py::test_transformer_estimate_matches_compiled": {"hybrid"},
    "test_cost.py::test_pipeline_estimate_matches_compiled": {"data=2,pipe=4-1f1b-1-1"},
    "test_cost.py::test_pytree_model_estimate_matches_compiled": {"data=8-0-1", "data=4,tensor=2-1-1"},
    "test_resnet.py::test_layouts_match_one_device": {"3-data=2,fsdp=4"},
    "test_oracle.py::test_fp32_layout_matches_the_oracle": {"data=8-0-1", "data=2,fsdp=2,tensor=2-3-2"},
    "test_step.py::test_layout_matches_one_device": {"data=8-1", "data=2,fsdp=2,tensor=2-3"},
}
# Sweep cases that repeat a code path other cases of the same sweep run in the default lane
# (BENCHMARKS.md, "Test suite time", lists why each is redundant): deselected unless
# `--extended` is given. The target sweeps mark theirs in tests/target_sweep.py.
EXTENDED_CASES: dict[str, set[str]] = {
    # The ResNet recipe's interrupted run resumed on two processes: the same launch, restore and
    # batch-order path as the transformer case, which stays; the ResNet's own state (BatchNorm
    # statistics) is restored bit for bit in test_resnet.py::test_checkpoint_resume_is_bit_identical.
    "test_recipe_data.py::test_interrupted_on_one_process_resumes_on_two": {"resnet"},
    # Three recipe runs (~1 min on 2 cores); the conversions themselves run in the default lane.
    "test_diloco_convert.py::test_recipe_warm_starts_diloco_from_a_dp_checkpoint": {"dp-diloco-dp"},
    # Compositions of paths the sweep checks one by one (dp_pp_tp_zb stays as the composition),
    # and ZB-H1 alone (pp_zb): dp_pp_tp_zb runs the same schedule with data and tensor axes, and
    # tests/test_pipeline.py checks ZB-H1's split backward against the sequential model.
    # Circular (pp_circular) is GPipe's autodiff path with repeats: pp_gpipe runs the recipe's and
    # its formulas, pp_interleaved the stage-major relayout, tests/test_pipeline.py circular itself.
    # FSDP × TP (fsdp_tp) runs against one device in test_bf16_layout_close_to_one_device[hybrid]
    # and test_dropout_layouts_match_one_device[hybrid] (data=2,fsdp=2,tensor=2), GPipe (pp_gpipe)
    # in test_dropout_layouts_match_one_device[pp_gpipe].
    # Data parallelism alone (dp: data=8, ZeRO-0) is ZeRO-3's layout without the sharded state
    # (zero3 stays), checked on the recipe's step against the Optax oracle in test_oracle.py
    # (data=8) and against one device in test_step.py; 1F1B (pp_1f1b) runs the same layout
    # against the same fp32 reference in test_chunked_loss_matches_one_device[pp_1f1b] (the
    # chunked loss equals the plain one) and in bf16 in test_bf16_layout_close_to_one_device.
    "test_transformer.py::test_layout_matches_one_device": {"zero1", "dp_pp_tp", "dp_pp_tp_1f1b", "pp_zb",
                                                            "pp_circular", "fsdp_tp", "pp_gpipe",
                                                            "dp", "pp_1f1b"},
    # bf16 compute on data=2,fsdp=2,tensor=2 against fp32: test_oracle.py's
    # test_16bit_compute_is_within_the_derived_bound_of_fp32[bf16-data=2,fsdp=2,tensor=2-3-2] and
    # test_step.py's test_bf16_compute_within_bound on the same mesh; pp_1f1b keeps the recipe's.
    "test_transformer.py::test_bf16_layout_close_to_one_device": {"hybrid"},
    # The estimate beside XLA:CPU's figures: FSDP, TP and SP are in hybrid (data=2,fsdp=2,tensor=2
    # with SP), GPipe and interleaved 1F1B in test_pipeline_estimate_matches_compiled (a pytree
    # model on data=2,pipe=4) beside the recipe's pp_1f1b and dp_pp_tp_zb.
    "test_cost.py::test_transformer_estimate_matches_compiled": {"zero1", "fsdp_tp", "tp_pp", "dp_pp_tp",
                                                                 "dp_pp_tp_1f1b", "pp_zb", "pp_circular", "fsdp",
                                                                 "tp", "tp_sp", "pp_gpipe", "pp_interleaved"},
    # Each ZeRO stage once: ZeRO-0 over one data axis, ZeRO-3 over two; ZeRO-1's sharded
    # optimizer state against one device in test_oracle.py and test_step.py.
    "test_resnet.py::test_layouts_match_one_device": {"0-data=2,fsdp=4", "0-data=4,fsdp=2", "1-data=8",
                                                      "1-data=2,fsdp=4", "3-data=8", "3-data=4,fsdp=2",
                                                      "1-data=4,fsdp=2"},
    # Context parallelism with TP or with DP + FSDP against one device: ring attention's exchange is
    # cp's, and test_context.py checks attention on context=4,tensor=2 and data=2,context=4.
    # Inside GPipe's pipeline stages (cp_pp): the recipe's ring with its zig-zag batch and RoPE
    # positions against one device in cp-dots, the ring in GPipe's and 1F1B's stages against the
    # unpipelined model (values and gradients) in test_context.py::test_inside_a_pipeline_stage.
    "test_transformer.py::test_context_parallel_layouts_match_one_device": {"cp_tp-none", "dp_cp_fsdp-none",
                                                                            "cp_pp-none"},
    # EP with a data axis / with FSDP: the same dispatch as ep; with TP inside the experts (ep_tp)
    # against one device in test_expert_parallel_equals_one_device[expert=4,tensor=2].
    # EP in the recipe's GPipe stages (ep_pp): the recipe's dispatch in ep, sk.moe in a pipeline's
    # stages beside expert and tensor against the unpipelined stack in
    # test_nested_in_a_pipeline_beside_expert_and_tensor, the recipe's GPipe in
    # test_transformer.py::test_dropout_layouts_match_one_device[pp_gpipe].
    "test_moe.py::test_recipe_ep_layouts_match_one_device": {"ep_dp", "ep_fsdp", "ep_tp", "ep_pp"},
    # Ring attention over all 8 devices: the same ring as data=2,context=4, which stays.
    "test_context.py::test_matches_one_device_attention": {"context=8"},
    # Accumulation, ZeRO-3 and TP against the oracle are each in another case.
    "test_oracle.py::test_fp32_layout_matches_the_oracle": {"data=8-0-4", "fsdp=8-3-4", "data=2,tensor=4-1-2"},
    "test_step.py::test_layout_matches_one_device": {"data=2,tensor=4-0", "data=2,fsdp=4-3",
                                                     "data=2,fsdp=2,tensor=2-0"},
    # ZeRO-2 on XLA:CPU (an all-reduce and a slice: ZeRO-1's gradient traffic with ZeRO-3's
    # sharded gradient buffer) beside the estimate, for the four held-out families: ZeRO-3 on the
    # same mesh stays (ZeRO-1: below), and ZeRO-2's estimate beside the compiled figures is held on
    # the pytree model (test_cost.py::test_pytree_model_estimate_matches_compiled) and by the
    # target sweeps' reduce-scatter checks.
    "test_cost_families.py::test_estimate_holds_on_unseen_families": {
        f"{f}-data=8-2-None" for f in ("mlp", "cnn", "gpt", "moe")},
    # Notebook 07: six deviceless compiles of a 1B model for 256 devices (minutes): its committed
    # outputs and checks are verified in the default run (test_notebooks_are_committed_executed),
    # and every compile path it uses is in tests/test_targets_*.py.
    # Notebook 06 ranks 7B layouts on 256 GPUs with sk.search: the same search `shardkit plan`
    # runs in test_plan_command.py, and its committed outputs are verified as 07's are.
    "test_notebooks.py::test_notebook_runs_and_its_figures_hold": {"07_compile_for_the_cluster",
                                                                   "06_layouts_7b_256_gpus"},
    # tests/test_pipeline.py. A pipeline is one lax.scan over its schedule's table: the number
    # of microbatches and stages changes the table (test_pipeline_schedules.py checks every
    # table without devices), not the program's code path. Each schedule keeps, against the
    # sequential model, a pipe-only case with m = p and one with m = 2p (gpipe/circular/1f1b:
    # pipe=4 m=4 and pipe=2 m=4; ZB-H1 and interleaved 1F1B: pipe=4 m=8 and pipe=2 m=2), and
    # pipe=4 with m = 2p beside a data axis (test_with_data_axis, and for ZB-H1 / interleaved
    # test_new_schedules_beside_data_and_tensor[data=2,pipe=4-zb-h1-1] and
    # test_train_step_matches_one_device[data=2,pipe=4-interleaved-1f1b-2-3]).
    "test_pipeline.py::test_loss_and_grads_match_sequential": {
        f"{s}-{v}-{mult}-{p}" for s, v in (("gpipe", 1), ("circular", 2), ("1f1b", 1))
        for mult, p in ((4, 2), (4, 4), (1, 2), (2, 4))},
    "test_pipeline.py::test_new_schedules_match_sequential": {
        f"{p}-{mult}-{s}-{v}" for s, v in (("zb-h1", 1), ("interleaved-1f1b", 2))
        for p, mult in ((2, 4), (4, 4), (2, 2), (4, 1))},
    # keep= on interleaved 1F1B and ZB-H1: the same kept-residual rings as 1F1B's (BW ops) and
    # ZB-V's (split B/W ops, two chunks), whose keep="all" and policy cases stay. keep="input"
    # is the default of every other test of the file (test_loss_and_grads_match_sequential,
    # test_new_schedules_match_sequential); with the constant table, a policy's case stays.
    # keep="lean" is a names policy (save_only_these_names) through the same rings as 1F1B's
    # policy case (keep2): zb-v-2-lean stays (split B/W, two chunks).
    "test_pipeline.py::test_kept_residuals_match_sequential": {
        "interleaved-1f1b-2-dots", "zb-h1-1-dots", "interleaved-1f1b-2-all", "zb-h1-1-all",
        "1f1b-1-lean", "interleaved-1f1b-2-lean", "zb-h1-1-lean",
        *(f"{s}-input" for s in ("1f1b-1", "interleaved-1f1b-2", "zb-h1-1", "zb-v-2"))},
    # Circular's stage weights over `tensor`: GPipe's case runs the same autodiff executor with
    # TP in the stage (circular's repeats stay on pipe-only and data=2,pipe=4 meshes).
    "test_pipeline.py::test_with_tensor_parallel_stage": {"circular-2"},
    # The forward-only pipeline with m = 2p: the same scanned program as m = p, which stays.
    "test_pipeline.py::test_output_matches_sequential": {"2-gpipe-1", "2-circular-2"},
    # TP-sharded stage weights on pipe=4,tensor=2: the same schedules with TP beside a data axis
    # stay (data=2,pipe=2,tensor=2 for ZB-H1 and interleaved 1F1B); interleaved 1F1B on
    # data=2,pipe=4 against one device in test_train_step_matches_one_device.
    "test_pipeline.py::test_new_schedules_beside_data_and_tensor": {
        "pipe=4,tensor=2-zb-h1-1", "pipe=4,tensor=2-interleaved-1f1b-2", "data=2,pipe=4-interleaved-1f1b-2"},
    # ZeRO-1 training runs of ZB-H1 and interleaved 1F1B: ZeRO-1 shards the optimizer state,
    # outside the schedule; circular and 1F1B keep their ZeRO-1 runs on data=2,pipe=4, ZB-H1
    # and interleaved 1F1B their ZeRO-3 runs, against one device.
    "test_pipeline.py::test_train_step_matches_one_device": {
        "data=2,pipe=4-zb-h1-1-1", "data=2,pipe=4-interleaved-1f1b-2-1"},
    # The explicit executor's one psum over data after its scan, the same code for every explicit
    # schedule: 1F1B's case stays beside GPipe's and circular's (autodiff's psum).
    "test_pipeline.py::test_stage_grads_reduced_over_data_once_per_step": {"zb-h1-1", "interleaved-1f1b-2"},
    # ZeRO-3 weights gathered at the shard_map boundary: ZB-H1 (explicit) and GPipe (autodiff) stay.
    "test_pipeline.py::test_zero3_stage_weights_gathered_once_per_step": {"1f1b-1", "interleaved-1f1b-2"},
    # tests/test_diloco.py: 1F1B under DiLoCo's replicas runs the explicit executor that ZB-H1's
    # case runs (beside GPipe's autodiff one), both of which stay.
    "test_diloco.py::test_pipelines_run_inside_the_replicas": {"1f1b"},
}
# tests/test_cost.py (issue 34 item 15), each with the default case that keeps its promise:
# - the recipe transformer's estimate on dp and zero3 (data=8): DP's and ZeRO-3's estimate beside
#   XLA:CPU's figures on the pytree model (test_pytree_model_estimate_matches_compiled[data=8-0-1],
#   [data=8-3-1]: state bytes, peak, every collective role, flops), and the transformer's data-axis
#   gradient reduction and FSDP weight gather in its hybrid case (data=2,fsdp=2,tensor=2, peak at
#   10% where dp's is held at 15%);
# - on pp_1f1b (ZeRO-1, 1F1B): test_pipeline_estimate_matches_compiled[data=2,pipe=4-1f1b-1-1]
#   (ZeRO-1 under 1F1B: state bytes, peak, every pipeline collective, the switch branches' flops),
#   and the transformer in a pipeline stage in its dp_pp_tp_zb case;
# - the pipelines without a data axis (pipe=4, GPipe and 1F1B): their data=2,pipe=4 twins check the
#   same permutes, pipe psums, state bytes, peak and flops, plus the gradient reduction over data;
# - the pytree model's TP without ZeRO (data=4,tensor=2, ZeRO-0): data=4,tensor=2 under ZeRO-1
#   runs the same tensor-parallel sums, data=8 ZeRO-0 the plain all-reduce.
EXTENDED_CASES.setdefault("test_cost.py::test_transformer_estimate_matches_compiled", set()).update({"dp", "zero3", "pp_1f1b"})
EXTENDED_CASES.setdefault("test_cost.py::test_pipeline_estimate_matches_compiled", set()).update({"pipe=4-gpipe-1-0", "pipe=4-1f1b-1-0"})
EXTENDED_CASES.setdefault("test_cost.py::test_pytree_model_estimate_matches_compiled", set()).update({"data=4,tensor=2-0-1"})
# tests/test_cost_families.py (issue 34 item 15): ZeRO-1 on data=8 for each family. Each family
# keeps ZeRO-1 on data=2,fsdp=2,tensor=2 (its optimizer state sharded over data, the masters
# gathered), and ZeRO-1 on pure data with no traffic the estimate cannot explain is held on the
# pytree model (test_cost.py::test_pytree_model_estimate_matches_compiled[data=8-1-1]).
# ZeRO-3 on data=8 for the MoE family: its ZeRO-3 on fsdp=2,expert=4 (the sharded state, the
# weights gathered over the batch axes) stays, and ZeRO-3 on data=8 for the three other families.
# Plain DP (ZeRO-0 on data=8) for each family: the family's program read on a batch split over
# data is held by its ZeRO-3 case on the same mesh (mlp, cnn, gpt: data=8-3; moe: the batch over
# data and fsdp beside tensor in data=2,fsdp=2,tensor=2-1, with its load-balancing row syncs), and
# DP's gradient all-reduce beside XLA:CPU's on the pytree model
# (test_cost.py::test_pytree_model_estimate_matches_compiled[data=8-0-1]). The MLP's hybrid at 256
# rows: the reduction rule held at 8x the batch stays on tensor=8 (mlp-tensor=8-0-256, where it
# was found), and the hybrid keeps its 32-row case. The MoE family's EP beside a data axis
# (data=2,expert=4, ZeRO-1): its token dispatch over expert with the gradients reduced over another
# batch axis is fsdp=2,expert=4's (ZeRO-3), its ZeRO-1 state data=2,fsdp=2,tensor=2's.
EXTENDED_CASES.setdefault("test_cost_families.py::test_estimate_holds_on_unseen_families", set()).update(
    [f"{f}-data=8-1-None" for f in ("mlp", "cnn", "gpt", "moe")] + ["moe-data=8-3-None"]
    + [f"{f}-data=8-0-None" for f in ("mlp", "cnn", "gpt", "moe")] + ["mlp-data=2,fsdp=2,tensor=2-1-256",
                                                                     "moe-data=2,expert=4-1-None"])
# tests/test_step.py (issue 34 item 15): layouts trained against one device whose mesh and ZeRO
# stage also train against the Optax oracle (an fp32 one-device AdamW with clipping, a stricter
# reference: loss, grad norm, params and optimizer state) in test_oracle.py::
# test_fp32_layout_matches_the_oracle: data=8 ZeRO-0/2/3 ([data=8-0-1], [data=8-2-4],
# [data=8-3-2]), data=2,fsdp=2,tensor=2 ZeRO-1/2 ([...-1-1], [...-2-4]), data=4,fsdp=2 ZeRO-2
# ([data=4,fsdp=2-2-1]).
EXTENDED_CASES.setdefault("test_step.py::test_layout_matches_one_device", set()).update(
    {"data=8-0", "data=8-2", "data=8-3", "data=2,fsdp=2,tensor=2-1", "data=2,fsdp=2,tensor=2-2", "data=4,fsdp=2-2"})
# tests/test_resnet.py (issue 34 item 15): ZeRO-0 on data=8 against one device. The global-batch
# BatchNorm (statistics, loss and parameters equal to one device's) stays in
# [3-data=2,fsdp=4], over two batch axes and with every leaf sharded; ZeRO-0's plain gradient
# all-reduce over data=8 against the Optax oracle in test_oracle.py's [data=8-0-1]; the recipe
# trains on data=8 (ZeRO-1) in test_digits_accuracy_through_cli.
EXTENDED_CASES.setdefault("test_resnet.py::test_layouts_match_one_device", set()).update({"0-data=8"})
# Whole tests whose promise another default-lane test keeps (named beside each): --extended.
EXTENDED_TESTS = {
    # The CP ring's deviceless compiles, blockwise and flash, for H100 and v5p (~35 CPU s):
    # test_context.py::test_the_target_picks_the_ring_blocks_and_a_fallback_says_why traces the
    # ring for both targets and finds each step's kernel call, and
    # test_flash_ring_combines_blocks_by_their_log_sum_exp holds its values and gradients.
    "test_kernels.py::test_the_context_ring_runs_the_targets_flash_kernel_per_step",
    # A checkpoint saved by one process resumed by two, training as one: the transformer
    # recipe's interrupted run resumed on two processes (test_recipe_data.py, losses equal) and
    # test_tensor_and_zero3_axes_across_two_processes_train_like_one (arrays split across
    # processes) keep both halves.
    "test_distributed.py::test_two_processes_train_like_one_and_share_checkpoints",
    # The recipe's --resume equal to the uninterrupted run: test_checkpoint.py::
    # test_recipe_resume_skips_a_corrupt_step_and_continues_bit_identically (the same recipe,
    # resumed past a corrupt step) and test_recipe_data.py's resume on two processes.
    "test_transformer.py::test_checkpoint_resume_is_bit_identical",
    # tests/test_diloco.py: DiLoCo's replica axis across two processes (three Python processes,
    # ~12 CPU s): the sync is an all-reduce over `replica`, whose programs the in-process DiLoCo
    # tests check (test_h3_adamw_nesterov_matches_reference_with_no_replica_traffic_between_syncs),
    # and an axis whose groups span both processes trains like one process in
    # test_distributed.py::test_tensor_and_zero3_axes_across_two_processes_train_like_one.
    "test_diloco.py::test_replica_axis_across_two_processes_trains_like_one",
    # The README's step.explain(mesh=, target="h100") on a step planned on this process's CPU
    # devices (one more XLA:GPU subprocess): test_cost_bands.py::
    # test_house_family_on_h100_prints_bands_and_an_honest_peak makes that call and checks the
    # same (H100's program fits, ZeRO-3's gathers and reduce-scatters, the estimate, the step time
    # from the step-time model with H100 figures); two hosts of 8 (16 GPUs) compile in
    # test_targets_gpu.py's hybrid_16 and its A100 and B200 cases.
    "test_targets_gpu.py::test_explain_with_a_target_compiles_this_step_for_it",
}
# tests/test_checkpoint.py (issue 34 item 15): SIGTERM to one training process (a Python child,
# ~4.5 CPU s). Its promise stays in the default lane: a real SIGTERM makes the script save at the
# next step boundary with its data position and exit 0 in test_distributed.py::
# test_sigterm_on_two_processes_saves_the_same_step_and_exits_0 (the same script and
# PreemptionGuard, on both processes of a launch); the guard itself in
# test_preemption_guard_flag_and_handler_restored; a restored state continuing bit-identically in
# test_restore_same_layout_continues_bit_identically and, through the recipe's --resume,
# test_recipe_resume_skips_a_corrupt_step_and_continues_bit_identically.
EXTENDED_TESTS.add("test_checkpoint.py::test_sigterm_checkpoints_exits_0_and_resumes_bit_identically")
# tests/test_diloco.py (issue 34 item 15): the recipe's Streaming DiLoCo run with syncs every
# step (~12 CPU s). test_transformer_recipe_reports_the_model_it_trains runs the recipe with the
# same flags (2 fragments of the layers, int8 exchanges; its interval longer than the run) and
# checks the replica-axis bytes and finite losses; the fragments' staggered syncs and the int8
# exchange run in test_streaming_fragments_sync_staggered_pieces_of_the_layers and
# test_compressed_outer_gradient_is_within_its_bound_and_smaller; the bad flags are refused in
# test_transformer_recipe_refuses_bad_diloco_flags.
EXTENDED_TESTS.add("test_diloco.py::test_transformer_recipe_trains_with_streaming_diloco")
# tests/test_distributed.py (issue 34 item 15): the coordinator killed (SIGKILL: its sockets close,
# the survivor measured to stop in 0.1 s). The frozen coordinator (SIGSTOP: sockets open, nothing
# answers) stays: there the survivor has only the heartbeat to go by, the mechanism that bounds
# both cases (a closed socket only makes it faster), with the same bound asserted.
EXTENDED_CASES.setdefault("test_distributed.py::test_coordinator_death_ends_the_survivor_within_the_heartbeat_bound",
                          set()).add("coordinator-killed")
# Whole tests that take more than ~10 s on 2 cores (recipe runs through their command line,
# resumes, searches over thousands of layouts).
SLOW_TESTS = {
    "test_cost.py::test_efficiency_model_lands_in_the_published_band",
    "test_resnet.py::test_checkpoint_resume_is_bit_identical",
    "test_resnet.py::test_digits_accuracy_through_cli",
    "test_transformer.py::test_dropout_layouts_match_one_device",
    "test_transformer.py::test_checkpoint_resume_is_bit_identical",
    "test_transformer.py::test_sigterm_saves_a_checkpoint_and_exits_zero",
    "test_transformer.py::test_short_run_learns_the_corpus",
    "test_checkpoint.py::test_sigterm_checkpoints_exits_0_and_resumes_bit_identically",
    "test_checkpoint.py::test_kill_9_while_saving_keeps_previous_checkpoint",
}


# The files that take longest, longest first (bench/suite_time.py's per-file table). pytest-xdist's
# `--dist loadfile` hands whole files to the 2 workers in collection order, two at first, then the
# next to whichever worker is free: in alphabetical order the longest files (the target sweeps,
# the transformer recipe) came last, and one worker ran the tail alone. Longest first is the
# classic greedy schedule (each file goes to the worker that frees first): the workers finish
# within about one short file of each other. Files not listed keep their order after these.
LONGEST_FIRST = (
    "test_transformer.py", "test_targets_gpu.py", "test_resnet.py", "test_cost_families.py", "test_pipeline.py",
    "test_checkpoint.py", "test_notebooks.py", "test_distributed.py", "test_cost.py", "test_moe.py",
    "test_recipe_example.py", "test_simulated.py", "test_targets_tpu.py", "test_diloco.py", "test_context.py",
    "test_step.py", "test_recipe_data.py", "test_bench_gpu.py", "test_kernels.py", "test_plan_command.py",
    "test_oracle.py",
)


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the extended cases: sweep cases whose code paths other cases "
                          "of the same sweep already run (nightly; not in the README's command)")


def pytest_collection_modifyitems(config, items):
    kept, extended = [], []
    for item in items:
        name = f"{item.path.name}::{item.originalname}"
        callspec = getattr(item, "callspec", None)
        if name in SLOW_TESTS or (name in FAST_CASES and callspec is not None
                                  and callspec.id not in FAST_CASES[name]):
            item.add_marker(pytest.mark.slow)
        if name in EXTENDED_TESTS or (name in EXTENDED_CASES and callspec is not None
                                      and callspec.id in EXTENDED_CASES[name]):
            item.add_marker(pytest.mark.extended)
        (extended if item.get_closest_marker("extended") and not config.getoption("--extended")
         else kept).append(item)
    if extended:
        config.hook.pytest_deselected(items=extended)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # a stable sort: the same order in every worker (xdist checks), tests within a file unmoved
    items[:] = sorted(kept, key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def older_emitters_ahead_of_time(monkeypatch):
    """This test's ahead-of-time XLA:CPU compiles (``explain``, ``sk.cost``, ``simulate``'s child)
    with the older emitters the tests' run programs use: for a test that reads only collectives,
    flops or which layouts compile, never XLA:CPU's temporaries (``shardkit_test_compile``)."""
    monkeypatch.setenv(shardkit_test_compile.AS_RUN_ENV, "1")


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 simulated CPU devices, got {len(devs)}"
    return devs


# Compile accounting for bench/suite_time.py: with SHARDKIT_COMPILE_STATS=<file>, every worker
# appends one JSON line per test: XLA compiles requested in this process (persistent-cache hits
# included, so `compiles - cache_hits` were compiled here), and the seconds they took.
_STATS_FILE = os.environ.get("SHARDKIT_COMPILE_STATS")
if _STATS_FILE:
    import json
    import time

    from jax._src import monitoring

    _counts = {"compiles": 0, "cache_hits": 0, "compile_s": 0.0}

    def _on_duration(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            _counts["compiles"] += 1
            _counts["compile_s"] += duration

    def _on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            _counts["cache_hits"] += 1

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)

    import resource

    def _cpu_s() -> float:
        # this worker's CPU seconds and those of the subprocesses it waited for: unlike wall
        # time, hardly moved by other jobs on the machine, so a loaded machine still ranks tests
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before, t0, c0 = dict(_counts), time.perf_counter(), _cpu_s()
        yield
        row = {k: _counts[k] - before[k] for k in _counts}
        row.update(test=item.nodeid, wall_s=time.perf_counter() - t0, cpu_s=_cpu_s() - c0, pid=os.getpid())
        with open(_STATS_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
