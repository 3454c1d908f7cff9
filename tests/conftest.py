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

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 simulated CPU devices, got {len(devs)}"
    return devs
