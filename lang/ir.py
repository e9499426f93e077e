"""The expressions a program appends to its state: `s += text | gen | select | role | ...`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# SGLang's regexes for typed gens (`dtype=int`, `gen_int`, `gen_string`, ...).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

_DTYPE_REGEX = {
    "int": (REGEX_INT, [" ", "\n"]),
    "float": (REGEX_FLOAT, [" ", "\n"]),
    "str": (REGEX_STR, []),
    "bool": (REGEX_BOOL, []),
}


@dataclasses.dataclass
class SglSamplingParams:
    """A gen's sampling parameters. In a `gen`, None means "inherit from `run(...)`"."""

    max_new_tokens: int | None = 128
    min_new_tokens: int | None = 0
    n: int | None = 1
    stop: str | list[str] | tuple | None = ()
    stop_token_ids: list[int] | tuple | None = ()
    stop_regex: str | list[str] | tuple | None = ()
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    ignore_eos: bool | None = False
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None

    def merged(self, override: SglSamplingParams) -> SglSamplingParams:
        """These defaults, overridden by every non-None field of `override`."""
        values = {
            f.name: getattr(override, f.name)
            for f in dataclasses.fields(self)
            if getattr(override, f.name) is not None
        }
        return dataclasses.replace(self, **values)

    def stop_list(self) -> list[str]:
        return _as_list(self.stop)

    @classmethod
    def from_kwargs(cls, where: str, kwargs: dict[str, Any]) -> SglSamplingParams:
        """A gen's params from its keyword arguments (SGLang's names: `max_tokens`,
        `min_tokens`); every field not given is None, i.e. inherited from `run(...)`."""
        values = dict.fromkeys(_FIELDS)
        for key, value in kwargs.items():
            if key not in GEN_FIELDS and key not in GEN_ALIASES:
                raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
            values[GEN_ALIASES.get(key, key)] = value
        if values["json_schema"] is not None:
            values["json_schema"] = schema_to_str(values["json_schema"])
        return cls(**values)

    @classmethod
    def run_defaults(cls, where: str, kwargs: dict[str, Any]) -> SglSamplingParams:
        """Pop the sampling defaults of `run(...)`/`run_batch(...)` out of `kwargs` (the rest
        are the program's arguments); unset ones take SGLang's defaults."""
        values = {k: kwargs.pop(k) for k in RUN_FIELDS if k in kwargs}
        params = cls(**values)
        params.stop = params.stop or []
        params.stop_token_ids = params.stop_token_ids or []
        params.stop_regex = params.stop_regex or []
        return params

    def to_native(self) -> tuple[dict, dict]:
        """(sampling_params, request fields) of SGLang's native /generate API."""
        stop = self.stop_list()
        regex = self.regex
        if self.dtype is not None:
            name = (
                self.dtype if isinstance(self.dtype, str) else getattr(self.dtype, "__name__", "")
            )
            if name not in _DTYPE_REGEX:
                raise ValueError(f"dtype: must be int, float, str or bool, got {self.dtype!r}")
            regex, extra_stop = _DTYPE_REGEX[name]
            stop += [s for s in extra_stop if s not in stop]
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "n": self.n,
            "stop": stop,
            "stop_token_ids": list(self.stop_token_ids or []),
            "stop_regex": _as_list(self.stop_regex),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "ignore_eos": self.ignore_eos,
        }
        if regex is not None:
            params["regex"] = regex
        if self.json_schema is not None:
            params["json_schema"] = schema_to_str(self.json_schema)
        fields = {
            k: getattr(self, k)
            for k in (
                "return_logprob",
                "logprob_start_len",
                "top_logprobs_num",
                "return_text_in_logprobs",
            )
            if getattr(self, k) is not None
        }
        return params, fields


