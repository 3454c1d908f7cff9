"""The README's Python example runs as written (8 simulated devices are already up)."""
import pathlib
import re


def test_readme_example_runs(capsys):
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "per-device memory" in out and "w1" in out
