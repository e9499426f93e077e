"""Wire messages between a prefill and a decode server (msgspec msgpack, no pickle).

decode  --PUSH--> prefill bootstrap port   KVRequest (handshake), KVCancel
prefill --PUSH--> decode receive address   KVHeader + K frame + V frame (or an error header)
"""

from __future__ import annotations

import msgspec


class KVRequest(msgspec.Struct, tag=True):
    """The decode side's handshake for one room: where to send the KV, and how many leading
    prompt tokens it already holds (its radix-cache match: those are not sent)."""

    room: int
    rid: str
    decode_addr: str
    prefix_len: int
    num_tokens: int  # the prompt length the decode side expects (checked by the prefill side)


class KVCancel(msgspec.Struct, tag=True):
    """The decode side gave up on a room (aborted or timed out): free its KV now."""

    room: int
    reason: str


class KVHeader(msgspec.Struct, tag=True, kw_only=True):
    """Positions [start, start + num_tokens) of the prompt's KV follow as two frames, K and V,
    each [num_layers, num_tokens, kv_heads, head_dim] in `dtype`; or `error` and no frames."""

    room: int
    error: str | None = None
    start: int = 0
    num_tokens: int = 0
    dtype: str = ""
    k_shape: list[int] = []
    v_shape: list[int] = []
    first_token: int = -1
    # the prefill side's logprobs (when the request asked): (logprob | None, token id)
    first_logprob: tuple[float, int] | None = None
    first_top_logprobs: list[tuple[float, int]] | None = None
    input_token_logprobs: list[tuple[float | None, int]] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None


ToPrefill = KVRequest | KVCancel
