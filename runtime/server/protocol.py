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


class PinPrefixRequest(_Body):
    name: str
    text: str | None = None
    input_ids: list[int] | None = None


class UnpinPrefixRequest(_Body):
    name: str


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    rid: str = ""
    abort_all: bool = False


# --------------------------------------------------------------------------- OpenAI
class _Lenient(BaseModel):
    """OpenAI bodies: fields loom does not know are kept in `model_extra` (the route logs each
    name once and ignores it, as vLLM and SGLang do); known fields keep strict types."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class _SamplingExtras(_Lenient):
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
    close_within_budget: bool | None = None  # loom: see SamplingParams
    response_format: ResponseFormat | None = None
    rid: str | None = None
    # prefill/decode disaggregation (SGLang's names; set by `loom router --pd-disaggregation`)
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


class CompletionRequest(_SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    suffix: str | None = None


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # None (not stated): one call per reply, so a small model is not led into repeating a
    # call; several calls only when a request states true
    parallel_tool_calls: bool | None = None
    # loom: false sends the tools and parses the reply for calls without the call grammar (how
    # most engines treat `auto`); a baseline for measuring what the grammar buys
    constrain_tools: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
