"""How the test suite compiles: the programs it runs with XLA:CPU's older emitters, every program
compiled ahead of time as users get it.

XLA:CPU's fusion emitters (MLIR, XLA's default since 0.5) take most of the suite's compile
time: the steps the tests run compile in about a third fewer CPU seconds with XLA's older
LLVM-IR emitters (tests/test_step.py, test_oracle.py, test_transformer.py, test_moe.py: 380 ->
266 CPU s, 2026-11-28). The two programs differ only after partitioning, in how XLA:CPU fuses
elementwise work: the same collectives, dots and numerics up to the order of fused float ops,
but other temporaries. So the programs the tests *run* - compiled when a jitted function is
called - use the older emitters, and every program compiled ahead of time
(``Lowered.compile()``: where ``step.explain``, ``sk.cost``, the recipes' memory line and the
tests read ``memory_analysis()``, ``cost_analysis()`` and ``as_text()``) is compiled with XLA's
default emitters, as a user's program is: estimates are held to the compiler users get
(bench/cost_fingerprint.py's 136 CPU cases are identical with and without this); a test that
reads no temporaries may opt its ahead-of-time compiles into the older emitters too
(``OLDER_AHEAD_OF_TIME``: the collectives, their bytes and the flops are the same). Deviceless
GPU and TPU compiles are left as they are by this patch (tests/conftest.py's
``XLA_FLAGS``, which every child inherits, do reach them: LLVM -O0 and ptxas -O0 for the kernels' machine code;
the figures the tests read come from HLO and buffer assignment, before LLVM). jaxlib 0.10 only (the flag is XLA:CPU's, and the
hooks are JAX internals; the test extras pin jax 0.10.2): elsewhere nothing changes.

tests/conftest.py installs it in the pytest workers; ``sitecustomize.py`` beside this file
(on the ``PYTHONPATH`` the workers hand down) installs it in every Python process the tests
start, once that process imports JAX.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

import os

_EMITTERS = "xla_cpu_use_fusion_emitters"
# Set to 1 by a test whose assertions read only what both emitters give alike (collectives, their
# bytes, dots and flops, which layouts compile, a peak's order of layouts): its ahead-of-time
# compiles, here and in the processes it starts, take the older emitters too (conftest.py's
# ``older_emitters_ahead_of_time`` fixture). Tests that hold an estimate to XLA:CPU's temporaries
# or peak keep the users' emitters.
OLDER_AHEAD_OF_TIME = "SHARDKIT_TESTS_OLDER_EMITTERS_AHEAD_OF_TIME"
SITE = os.path.dirname(os.path.abspath(__file__))  # the folder conftest puts on PYTHONPATH


def install() -> None:
    """Patch JAX's compile options (JAX must be imported); a no-op off jax 0.10."""
    import jax
    from jax._src import compiler, stages

    if jax.__version_info__[:2] != (0, 10) or getattr(compiler, "_shardkit_tests", False):
        return
    compile_options, lowered_compile = compiler.get_compile_options, stages.Lowered.compile

    def older_emitters_when_run(*args, env_options_overrides=None, backend=None, **kwargs):
        overrides = dict(env_options_overrides or {})
        if backend is None or backend.platform == "cpu":
            overrides.setdefault(_EMITTERS, False)
        return compile_options(*args, env_options_overrides=overrides, backend=backend, **kwargs)

    def as_users_get_ahead_of_time(self, compiler_options=None, **kwargs):
        if getattr(self._lowering, "_platforms", None) in (None, ("cpu",)):
            users = os.environ.get(OLDER_AHEAD_OF_TIME) != "1"
            compiler_options = {_EMITTERS: users, **(compiler_options or {})}
        return lowered_compile(self, compiler_options, **kwargs)

    compiler.get_compile_options = older_emitters_when_run
    stages.Lowered.compile = as_users_get_ahead_of_time
    compiler._shardkit_tests = True


class _AfterJax(importlib.abc.MetaPathFinder):
    """Installs the patch right after ``import jax`` finishes; imports nothing itself, so a
    process that never imports JAX (``--help``, the bench scripts' argument parsing) pays nothing."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            install()

        spec.loader.exec_module = exec_module
        return spec


def install_after_jax_import() -> None:
    if "jax" in sys.modules:
        install()
    else:
        sys.meta_path.insert(0, _AfterJax())
