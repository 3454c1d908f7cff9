"""Run by every Python process the test suite starts (tests/conftest.py puts this folder on
``PYTHONPATH``): the suite's compile options, installed once the process imports JAX
(``shardkit_test_compile``)."""
import shardkit_test_compile

shardkit_test_compile.install_after_jax_import()
