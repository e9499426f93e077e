"""Wire messages between the processes (msgspec msgpack; no pickle on any socket).

Topology (see docs/architecture.md; ZMQ PUSH for requests, runtime/channel.py for outputs):
  TokenizerManager --PUSH--> Scheduler      TokenizedGenerateReq, AbortReq, FlushCacheReq, StateReq, PinReq
  Scheduler        --chan--> Detokenizer    BatchTokenIDOut, ControlOut
  Detokenizer      --chan--> TokenizerManager  BatchStrOut, ControlOut
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from loom.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class GenerateReqInput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """SGLang's /generate body, one schema for HTTP and the Engine: decoded once at the edge
    (`decode_generate_request`, strict) and expanded into TokenizedGenerateReqs by the
    TokenizerManager. A batch is a list of texts or of id lists; per-prompt fields may be a
    list (one per prompt) or one value for all."""

    text: str | list[str] | None = None
    input_ids: list[Any] | None = None  # list[int] or list[list[int]]; checked on expansion
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: str | None = None  # prefix-cache namespace (SGLang's extra_key / cache_salt)
    cache_salt: str | None = None
    log_metrics: bool = True  # False: this request is left out of /metrics
    # prefill/decode disaggregation (set by the router; a PD-mode server only): one value, or
    # a list (one per prompt, or one per generation); see TokenizerManager._bootstrap
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: int | list[int] | None = None
    bootstrap_room: int | list[int] | None = None


# SGLang GenerateReqInput fields loom does not implement: each is accepted at the value that
# means "off" and refused with a 400 naming it otherwise (never silently ignored).
_OFF: dict[str, tuple] = {
    **dict.fromkeys(
        (
            "session_id",
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "mm_hashes",
            "mm_content_hashes",
            "video_config",
            "watermark",
            "token_ids_logprob",
            "sampling_logprobs_mode",
            "modalities",
            "session_params",
            "lora_path",
            "lora_id",
            "custom_logit_processor",
            "positional_embed_overrides",
            "bootstrap_pair_key",
            "decode_tp_size",
            "routed_dp_rank",
            "data_parallel_rank",
            "disagg_prefill_dp_rank",
            "priority",
            "max_thinking_tokens",
            "num_items_assigned",
            "encoder_urls",
            "max_dynamic_patch",
            "min_dynamic_patch",
            "image_max_dynamic_patch",
            "video_max_dynamic_patch",
            "images_config",
            "mm_processor_kwargs",
            "multi_item_delimiter_indices",
            "token_indices_to_pool",
        ),
        (None, [], {}),
    ),
    **dict.fromkeys(
        (
            "use_audio_in_video",
            "return_sampling_mask",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs",
            "return_hidden_states",
            "return_routed_experts",
            "return_indexer_topk",
            "background",
            "require_reasoning",
            "return_bytes",
            "return_entropy",
            "return_prompt_token_ids",
            "need_wait_for_mm_inputs",
        ),
        (None, False),
    ),
    "routed_experts_start_len": (None, 0),
}
# SGLang fields that only label a request for logs and routing; loom has one route and logs
# no request bodies, so honouring them means accepting them.
_LABELS = frozenset(
    (
        "no_logs",
        "custom_labels",
        "received_time",
        "external_trace_header",
        "conversation_id",
        "routing_key",
        "http_worker_ipc",
    )
)
_FIELDS = frozenset(GenerateReqInput.__struct_fields__)
GENERATE_FIELDS = _FIELDS | frozenset(_OFF) | _LABELS  # every name SGLang's body may carry
_AT = re.compile(r"^(.*?)(?: - at `\$\.?([^`]*)`)?$", re.S)


def _is_off(value: Any, allowed: tuple) -> bool:
    if isinstance(value, list) and value:  # per-prompt lists: every entry off
        return all(_is_off(v, allowed) for v in value)
    return any(value == a and type(value) is type(a) for a in allowed)


def decode_generate_request(body: Any) -> GenerateReqInput:
    """A decoded JSON /generate body (or Engine kwargs) -> GenerateReqInput; ValueError naming
    the field. Unknown fields outside SGLang's schema are ignored with a warning, as SGLang
    does; SGLang fields loom cannot honour are refused when set."""
    if not isinstance(body, dict):
        raise ValueError("body: a JSON object is required")
    for name, allowed in _OFF.items():
        if name in body and not _is_off(body[name], allowed):
            raise ValueError(f"{name}: not supported by loom (send null or leave it out)")
    unknown = sorted(set(body) - _FIELDS - set(_OFF) - _LABELS)
    if unknown:
        logger.warning("/generate: ignoring unknown field(s) %s", ", ".join(unknown))
    fields = {k: v for k, v in body.items() if k in _FIELDS}
    try:
        return msgspec.convert(fields, GenerateReqInput, strict=True)
    except msgspec.ValidationError as e:
        message, where = _AT.match(str(e)).groups()
        raise ValueError(f"{where or 'body'}: {message}") from None


class TokenizedGenerateReq(msgspec.Struct, tag=True, kw_only=True):
    """One request for the scheduler: a single prompt and copy (the TokenizerManager expands
    batches and n), built by keyword."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    extra_key: str | None = None
    bootstrap: tuple[str, int, int] | None = None  # (host, port, room): see GenerateReqInput


class AbortReq(msgspec.Struct, tag=True):
    rid: str  # "" aborts every request


class FlushCacheReq(msgspec.Struct, tag=True):
    request_id: int


class StateReq(msgspec.Struct, tag=True):
    """Ask the scheduler for its counters (server_info, metrics, tests). `list_rids` (the
    TokenizerManager's watchdog probe) also asks for the rids of every request it holds, so a
    request the scheduler never got, or lost, is failed instead of waited for forever."""

    request_id: int
    list_rids: bool = False


class PinReq(msgspec.Struct, tag=True):
    """Pinned prefixes (CAG, radix/hicache.py): action "pin" locks the cached `input_ids`
    under `name` (the TokenizerManager prefilled them first), "unpin" releases `name`, "list"
    lists them. The reply's state carries the result."""

    request_id: int
    action: str
    name: str = ""
    input_ids: list[int] | None = None
    text: str | None = None


class ReqOutput(msgspec.Struct, array_like=True):
    """What one request gained in one step. Logprob entries are (logprob | None, token id)."""

    rid: str
    new_ids: list[int]
    finished_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    output_token_logprobs: list[tuple[float, int]] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] | None = None
    no_stop_trim: bool = False
    jump_forward_tokens: int = 0
    spec_verify_ct: int = 0
    spec_accepted: int = 0  # draft tokens accepted over this request's verify steps
    spec_proposed: int = 0  # draft tokens proposed over them
    rewind: int = 0  # drop this many previously sent output tokens before appending new_ids
    first_decode_step: int | None = None  # forward-step counter values; see Req
    last_decode_step: int | None = None
    decode_batch_max: int = 0


class BatchTokenIDOut(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]


class StrOutput(msgspec.Struct, array_like=True):
    rid: str
    text_delta: str
    token: ReqOutput


class BatchStrOut(msgspec.Struct, tag=True):
    outputs: list[StrOutput]


class ControlOut(msgspec.Struct, tag=True):
    """Reply to FlushCacheReq / StateReq, relayed unchanged by the detokenizer."""

    request_id: int
    ok: bool
    message: str = ""
    state: dict | None = None


ToScheduler = TokenizedGenerateReq | AbortReq | FlushCacheReq | StateReq | PinReq
ToDetokenizer = BatchTokenIDOut | ControlOut
ToTokenizer = BatchStrOut | ControlOut

_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
