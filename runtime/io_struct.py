"""Wire messages between the processes (msgspec msgpack; no pickle on any socket).

Topology (see docs/architecture.md):
  TokenizerManager --PUSH--> Scheduler      TokenizedGenerateReq, AbortReq, FlushCacheReq, StateReq
  Scheduler        --PUSH--> Detokenizer    BatchTokenIDOut, ControlOut
  Detokenizer      --PUSH--> TokenizerManager  BatchStrOut, ControlOut
"""

from __future__ import annotations

import msgspec

from loom.runtime.sampling_params import SamplingParams


class TokenizedGenerateReq(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    extra_key: str | None = None


class AbortReq(msgspec.Struct, tag=True):
    rid: str  # "" aborts every request


class FlushCacheReq(msgspec.Struct, tag=True):
    request_id: int


class StateReq(msgspec.Struct, tag=True):
    """Ask the scheduler for its counters (server_info, metrics, tests)."""

    request_id: int


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


ToScheduler = TokenizedGenerateReq | AbortReq | FlushCacheReq | StateReq
ToDetokenizer = BatchTokenIDOut | ControlOut
ToTokenizer = BatchStrOut | ControlOut

_encoder = msgspec.msgpack.Encoder()


def encode(msg) -> bytes:
    return _encoder.encode(msg)


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
