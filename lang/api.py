"""The public functions of the language (`import loom as sgl; sgl.gen(...)`), with SGLang's
names, signatures and defaults."""

from __future__ import annotations

import re
from typing import Any

from loom.choices import ChoicesSamplingMethod, token_length_normalized
from loom.global_config import global_config
from loom.ir import (
    SglExpr,
    SglExprList,
    SglGen,
    SglRoleBegin,
    SglRoleEnd,
    SglSamplingParams,
    SglSelect,
    SglToolGen,
    as_expr,
)
from loom.program import SglFunction


def function(func=None, num_api_spec_tokens: int | None = None):
    """`@function` or `@function(...)`: a program whose first argument is the state `s`."""
    if func is not None:
        return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)

    def decorator(f):
        return SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)

    return decorator


def set_default_backend(backend: Any) -> None:
    """A backend, a `loom.Engine` or a `loom.Runtime` (its endpoint is used)."""
    from loom.backends.engine import as_backend

    global_config.default_backend = as_backend(backend)


def _backend(backend: Any):
    from loom.backends.engine import resolve_backend

    return resolve_backend(backend)


def flush_cache(backend: Any = None):
    return _backend(backend).flush_cache()


def pin_prefix(name: str, text: str, backend: Any = None) -> dict:
    """Compute and pin `text` on the server (CAG); programs start from it with `pinned(name)`."""
    return _backend(backend).pin_prefix(name, text)


def pinned(name: str):
    """The pinned prefix `name` as program text: `s += loom.pinned("manual")`."""
    from loom.ir import SglPinned

    return SglPinned(name)


def get_server_info(backend: Any = None) -> dict:
    return _backend(backend).get_server_info()


def gen(
    name: str | None = None,
    *,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    tools: list | None = None,
    tool_choice: str = "auto",
    max_tool_rounds: int = 4,
    **sampling: Any,
) -> SglExpr:
    """Generate into variable `name`. `sampling`: SGLang's gen parameters (`max_tokens`,
    `min_tokens`, `n`, `stop`, `stop_token_ids`, `stop_regex`, `temperature`, `top_p`,
    `top_k`, `min_p`, `frequency_penalty`, `presence_penalty`, `ignore_eos`, the logprob
    fields, `dtype`, `regex`, `json_schema`: loom.ir.SglSamplingParams); unset ones inherit
    from `run(...)`. `choices` makes it a `select`; `n > 1` makes the variable a list.
    `tools` (Python functions) lets the model call them in a ReAct loop (loom.tools): every
    call names a real tool with arguments its signature accepts; `s[name]` is the last
    round's text and `s.get_meta_info(name)["tool_calls"]` the calls made with their results."""
    params = SglSamplingParams.from_kwargs("gen", sampling)
    if tools is not None:
        return SglToolGen(name, params, tools, tool_choice, max_tool_rounds)
    if choices:
        temperature = params.temperature
        return SglSelect(
            name,
            choices,
            0.0 if temperature is None else temperature,
            token_length_normalized if choices_method is None else choices_method,
        )
    if params.regex is not None:
        re.compile(params.regex)  # a bad pattern fails here, in the program's own line
    return SglGen(name, params)


def _typed_gen(dtype: type, where: str, name: str | None, sampling: dict) -> SglExpr:
    taken = {"dtype", "regex", "json_schema", "min_tokens"} & set(sampling)
    if taken:
        raise TypeError(f"{where}() got an unexpected keyword argument {sorted(taken)[0]!r}")
    return gen(name, dtype=dtype, **sampling)


def gen_int(name: str | None = None, **sampling: Any) -> SglExpr:
    """`gen` constrained to an integer (regex `[-+]?[0-9]+`, stopping at a space or newline)."""
    return _typed_gen(int, "gen_int", name, sampling)


def gen_string(name: str | None = None, **sampling: Any) -> SglExpr:
    """`gen` constrained to a double-quoted string of word characters and spaces."""
    return _typed_gen(str, "gen_string", name, sampling)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> SglExpr:
    """Choose one of `choices` by the model's log-probabilities of each choice's tokens."""
    if choices is None:
        raise ValueError("select: choices must be given")
    return SglSelect(name, choices, temperature, choices_method)


def _role_common(name: str, expr: Any = None) -> SglExpr:
    if expr is None:
        return SglExprList([SglRoleBegin(name), SglRoleEnd(name)])
    return SglExprList([SglRoleBegin(name), as_expr(expr), SglRoleEnd(name)])


def system(expr: Any = None) -> SglExpr:
    return _role_common("system", expr)


def user(expr: Any = None) -> SglExpr:
    return _role_common("user", expr)


def assistant(expr: Any = None) -> SglExpr:
    return _role_common("assistant", expr)


def system_begin() -> SglExpr:
    return SglRoleBegin("system")


def system_end() -> SglExpr:
    return SglRoleEnd("system")


def user_begin() -> SglExpr:
    return SglRoleBegin("user")


def user_end() -> SglExpr:
    return SglRoleEnd("user")


def assistant_begin() -> SglExpr:
    return SglRoleBegin("assistant")


def assistant_end() -> SglExpr:
    return SglRoleEnd("assistant")
