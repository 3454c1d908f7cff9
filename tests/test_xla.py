"""sk.xla_flags (XLA_FLAGS contents, idempotence, the started-backend error) and
sk.target_platform (the mesh being compiled for, abstract GPU meshes included)."""

import jax
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import shardkit as sk
from shardkit import xla

H100 = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")


def test_xla_flags_appends_once_and_keeps_the_users_values(monkeypatch):
    monkeypatch.setattr(xla, "_backend_started", lambda: False)  # as at the top of a script
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d --xla_gpu_enable_latency_hiding_scheduler=false")
    flags = sk.xla_flags("gpu")
    assert flags == [f"--{k}={v}" for k, v in xla.GPU_FLAGS.items()]
    assert "--xla_gpu_enable_pipelined_all_gather=true" in flags
    assert "--xla_gpu_threshold_for_windowed_einsum_mib=0" in flags
    env = __import__("os").environ["XLA_FLAGS"].split()
    assert env[:2] == ["--xla_dump_to=/tmp/d", "--xla_gpu_enable_latency_hiding_scheduler=false"]
    assert sorted(env[2:]) == sorted(f for f in flags if "latency_hiding" not in f)
    sk.xla_flags("gpu")
    assert __import__("os").environ["XLA_FLAGS"].split() == env  # idempotent


def test_xla_flags_errors(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    jax.devices()  # the backend is running in this process
    with pytest.raises(RuntimeError, match="already started.*before the first JAX operation"):
        sk.xla_flags("gpu")
    assert sk.xla_flags("gpu", apply=False)[0].startswith("--xla_gpu_")  # listing is always fine
    assert __import__("os").environ["XLA_FLAGS"] == ""
    with pytest.raises(ValueError, match="no flags for platform 'tpu'; choose one of \\['gpu'\\]"):
        sk.xla_flags("tpu")


def test_target_platform_follows_the_mesh_being_compiled_for():
    assert sk.target_platform() == jax.default_backend() == "cpu"
    gpu_mesh = AbstractMesh((2,), ("data",), axis_types=(AxisType.Auto,), abstract_device=H100)
    with sk.Plan(gpu_mesh, rules=[(r".*", ())]).active():
        assert sk.target_platform() == "gpu"
    with jax.sharding.use_abstract_mesh(gpu_mesh):
        assert sk.target_platform() == "gpu"
    with sk.Plan(sk.make_mesh("data=8"), rules=[(r".*", ())]).active():
        assert sk.target_platform() == "cpu"


@pytest.mark.subprocess
def test_every_gpu_flag_is_known_to_the_installed_xla():
    """XLA parses XLA_FLAGS when any backend starts (CPU too) and aborts on an unknown name."""
    import subprocess
    import sys

    code = ("import shardkit as sk; sk.xla_flags('gpu'); import jax, os; "
            "print(jax.numpy.ones(2).sum(), len(os.environ['XLA_FLAGS'].split()))")
    env = {**__import__("os").environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["2.0", str(len(xla.GPU_FLAGS))]


def test_gpu_compile_options_raise_xlas_remat_limit_to_the_steps_memory_fraction(monkeypatch):
    """Issue 37: XLA:GPU recomputes past ~76% of the device (80% x its 95% slop factor), so the
    Llama 3 405B keep="lean" programs that fit an H100 ran 1.17x the model's matmuls; a step
    compiles for a GPU with the limit at ``gpu_memory_fraction`` of the device (the deviceless
    compile honours it: ``tests/test_targets_gpu.py::test_xla_gpu_honours_the_remat_limit_option``),
    unless the user set the flag."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    options = xla.compiler_options("gpu")
    assert options == {"xla_gpu_memory_limit_slop_factor": 119} == xla.compiler_options("cuda", 0.95)
    assert 0.8 * options["xla_gpu_memory_limit_slop_factor"] / 100 >= xla.GPU_MEMORY_FRACTION
    assert sk.TrainStep.gpu_memory_fraction == xla.GPU_MEMORY_FRACTION
    assert xla.compiler_options("cpu") == {} == xla.compiler_options("tpu") == xla.compiler_options("gpu", None)
    for bad in (1.5, 0, "0.9", True):
        with pytest.raises(ValueError, match=r"in \(0, 1\]"):
            xla.compiler_options("cpu", bad)  # checked on every platform
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_memory_limit_slop_factor=300")
    assert xla.compiler_options("gpu") == {}  # the user's flag stands


def test_the_steps_gpu_memory_fraction_is_an_argument_checked_when_the_step_is_made():
    """``sk.train_step(gpu_memory_fraction=)`` (and the recipe's ``--gpu-memory-fraction``,
    through ``plan.abstract_step``) sets the step's XLA:GPU recompute limit: the Llama 3 405B
    8K row on 8,192 H100s (75.4 GiB with the flash kernel) recomputes 1.11x the model's
    matmuls at the default 0.95 and none at 0.975 (BENCHMARKS.md); a bad share fails when the
    step is made, naming the value, not at its first compile."""
    import optax

    from models.transformer.config import SIZES
    from models.transformer.plan import abstract_step

    step, _, _ = abstract_step(SIZES["test"], "data=2", global_batch=2, gpu_memory_fraction=0.975)
    assert step.gpu_memory_fraction == 0.975
    assert xla.compiler_options("gpu", step.gpu_memory_fraction) == {"xla_gpu_memory_limit_slop_factor": 122}
    plan = sk.Plan(sk.make_mesh("data=2", devices=jax.devices()[:2]), [])
    with pytest.raises(ValueError, match=r"gpu_memory_fraction=1\.5.*in \(0, 1\]"):
        sk.train_step(plan, optax.sgd(0.1), gpu_memory_fraction=1.5)(lambda params, batch: 0.0)
