"""Loading a script of this repository (bench/, examples/, notebooks/) as a module by its path:
those folders are not packages, and the tests call the scripts' functions in-process instead
of starting Python again."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(relpath: str, name: str) -> types.ModuleType:
    """The file ``ROOT/relpath``, executed as a fresh module ``name`` (also put in
    ``sys.modules``: dataclasses resolve their annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
