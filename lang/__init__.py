"""loom: structured generation and agent programming for LLMs.

`import loom` stays light: the runtime (and torch) load only when an Engine or backend is used.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "Engine": "loom.runtime.engine:Engine",
    "ServerArgs": "loom.runtime.server_args:ServerArgs",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name].split(":")
        value = getattr(importlib.import_module(module_name), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'loom' has no attribute {name!r}")


__all__ = ["Engine", "ServerArgs", "__version__"]
