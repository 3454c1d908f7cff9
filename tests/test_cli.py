"""The ``shardkit`` command and the scripts beside it, run as a user types them: ``--help``
names the command typed and does no work, every flag says what it does, and a command prints
its answer and nothing else (no CUDA-plugin, absl or Gloo start-up chatter)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import shardkit as sk
from shardkit import _quiet

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _user_env() -> dict:
    """A user's environment: this checkout on the path, none of the test session's JAX settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def _run_all(commands: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Runs the commands side by side (each only imports and parses)."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=_user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in commands]
    return [subprocess.CompletedProcess(c, p.wait(), *p.communicate()) for c, p in zip(commands, procs)]


SHARDKIT = [sys.executable, "-m", "shardkit.cli"]
HELP = {  # what the user types -> the usage line's start
    "shardkit --help": "usage: shardkit ",
    "shardkit mesh --help": "usage: shardkit mesh ",
    "shardkit train --help": "usage: shardkit train ",
    "shardkit train transformer --help": "usage: shardkit train transformer ",
    "shardkit train resnet --help": "usage: shardkit train resnet ",
    "shardkit launch --help": "usage: shardkit launch ",
    "shardkit plan --help": "usage: shardkit plan ",
}
# Each command line through `shardkit`'s main in one fresh interpreter (one JAX import for all):
# its exit status, what it printed, and the traceback of anything it raised.
_HELP_DRIVER = """
import contextlib, io, json, sys, traceback
from shardkit.cli import main
out = {}
for typed in json.loads(sys.argv[1]):
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(typed.split()[1:])
        except SystemExit as e:  # argparse's --help
            code = e.code or 0
        except Exception:
            code = "raised"
            traceback.print_exc()
    out[typed] = {"code": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    res, = _run_all([[sys.executable, "-c", _HELP_DRIVER, json.dumps(list(HELP))]])
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _check_help(helps: dict, typed: str) -> None:
    got = helps[typed]
    assert got["code"] == 0 and "Traceback" not in got["stderr"], (typed, got["stderr"][-2000:])
    assert got["stdout"].startswith(HELP[typed]), (typed, got["stdout"][:300])


@pytest.mark.subprocess
def test_every_command_help_names_the_command_typed(helps):
    for typed in HELP:
        _check_help(helps, typed)


def test_every_recipe_flag_has_help_and_mesh_names_every_axis():
    from models.resnet.__main__ import parser as resnet_parser
    from models.transformer.layouts import MESH_AXES
    from models.transformer.train import parser as transformer_parser

    for name, p in (("transformer", transformer_parser()), ("resnet", resnet_parser())):
        bare = [a.option_strings or a.dest for a in p._actions if not (a.help or "").strip()]
        assert not bare, f"{name}: flags without help: {bare}"
    mesh_help = next(a.help for a in transformer_parser()._actions if "--mesh" in a.option_strings)
    assert MESH_AXES and all(axis in mesh_help for axis in MESH_AXES), (MESH_AXES, mesh_help)


# Runs a bench script with --help and says whether it exited, how, and whether it had imported
# JAX (or shardkit, which imports it) by then.
_HELP_BEFORE_JAX = """
import runpy, sys
path = sys.argv[1]
sys.argv = [path, "--help"]
try:
    runpy.run_path(path, run_name="__main__")
    code = "no exit"
except SystemExit as e:
    code = e.code or 0
print("EXIT", code, "IMPORTED", sorted(m for m in ("jax", "shardkit") if m in sys.modules), file=sys.stderr)
"""


@pytest.mark.subprocess
def test_every_bench_script_answers_help_before_importing_jax():
    scripts = sorted(ROOT.glob("bench/*.py"))
    results = _run_all([[sys.executable, "-c", _HELP_BEFORE_JAX, str(s)] for s in scripts])
    for script, res in zip(scripts, results):
        assert res.returncode == 0 and "EXIT 0 IMPORTED []" in res.stderr, (script.name, res.stderr[-2000:])
        assert res.stdout.startswith(f"usage: {script.name}"), (script.name, res.stdout[:300])


@pytest.mark.subprocess
def test_mesh_prints_only_its_answer():
    # The answer as this process (8 simulated devices) describes it; the command starts its own.
    answer = sk.describe_mesh(sk.make_mesh("data=2,tensor=4")) + "\n"
    res, recipe = _run_all([SHARDKIT + ["mesh", "data=2,tensor=4"], [sys.executable, "-m", "models.resnet", "--help"]])
    assert res.returncode == 0
    assert res.stderr == ""
    assert res.stdout == answer
    # A recipe run as a module imports JAX (through models/) as quietly.
    assert recipe.returncode == 0 and recipe.stderr == "" and recipe.stdout.startswith("usage: python -m models.resnet")


def test_filter_drops_only_the_startup_chatter(capfd):
    chatter = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
               "I0000 00:00:1795805965.424223   10259 cudart_stub.cc:31] Could not find cuda drivers on "
               "your machine, GPU will not be used.\n")
    real = "W0000 00:00:1.0   1 some_lib.cc:9] a real warning\nE0000 an error line\n"
    with _quiet.native_stderr_filtered():
        os.write(2, (chatter + real).encode())
    assert capfd.readouterr().err == real
    gloo = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1\n"
    short = "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 3\n"
    assert _quiet.without_chatter(f"step 1 loss{gloo} 4.1\n{short}") == f"step 1 loss 4.1\n{short}"
    # two communicators of one process connecting at once, as a two-process launch printed it
    tangle = ("[Gloo] Rank 1[Gloo] Rank  is connected to 11 is connected to  peer ranks. 1Expected number of "
              "connected peer ranks is :  peer ranks. 1\nExpected number of connected peer ranks is : 1\n")
    assert _quiet.without_chatter(f"{tangle}saved 10\n{short}") == f"saved 10\n{short}"
