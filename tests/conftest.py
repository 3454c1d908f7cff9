"""Test session setup: 8 simulated CPU devices, set before JAX starts.

Every test file sees the same 8 devices; a test that needs fewer builds its mesh from a
slice of ``jax.devices()``.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) == 8, f"tests expect 8 simulated CPU devices, got {len(devs)}"
    return devs
