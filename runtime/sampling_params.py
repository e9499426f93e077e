"""SGLang's sampling parameters: names, defaults and validation.

Every check raises `ValueError` whose message starts with the field name and states the
allowed range, so the HTTP layer can return it as a 400 unchanged.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

_GREEDY_EPS = 1e-6


class SamplingParams(msgspec.Struct, kw_only=True):
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: list[str] | None = None  # finish when the output's tail matches (re.search)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: int | None = None
    logit_bias: dict[int, float] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # steer the grammar to a complete output within max_new_tokens (grammar/closing.py).
    # "auto": on where it can be (json_schema and regex), never failing the request: the
    # OpenAI layer's default for tool calls and response_format; True: refused (400) where it
    # cannot be (ebnf, recursive schemas); None / False: off. Off by default on the native API:
    # building a spec's closer costs far more than its grammar (see architecture.md).
    close_within_budget: bool | str | None = None
    stream_interval: int | None = None  # stream every k tokens (the TokenizerManager)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def grammar_spec(self) -> tuple[str, str] | None:
        for kind in ("regex", "json_schema", "ebnf"):
            value = getattr(self, kind)
            if value:
                return kind, value
        return None

    @property
    def closes_within_budget(self) -> bool:
        spec = self.grammar_spec
        if spec is None or self.close_within_budget in (None, False):
            return False
        return self.close_within_budget is True or spec[0] in ("json_schema", "regex")

    @property
    def max_stop_str_len(self) -> int:
        return max((len(s) for s in self.stop or ()), default=0)


# SGLang's sampling fields loom does not implement: accepted at their default (None), a 400
# naming the field otherwise.
_REFUSED = {
    "beam_width": "beam search is not supported yet",
    "structural_tag": "structural tags are not supported yet",
    "watermark": "watermarking is not supported",
    "custom_params": "custom logit processors are not supported, so their params are refused",
}
_FIELDS = set(SamplingParams.__struct_fields__)
_INT_FIELDS = {"max_new_tokens", "min_new_tokens", "top_k", "n", "sampling_seed", "stream_interval"}
_FLOAT_FIELDS = {
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
}
_BOOL_FIELDS = {
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def make_sampling_params(
    raw: dict[str, Any] | SamplingParams | None, vocab_size: int | None = None
) -> SamplingParams:
    """Build and validate SamplingParams from a user dict (unknown keys are an error)."""
    if raw is None:
        raw = {}
    if isinstance(raw, SamplingParams):
        params = raw
    else:
        if not isinstance(raw, dict):
            raise ValueError(f"sampling_params: must be an object, got {type(raw).__name__}")
        for name, why in _REFUSED.items():
            if raw.get(name) is not None and not (name == "beam_width" and raw[name] == 1):
                raise ValueError(f"{name}: {why}")
        unknown = sorted(set(raw) - _FIELDS - set(_REFUSED))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown field (not one of SGLang's sampling params)")
        values = {k: v for k, v in raw.items() if v is not None and k not in _REFUSED}
        for name, v in values.items():
            if name in _INT_FIELDS and not _is_int(v):
                if isinstance(v, float) and v.is_integer():
                    values[name] = int(v)
                else:
                    raise ValueError(f"{name}: must be an integer, got {v!r}")
            elif name in _FLOAT_FIELDS and not _is_number(v):
                raise ValueError(f"{name}: must be a finite number, got {v!r}")
            elif name in _BOOL_FIELDS and not isinstance(v, bool):
                raise ValueError(f"{name}: must be a boolean, got {v!r}")
            elif name == "close_within_budget" and not (isinstance(v, bool) or v == "auto"):
                raise ValueError(f"{name}: must be true, false or \"auto\", got {v!r}")
        for name in ("stop", "stop_regex"):
            stop = values.get(name)
            if isinstance(stop, str):
                values[name] = [stop]
            elif stop is not None:
                if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
                    raise ValueError(f"{name}: must be a string or a list of strings")
        ids = values.get("stop_token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(_is_int(i) for i in ids)):
            raise ValueError("stop_token_ids: must be a list of integers")
        bias = values.get("logit_bias")
        if bias is not None:
            values["logit_bias"] = _parse_logit_bias(bias)
        for kind in ("regex", "json_schema", "ebnf"):
            spec = values.get(kind)
            if spec is not None and not isinstance(spec, str):
                if kind == "json_schema" and isinstance(spec, dict):
                    values[kind] = msgspec.json.encode(spec).decode()
                else:
                    raise ValueError(f"{kind}: must be a string")
        params = SamplingParams(**values)
    _validate(params, vocab_size)
    return params


def _parse_logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError("logit_bias: must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            token = int(k)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
        if not _is_number(v):
            raise ValueError(f"logit_bias: value for {k!r} must be a finite number")
        out[token] = float(v)
    return out


def _validate(p: SamplingParams, vocab_size: int | None) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(msg)

    need(p.max_new_tokens >= 0, f"max_new_tokens: must be >= 0, got {p.max_new_tokens}")
    need(p.min_new_tokens >= 0, f"min_new_tokens: must be >= 0, got {p.min_new_tokens}")
    need(
        p.min_new_tokens <= p.max_new_tokens,
        f"min_new_tokens: must be <= max_new_tokens ({p.max_new_tokens}), got {p.min_new_tokens}",
    )
    need(p.temperature >= 0.0, f"temperature: must be >= 0, got {p.temperature}")
    need(0.0 < p.top_p <= 1.0, f"top_p: must be in (0, 1], got {p.top_p}")
    need(p.top_k == -1 or p.top_k >= 1, f"top_k: must be -1 (off) or >= 1, got {p.top_k}")
    need(0.0 <= p.min_p <= 1.0, f"min_p: must be in [0, 1], got {p.min_p}")
    need(
        -2.0 <= p.frequency_penalty <= 2.0,
        f"frequency_penalty: must be in [-2, 2], got {p.frequency_penalty}",
    )
    need(
        -2.0 <= p.presence_penalty <= 2.0,
        f"presence_penalty: must be in [-2, 2], got {p.presence_penalty}",
    )
    need(
        0.0 < p.repetition_penalty <= 2.0,
        f"repetition_penalty: must be in (0, 2], got {p.repetition_penalty}",
    )
    need(1 <= p.n <= 128, f"n: must be in [1, 128], got {p.n}")
    need(
        p.sampling_seed is None or 0 <= p.sampling_seed < 2**63,
        f"sampling_seed: must be in [0, 2^63), got {p.sampling_seed}",
    )
    need(
        p.stream_interval is None or p.stream_interval >= 1,
        f"stream_interval: must be >= 1, got {p.stream_interval}",
    )
    if p.stop is not None:
        need(all(len(s) > 0 for s in p.stop), "stop: stop strings must be non-empty")
    for pattern in p.stop_regex or ():
        need(len(pattern) > 0, "stop_regex: patterns must be non-empty")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"stop_regex: {pattern!r} is not a valid regex: {e}") from None
    specs = [k for k in ("regex", "json_schema", "ebnf") if getattr(p, k)]
    need(
        len(specs) <= 1,
        f"regex, json_schema, ebnf: only one constraint may be set, got {', '.join(specs)}",
    )
    need(
        p.close_within_budget is not True or bool(specs),
        "close_within_budget: needs a constraint to close (regex or json_schema)",
    )
    if vocab_size is not None:
        for t in p.stop_token_ids or ():
            need(0 <= t < vocab_size, f"stop_token_ids: {t} is outside [0, {vocab_size})")
        for t in p.logit_bias or {}:
            need(0 <= t < vocab_size, f"logit_bias: token id {t} is outside [0, {vocab_size})")
