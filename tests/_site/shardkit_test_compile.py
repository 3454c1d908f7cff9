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
(bench/cost_fingerprint.py's 136 CPU cases are identical with and without this). Deviceless
GPU and TPU compiles are left as they are by this patch (tests/conftest.py's
``XLA_FLAGS``, which every child inherits, do reach them: LLVM -O0 and ptxas -O0 for the kernels' machine code;
the figures the tests read come from HLO and buffer assignment, before LLVM). jaxlib 0.10 only (the flag is XLA:CPU's, and the
hooks are JAX internals; the test extras pin jax 0.10.2): elsewhere nothing changes.

A test whose ahead-of-time programs are only run, or read for what partitioning decides
(collectives, their bytes, the flops, shard bytes), may compile them as run instead: ``AS_RUN``,
``ahead_of_time_as_run()``, or ``AS_RUN_ENV`` for the processes it starts and for itself
(conftest.py's ``older_emitters_ahead_of_time`` fixture sets it).

tests/conftest.py installs it in the pytest workers; ``sitecustomize.py`` beside this file
(on the ``PYTHONPATH`` the workers hand down) installs it in every Python process the tests
start, once that process imports JAX.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys

import os

_EMITTERS = "xla_cpu_use_fusion_emitters"
SITE = os.path.dirname(os.path.abspath(__file__))  # the folder conftest puts on PYTHONPATH
# ``Lowered.compile(AS_RUN)``: an XLA:CPU program compiled ahead of time with the emitters the
# tests run with, for a test that reads only what partitioning decides (the collectives and
# their bytes, the arrays' shard bytes: the same under both emitters) and would otherwise pay
# the fusion emitters' longer compile. Figures users read from XLA itself (memory_analysis,
# cost_analysis) keep the default.
AS_RUN = {_EMITTERS: False}
# A process with this variable set to 1 compiles every AOT program with AS_RUN (as within
# ahead_of_time_as_run()), and so do the processes it starts: for a child whose checks read
# partitioning's figures only (tests/test_notebooks.py's kernels), or a test that sets it with
# conftest.py's ``older_emitters_ahead_of_time`` fixture (collectives, flops, which layouts
# compile, a peak's order of layouts; never an estimate held to XLA:CPU's temporaries).
AS_RUN_ENV = "SHARDKIT_TESTS_AOT_AS_RUN"
_as_run = os.environ.get(AS_RUN_ENV) == "1"  # and set by ahead_of_time_as_run()


@contextlib.contextmanager
def ahead_of_time_as_run():
    """Within it, every XLA:CPU program compiled ahead of time in this process gets AS_RUN:
    for tests whose AOT programs are run or read for their collectives only (DiLoCo's programs,
    a recipe's step compiled for its memory line and then trained with, ``explain`` printed but
    not compared), not for figures held against an estimate."""
    global _as_run
    before, _as_run = _as_run, True
    try:
        yield
    finally:
        _as_run = before


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
            as_run = _as_run or os.environ.get(AS_RUN_ENV) == "1"  # the env var: conftest's fixture
            compiler_options = {_EMITTERS: not as_run, **(compiler_options or {})}
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
