"""Request bodies of the HTTP API as pydantic models, so /openapi.json describes them.

Types and OpenAI's documented ranges are checked here (a failure is a 400 naming the field);
everything the runtime knows better (vocabulary, context length, penalties' semantics) is
checked by `make_sampling_params` and the TokenizerManager.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_Stop = str | list[str] | None


class _Body(BaseModel):
    # Unknown fields are an error, never silently dropped; "5" is not a number.
    model_config = ConfigDict(extra="forbid", strict=True)


# --------------------------------------------------------------------------- native
# /generate's body is loom.runtime.io_struct.GenerateReqInput (msgspec, decoded once).


class ConcateAndAppendRequest(_Body):
    src_rids: list[str]
    dst_rid: str


class TokenizeRequest(_Body):
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    rid: str = ""
    abort_all: bool = False


# --------------------------------------------------------------------------- OpenAI
class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingExtras(_Body):
    """Sampling fields shared by both OpenAI endpoints, OpenAI's and SGLang's extras."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: _Stop = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # SGLang / vLLM extras
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: _Stop = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    response_format: ResponseFormat | None = None
    rid: str | None = None


class CompletionRequest(_SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