_FIELDS = tuple(f.name for f in dataclasses.fields(SglSamplingParams))
# The sampling vocabulary, declared once (SglSamplingParams): a gen takes every field (with
# SGLang's `max_tokens`/`min_tokens` spellings), `run(...)` the ones that make sense as a
# default for every gen of a program.
GEN_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
GEN_FIELDS = frozenset(_FIELDS) - set(GEN_ALIASES.values())
RUN_FIELDS = tuple(
    f for f in _FIELDS if f not in ("min_new_tokens", "dtype", "regex", "json_schema")
)


def _as_list(value: Any) -> list:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def schema_to_str(schema: Any) -> str:
    """A JSON schema given as a string, a dict or a pydantic model class, as a string."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    if hasattr(schema, "model_json_schema"):
        return json.dumps(schema.model_json_schema())
    raise ValueError(f"json_schema: must be a string, a dict or a pydantic model, got {schema!r}")


class SglExpr:
    """Base of everything `s += ...` accepts; `+` builds an `SglExprList`."""

    def __add__(self, other: Any) -> SglExprList:
        return SglExprList([self, as_expr(other)])

    def __radd__(self, other: Any) -> SglExprList:
        return SglExprList([as_expr(other), self])


def as_expr(value: Any) -> SglExpr:
    if isinstance(value, SglExpr):
        return value
    if isinstance(value, str):
        return SglConstantText(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program state")


class SglExprList(SglExpr):
    def __init__(self, exprs: list[SglExpr]):
        self.exprs: list[SglExpr] = []
        for e in exprs:
            self.exprs.extend(e.exprs if isinstance(e, SglExprList) else [e])

    def __repr__(self) -> str:
        return f"ExprList({self.exprs})"


class SglConstantText(SglExpr):
    def __init__(self, value: str):
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class SglPinned(SglExpr):
    """The text of a prefix pinned on the server (`/pin_prefix`, CAG): appended like constant
    text, so the program's first request extends the pinned KV instead of prefilling it."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"Pinned({self.name!r})"


class SglGen(SglExpr):
    def __init__(self, name: str | None, sampling_params: SglSamplingParams):
        self.name = name
        self.sampling_params = sampling_params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class SglToolGen(SglExpr):
    """A gen that may call Python functions (loom.tools): rounds of generation, each ending in
    free text or one schema-valid call whose result the program appends as an Observation."""

    def __init__(
        self,
        name: str | None,
        sampling_params: SglSamplingParams,
        tools: list,
        tool_choice: str,
        max_rounds: int,
    ):
        from loom.tools import as_tools

        if tool_choice not in ("auto", "required"):
            raise ValueError(f"tool_choice: must be 'auto' or 'required', got {tool_choice!r}")
        if max_rounds < 1:
            raise ValueError(f"max_tool_rounds: must be >= 1, got {max_rounds}")
        if sampling_params.regex is not None or sampling_params.json_schema is not None:
            raise ValueError("tools: cannot be combined with regex or json_schema")
        self.name = name
        self.sampling_params = sampling_params
        self.tools = as_tools(tools)
        self.tool_choice = tool_choice
        self.max_rounds = max_rounds

    def __repr__(self) -> str:
        return f"ToolGen({self.name!r}, tools={[t.name for t in self.tools]})"


class SglSelect(SglExpr):
    def __init__(self, name: str | None, choices: list[str], temperature: float, choices_method):
        if not choices or not all(isinstance(c, str) for c in choices):
            raise ValueError("choices: must be a non-empty list of strings")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class SglRoleBegin(SglExpr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class SglRoleEnd(SglExpr):
    def __init__(self, role: str):
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class SglVarScopeBegin(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglVarScopeEnd(SglExpr):
    def __init__(self, name: str):
        self.name = name


class SglCommitLazy(SglExpr):
    """Send the text so far to the backend prefill-only, so later requests hit its cache."""


class SglConcateAndAppend(SglExpr):
    """Append the text each forked state generated after the fork point."""

    def __init__(self, states: list):
        self.states = states


class SglArgument(SglExpr):
    """A program argument, as seen while tracing."""

    def __init__(self, name: str, value: Any = None):
        self.name = name
        self.value = value

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"
