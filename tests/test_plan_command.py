"""``shardkit plan`` as the README writes it, in a subprocess: it crashed on every invocation
(``--help`` included) while the in-process tests called ``sk.cost.plan_main`` directly."""

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_plan(verify: bool) -> list[str]:
    """The README's ``shardkit plan ...`` invocation (with or without ``--verify``), as argv."""
    lines = re.findall(r"`(shardkit plan --model [^`]*)`", (ROOT / "README.md").read_text())
    (line,) = [x for x in lines if ("--verify" in x) == verify][:1]
    return shlex.split(line)[2:]


def _shardkit(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    # the command's own devices, not the test process's 8; the suite's compile flags stay
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    proc = subprocess.run([sys.executable, "-m", "shardkit.cli", "plan", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "Traceback" not in out, out[-4000:]
    return proc


@pytest.mark.subprocess
def test_plan_help_and_the_readme_invocation_run(capsys):
    # --help through the command's entry point in this process (one Python start, ~2.5 CPU s,
    # fewer); the README's invocation below starts `python -m shardkit.cli plan` as users do.
    from shardkit import cli

    try:
        code = cli.main(["plan", "--help"])
    except SystemExit as e:  # argparse's --help
        code = e.code
    assert code in (0, None) and "--verify" in capsys.readouterr().out
    args = _readme_plan(verify=False)
    assert args == ["--model", "7b", "--devices", "256"]
    out = _shardkit(*args).stdout
    assert "7b on 256 x h100" in out and "fsdp" in out


@pytest.mark.targets
@pytest.mark.subprocess
@pytest.mark.slow
def test_plan_verify_compiles_the_best_layout_for_h100(tmp_path):
    pytest.importorskip("jax_cuda12_plugin")
    args = _readme_plan(verify=True)
    assert args[args.index("--verify") + 1] == "3" and args[args.index("--target") + 1] == "h100"
    args[args.index("--verify") + 1] = "1"  # one 256-device compile is enough to run the path
    _shardkit(*args, "--json", str(tmp_path / "rows.json"))
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    compiled = [r for r in rows if "compiled_memory" in r]
    assert len(compiled) == 1 and not compiled[0]["compiled_error"] and compiled[0]["compiled_memory"] > 0
