"""loom: structured generation and agent programming for LLMs.

`import loom as sgl` gives SGLang's language: `function`, `gen`, `select`, roles, backends.
`import loom` stays light: the runtime (and torch) load only when an Engine or backend is used.
"""

from __future__ import annotations

import sys as _sys

# loom.runtime, loom.grammar, loom.radix and loom.kernels are namespace packages (folders without
# __init__.py): from the checkout's root a bare folder name such as `kernels` must never shadow an
# installed distribution of that name (transformers imports Hugging Face's `kernels`), and a
# namespace portion always loses to a regular package later on sys.path. In a wheel they sit
# inside loom/. In an editable install setuptools reaches namespace packages through a path hook
# on a placeholder entry it adds to sys.path, which a regular parent's __path__ must carry too.
__path__ += [
    p for p in _sys.path if p.startswith("__editable__.loom-") and p.endswith("__path_hook__")
]

# Bound eagerly: the submodule `loom.global_config` shares the name, and whichever import of it
# came first would otherwise decide whether `loom.global_config` is the module or the object.
from loom.global_config import global_config  # noqa: E402, F401  (light: no torch)
from loom.runtime.version import __version__  # noqa: E402, F401 (after __path__; in __all__)

_LAZY = {
    # language
    "function": "loom.api:function",
    "gen": "loom.api:gen",
    "gen_int": "loom.api:gen_int",
    "gen_string": "loom.api:gen_string",
    "select": "loom.api:select",
    "system": "loom.api:system",
    "user": "loom.api:user",
    "assistant": "loom.api:assistant",
    "system_begin": "loom.api:system_begin",
    "system_end": "loom.api:system_end",
    "user_begin": "loom.api:user_begin",
    "user_end": "loom.api:user_end",
    "assistant_begin": "loom.api:assistant_begin",
    "assistant_end": "loom.api:assistant_end",
    "set_default_backend": "loom.api:set_default_backend",
    "flush_cache": "loom.api:flush_cache",
    "get_server_info": "loom.api:get_server_info",
    "pin_prefix": "loom.api:pin_prefix",
    "pinned": "loom.api:pinned",
    "Runtime": "loom.runtime.server:Runtime",
    "ProgramState": "loom.state:ProgramState",
    "ProgramStateGroup": "loom.fork:ProgramStateGroup",
    "SglFunction": "loom.program:SglFunction",
    "token_length_normalized": "loom.choices:token_length_normalized",
    "greedy_token_selection": "loom.choices:greedy_token_selection",
    "unconditional_likelihood_normalized": "loom.choices:unconditional_likelihood_normalized",
    "ChatTemplate": "loom.chat_template:ChatTemplate",
    # backends
    "RuntimeEndpoint": "loom.backends.runtime_endpoint:RuntimeEndpoint",
    "EngineBackend": "loom.backends.engine:EngineBackend",
    "OpenAI": "loom.backends.openai:OpenAI",
    "BaseBackend": "loom.backends.base:BaseBackend",
    # runtime
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


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = sorted([*_LAZY, "__version__"])
