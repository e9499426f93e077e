"""Scripts that are not packages (benchmarks/, examples/) loaded as modules by their path."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_file(relpath: str, name: str) -> ModuleType:
    """The module at ROOT/relpath, executed under `name`."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def benchmark_module(name: str) -> Iterator[ModuleType]:
    """benchmarks/<name>.py as a module, with benchmarks/ on sys.path while it is in use (the
    benchmarks import each other by name: bench_spec imports spec_protocol, ...)."""
    path = str(ROOT / "benchmarks")
    sys.path.insert(0, path)
    try:
        yield load_file(f"benchmarks/{name}.py", name)
    finally:
        sys.path.remove(path)
