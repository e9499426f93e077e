"""Scripts that are not packages (benchmarks/, examples/) loaded as modules by their path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_file(relpath: str, name: str) -> ModuleType:
    """The module at ROOT/relpath, executed under `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
