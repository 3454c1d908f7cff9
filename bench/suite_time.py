"""How long the README's test line takes on a fresh clone, and where the time goes.

Clones a revision into a temporary directory, creates a fresh virtual environment there
(pip's download cache is the machine's), and runs the README's second Quickstart line —
``pip install -e ".[test]" && python -m pytest -q`` — timing the install and the tests apart.
The tests run with ``SHARDKIT_COMPILE_STATS`` (tests/conftest.py), so the table also counts,
per test file, the XLA compiles requested in the test processes, how many the shared
persistent cache answered, their seconds, and the files' wall time (summed over the 2
pytest-xdist workers; subprocesses' compiles are in their files' wall time only).

    python bench/suite_time.py [--rev HEAD] [--baseline 17bf6ab] [--top 25]

With ``--baseline REV`` the same is measured for that revision first, in the same run, and
the table shows both (a ratio, not a fixed number of seconds: machines of one kind differ
by up to ~1.8x). A revision whose conftest lacks the stats hook reports wall times only.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(rev: str, workdir: str) -> dict:
    """Install + tests of ``rev`` in a fresh clone and venv under ``workdir``."""
    clone, venv = os.path.join(workdir, "clone"), os.path.join(workdir, "venv")
    subprocess.run(["git", "clone", "-q", ROOT, clone], check=True)
    subprocess.run(["git", "-C", clone, "checkout", "-q", rev], check=True)
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    py = os.path.join(venv, "bin", "python")
    env = dict(os.environ, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"])
    env.pop("PYTHONPATH", None)
    t0 = time.perf_counter()
    subprocess.run([py, "-m", "pip", "install", "-q", "-e", ".[test]"], cwd=clone, env=env, check=True)
    install = time.perf_counter() - t0
    stats = os.path.join(workdir, "stats.jsonl")
    env["SHARDKIT_COMPILE_STATS"] = stats
    t0 = time.perf_counter()
    res = subprocess.run([py, "-m", "pytest", "-q"], cwd=clone, env=env, capture_output=True, text=True)
    tests = time.perf_counter() - t0
    tail = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-500:]
    # pytest's -ra summary names every test that failed or errored: kept, so a failure in a
    # timing run can be rerun by name instead of guessed at
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in res.stdout.splitlines()
              if line.startswith(("FAILED ", "ERROR "))]
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0, 0.0, 0.0, 0.0])
    per_test = []
    if os.path.exists(stats):
        for line in open(stats):
            r = json.loads(line)
            per_test.append(r)
            f = files[r["test"].split("::")[0].removeprefix("tests/")]
            for i, k in enumerate(("compiles", "cache_hits", "compile_s", "wall_s", "cpu_s")):
                f[i + 1] += r.get(k, 0.0)  # cpu_s: revisions before it was recorded have none
            f[0] += 1
    per_test.sort(key=lambda r: -r["wall_s"])
    return {"rev": rev, "commit": subprocess.run(["git", "-C", clone, "rev-parse", "--short", "HEAD"],
                                                 capture_output=True, text=True).stdout.strip(),
            "install_s": install, "tests_s": tests, "total_s": install + tests,
            "returncode": res.returncode, "summary": tail, "failed": failed, "files": dict(files),
            "tests": per_test, "output_tail": res.stdout[-20000:] if res.returncode else ""}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, read before anything heavy is imported: ``--help`` answers at once."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--baseline", default=None, help="a revision to measure first, for the ratio")
    ap.add_argument("--top", type=int, default=25, help="test files shown, by wall time")
    ap.add_argument("--out", default="bench/results/suite_time.json")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    runs = []
    for rev in [r for r in (a.baseline, a.rev) if r]:
        with tempfile.TemporaryDirectory(prefix="shardkit-suite-") as tmp:
            runs.append(measure(rev, tmp))
    console = Console(width=160)
    t = Table(title=f"README test line on a fresh clone ({os.cpu_count()} cores)")
    for c in ("revision", "install s", "tests s", "total s", "min:s", "result"):
        t.add_column(c, justify="left" if c in ("revision", "result") else "right")
    for r in runs:
        t.add_row(r["rev"], f"{r['install_s']:.0f}", f"{r['tests_s']:.0f}", f"{r['total_s']:.0f}",
                  f"{int(r['total_s'] // 60)}:{int(r['total_s'] % 60):02d}", r["summary"])
    if len(runs) == 2:
        t.add_row("ratio", *(f"{runs[1][k] / runs[0][k]:.2f}" for k in ("install_s", "tests_s", "total_s")), "", "")
    console.print(t)
    last = runs[-1]
    f = Table(title=f"where the time goes ({last['rev']}): per test file, summed over workers")
    for c in ("file", "tests", "compiles", "cache hits", "compile s", "wall s", "cpu s"):
        f.add_column(c, justify="left" if c == "file" else "right")
    rows = sorted(last["files"].items(), key=lambda kv: -kv[1][4])
    for name, (n, comp, hits, cs, ws, cpu) in rows[:a.top]:
        f.add_row(name, str(n), str(comp), str(hits), f"{cs:.0f}", f"{ws:.0f}", f"{cpu:.0f}")
    tot = [sum(v[i] for v in last["files"].values()) for i in range(6)]
    f.add_row("all", str(tot[0]), str(tot[1]), str(tot[2]), f"{tot[3]:.0f}", f"{tot[4]:.0f}", f"{tot[5]:.0f}")
    console.print(f)
    slow = Table(title=f"the {a.top} slowest tests ({last['rev']})")
    for c in ("test", "compiles", "compile s", "wall s", "cpu s"):
        slow.add_column(c, justify="left" if c == "test" else "right")
    for r in last["tests"][:a.top]:
        slow.add_row(r["test"], str(r["compiles"]), f"{r['compile_s']:.0f}", f"{r['wall_s']:.0f}",
                     f"{r.get('cpu_s', 0.0):.0f}")
    console.print(slow)
    for r in runs:
        if r["failed"]:
            console.print(f"[red]{r['rev']}: {len(r['failed'])} failed[/red]: " + ", ".join(r["failed"]))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(runs, fh, indent=1)
    sys.exit(0 if all(r["returncode"] == 0 for r in runs) else 1)


if __name__ == "__main__":
    main()
