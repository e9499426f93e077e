"""Triton kernels for CUDA, each beside the plain-torch reference it must equal.

Every module holds a `*_ref` function (plain torch, the contract) and the Triton launcher with
the same signature; tests/test_kernels*.py run both under TRITON_INTERPRET=1 on the CPU.
Importing a kernel module imports triton; this package itself imports nothing heavy. On the
CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

MODULES = (
    "_online_softmax",  # first: the attention kernels import its helpers
    "decode_attention",
    "extend_attention",
    "cascade",
    "kv_store",
    "bitmask",
    "norm",
    "rotary",
    "wq_gemm",
)


def load_interpreted(name: str) -> ModuleType:
    """`loom.kernels.<name>` with its kernels run by Triton's CPU interpreter. Tests use it:
    the interpreter is switched on for this process through Triton's knob (not left in the
    environment, so the servers tests start do not inherit it)."""
    import triton

    previous = os.environ.get("TRITON_INTERPRET")
    triton.knobs.runtime.interpret = True  # also writes the variable: restored below
    if previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = previous
    _interpret_triton_language()
    # kernels defined before without the interpreter are rebuilt in place, so modules that
    # reach them through their module object (cascade -> decode_attention) follow
    for dep in MODULES:
        loaded = sys.modules.get(f"{__package__}.{dep}")
        if loaded is not None and not getattr(loaded, "INTERPRETED", False):
            importlib.reload(loaded)
    return importlib.import_module(f"{__package__}.{name}")


def _interpret_triton_language() -> None:
    """triton.language's own @jit helpers (tl.cdiv, tl.max, tl.sum, ...) were defined when
    triton was imported; if the interpreter was off then, redefine them for the interpreter
    (kernels call them, and a compiled-mode helper refuses to run outside a compiled kernel)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(tl.standard.cdiv, InterpretedFunction):
        return
    standard = importlib.reload(tl.standard)
    for name in dir(standard):
        value = getattr(standard, name)
        if isinstance(value, InterpretedFunction) and hasattr(tl, name):
            setattr(tl, name, value)
