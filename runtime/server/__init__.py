"""The HTTP server: SGLang's native API and the OpenAI API over the runtime.

`launch_server(args)` runs it in this process; `Runtime(...)` runs it as a subprocess.
Imports are lazy so that `import loom.runtime.server` stays light.
"""

from __future__ import annotations

_LAZY = {
    "launch_server": "loom.runtime.server.launch:launch_server",
    "create_app": "loom.runtime.server.app:create_app",
    "Runtime": "loom.runtime.server.runtime_client:Runtime",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name].split(":")
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'loom.runtime.server' has no attribute {name!r}")


__all__ = list(_LAZY)
