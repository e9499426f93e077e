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
    as_expr,
    schema_to_str,
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
    from loom.program import resolve_backend

    return resolve_backend(backend)


def flush_cache(backend: Any = None):
    return _backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict:
    return _backend(backend).get_server_info()


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
) -> SglExpr:
    """Generate into variable `name`. Unset parameters inherit from `run(...)`; `choices`
    makes it a `select`; `n > 1` makes the variable a list."""
    if choices:
        return SglSelect(
            name,
            choices,
            0.0 if temperature is None else temperature,
            token_length_normalized if choices_method is None else choices_method,
        )
    if regex is not None:
        re.compile(regex)  # a bad pattern fails here, in the program's own line
    return SglGen(
        name,
        SglSamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            n=n,
            stop=stop,
            stop_token_ids=stop_token_ids,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty,
            ignore_eos=ignore_eos,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
            return_text_in_logprobs=return_text_in_logprobs,
            dtype=dtype,
            regex=regex,
            json_schema=None if json_schema is None else schema_to_str(json_schema),
        ),
    )


def _typed_gen(dtype, name, kwargs) -> SglExpr:
    return gen(name, dtype=dtype, **kwargs)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> SglExpr:
    """`gen` constrained to an integer (regex `[-+]?[0-9]+`, stopping at a space or newline)."""
    kwargs = {k: v for k, v in locals().items() if k != "name"}
    return _typed_gen(int, name, kwargs)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> SglExpr:
    """`gen` constrained to a double-quoted string of word characters and spaces."""
    kwargs = {k: v for k, v in locals().items() if k != "name"}
    return _typed_gen(str, name, kwargs)


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
