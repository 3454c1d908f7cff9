"""Every ```python block of README.md runs as written, in order, in one namespace (a later block
may use what an earlier one built), with the 8 simulated devices the tests already have.

A block that needs what the tests do not have (a GPU, a cluster) says so on its first line, where
a reader sees it: ``# not run by the tests: <reason>``. It is skipped with that reason; every
other block must run, so the README cannot drift from the API."""
import pathlib
import re

import pytest

README = pathlib.Path(__file__).parents[1] / "README.md"
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"#\s*not run by the tests:\s*(\S.*)")


def blocks() -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run or None)`` for each ```python block, in order."""
    text = README.read_text()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start(1)) + 1
        code = m.group(1)
        marker = _NOT_RUN.match(code.split("\n", 1)[0].strip())
        out.append((line, code, marker.group(1) if marker else None))
    return out


def test_readme_python_blocks_run(capsys):
    runnable = [(line, code) for line, code, reason in blocks() if reason is None]
    assert runnable, "README.md has no ```python block to run"
    namespace = {"__name__": "readme"}
    for line, code in runnable:
        # Padded so a traceback names the README's own line numbers.
        exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
    out = capsys.readouterr().out
    assert "per-device memory" in out and "w1" in out  # the "Using it" block's explain() and describe()


NOT_RUN = [(line, reason) for line, _, reason in blocks() if reason is not None]
if NOT_RUN:  # reported as skips, each with its reason
    @pytest.mark.parametrize("line,reason", NOT_RUN)
    def test_readme_blocks_marked_not_run(line, reason):
        pytest.skip(f"README.md line {line}: {reason}")
