"""Run configs: ``--config run.toml`` supplies flag values, flags given on the command line
override them, and every run writes its resolved flags as ``config.toml`` beside its
checkpoints, so ``--config <run dir>/config.toml`` reproduces it.

A config file is flat TOML, one key per flag, spelt as the flag without its dashes
(``warmup-steps = 100``) or with underscores (``warmup_steps = 100``):

    mesh = "data=4,tensor=2"
    steps = 500
    lr = 1e-3
    decay = "linear"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tomllib

NOT_WRITTEN = ("config", "resume")  # how to run, not what: a reproduction starts afresh
FILENAME = "config.toml"


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)`` with ``--config FILE`` values as the defaults.

    Adds ``--config`` to ``parser``. Errors (a missing file, bad TOML, an unknown key, a value
    of the wrong type or not among a flag's choices) go through ``parser.error``, naming every
    offending key.
    """
    parser.add_argument("--config", metavar="FILE.toml", help="flag values from a TOML file (e.g. a run's "
                        f"{FILENAME}); flags given on the command line override it")
    known, _ = parser.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**load(parser, known.config))
    return parser.parse_args(argv)


def load(parser: argparse.ArgumentParser, path: str) -> dict:
    """The flag values in the TOML file ``path``, checked against ``parser`` (through
    ``parser.error`` on a problem)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        parser.error(f"--config {path}: {e.strerror or e}")
    except tomllib.TOMLDecodeError as e:
        parser.error(f"--config {path}: not valid TOML: {e}")
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values, problems = {}, []
    for key, value in raw.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            problems.append(f"unknown key {key!r}")
            continue
        try:
            values[dest] = _convert(action, value)
        except (TypeError, ValueError) as e:
            problems.append(f"{key} = {value!r}: {e}")
    if problems:
        parser.error(f"--config {path}: " + "; ".join(problems) + f" (keys are the flags: "
                     f"{', '.join(sorted(a.replace('_', '-') for a in actions))})")
    return values


def _convert(action: argparse.Action, value):
    if isinstance(value, (dict, list)):
        raise TypeError("a flag takes one value, not a table or list")
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        if not isinstance(value, bool):
            raise TypeError("must be true or false")
        return value
    kind = action.type or str
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("must be an integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError("must be a number")
        value = float(value)
    elif kind is str:
        if not isinstance(value, str):
            raise TypeError("must be a string")
    else:
        value = kind(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
    return value


def write(args: argparse.Namespace, directory: str) -> str:
    """Writes ``args`` (every flag but ``--config``/``--resume``; unset ones left out) as
    ``directory/config.toml``; returns its path."""
    os.makedirs(directory, exist_ok=True)
    lines = ["# the resolved flags of this run; reproduce it with --config <this file> "
             "(and a new --checkpoint-dir)"]
    for key, value in sorted(vars(args).items()):
        if key not in NOT_WRITTEN and value is not None:
            lines.append(f"{key.replace('_', '-')} = {_toml(value)}")
    path = os.path.join(directory, FILENAME)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else
                                                         ("inf" if value > 0 else "-inf"))
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) to TOML")
