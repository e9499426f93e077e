"""SGLang's native routes: /generate, health, info, cache and abort control, tokenize."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from loom.runtime.io_struct import GenerateReqInput, decode_generate_request
from loom.runtime.server.common import APIError, JSONOut, ServerState, json_dumps, public_args
from loom.runtime.server.disconnect import unless_disconnected as _unless_disconnected
from loom.runtime.server.protocol import (
    AbortRequest,
    ConcateAndAppendRequest,
    DetokenizeRequest,
    PinPrefixRequest,
    TokenizeRequest,
    UnpinPrefixRequest,
)

router = APIRouter()

_HEALTH_TIMEOUT = 20.0
_CONTROL_TIMEOUT = 10.0


def server_state(request: Request) -> ServerState:
    return request.app.state.server


async def control(state: ServerState, coro) -> Any:
    """A control round trip to the scheduler: 503 at once if a runtime process is dead, and
    never a hang (TimeoutError -> 503)."""
    if state.tm.dead_reason:
        coro.close()
        raise APIError(503, f"server unavailable: {state.tm.dead_reason}")
    return await asyncio.wait_for(coro, _CONTROL_TIMEOUT)


def _client_gone() -> Any:
    raise APIError(499, "client disconnected")


async def unless_disconnected(request: Request, coro) -> Any:
    """Await a non-streaming generation, cancelling it (which aborts the request in the
    scheduler and frees its KV) if the client goes away first."""
    return await _unless_disconnected(request, coro, _client_gone)


# --------------------------------------------------------------------------- SSE
# Characters JSON leaves raw inside strings but line readers split on (str.splitlines, which
# httpx and the OpenAI client use for SSE): escaped, or one event arrives as broken halves.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj: Any) -> str:
    return f"data: {json_dumps(obj).translate(_LINE_BREAKS)}\n\n"


async def prime(agen: AsyncIterator) -> Any:
    """Run a stream to its first item so input errors become a 4xx, not a broken stream."""
    try:
        return await agen.__anext__()
    except StopAsyncIteration:
        return None
    except BaseException:
        await agen.aclose()
        raise


def sse_response(
    first: Any, agen: AsyncIterator, render: Callable[[Any], list[str]], tail: Callable
) -> StreamingResponse:
    """Stream `render(item)` events, then `tail()` and `[DONE]`. Closing the stream (a client
    that disconnected) closes `agen`, which aborts the request and frees its KV."""

    async def events():
        try:
            if first is not None:
                for event in render(first):
                    yield event
            async for item in agen:
                for event in render(item):
                    yield event
            for event in tail():
                yield event
        except (ValueError, RuntimeError) as e:  # RequestError, or a dead runtime process
            yield sse({"error": {"message": str(e)}})
        finally:
            await agen.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# --------------------------------------------------------------------------- generate
def _generate_body_schema() -> dict:
    """/openapi.json's description of the body, taken from the one request struct."""
    (schema,), components = msgspec.json.schema_components(
        [GenerateReqInput], ref_template="#/components/schemas/{name}"
    )
    body = components["GenerateReqInput"]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


async def read_json(request: Request) -> Any:
    """The body as JSON whatever its Content-Type (SGLang's clients do not always send one)."""
    raw = await request.body()
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise APIError(400, f"body: malformed JSON ({e})") from None


def _without_prompt_logprobs(out):
    """A decode server's non-streamed answer to one generation as SGLang's decode worker gives
    it: no `input_token_logprobs` (an empty list), because a PD router prepends the prefill
    server's copy (sglang-router and `loom router` alike): the prompt's logprobs then appear
    exactly once, as long as `input_top_logprobs`, which the router does not merge.
    sglang-router 0.3.2 merges nothing else: not a batch's answers (a list), and not a stream
    (it sends the prefill server the stream flag too and cannot read the SSE answer as JSON),
    so those keep the decode server's own copy."""
    if isinstance(out, dict) and "input_token_logprobs" in out["meta_info"]:
        out["meta_info"]["input_token_logprobs"] = []
    return out


@router.post("/generate", openapi_extra=_generate_body_schema())
async def generate(request: Request):
    state = server_state(request)
    obj = decode_generate_request(await read_json(request))
    if not obj.stream:
        out = await unless_disconnected(request, state.tm.generate(obj))
        if state.args.disaggregation_mode == "decode":
            out = _without_prompt_logprobs(out)
        return JSONOut(out)
    agen = state.tm.generate_stream(obj)
    first = await prime(agen)
    return sse_response(first, agen, lambda out: [sse(out)], lambda: [])


@router.post("/concate_and_append_request")
async def concate_and_append_request(body: ConcateAndAppendRequest, request: Request):
    """SGLang's `join(mode="concate_and_append")` hint. SGLang's client names its fork states
    by ids it never sends with /generate, so no server can tell which KV they hold; the client
    appends the forks' text itself, and the next /generate reuses the shared prefix from the
    radix cache and computes the appended fork text (as the text join mode does). Answered
    so that SGLang programs run; nothing is copied, and the reply says so."""
    if len(set(body.src_rids)) != len(body.src_rids):
        raise APIError(400, "src_rids: the ids must be distinct")
    return {
        "success": True,
        "kv_copied": False,
        "message": "text appended by the client; the shared prefix is reused from the prefix cache",
    }


# --------------------------------------------------------------------------- health
@router.get("/health")
async def health(request: Request):
    reason = server_state(request).tm.dead_reason
    if reason:
        raise APIError(503, f"unhealthy: {reason}")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request):
    """Healthy when a one-token generation goes through the whole pipeline."""
    state = server_state(request)
    if state.tm.dead_reason:
        raise APIError(503, f"unhealthy: {state.tm.dead_reason}")
    obj = GenerateReqInput(
        text="." if state.tokenizer is not None else None,
        input_ids=None if state.tokenizer is not None else [0],
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        log_metrics=False,
    )
    try:
        await asyncio.wait_for(state.tm.generate(obj), _HEALTH_TIMEOUT)
    except asyncio.TimeoutError:
        raise APIError(503, "unhealthy: a one-token generation timed out") from None
    except RuntimeError as e:
        raise APIError(503, f"unhealthy: {e}") from None
    return Response(status_code=200)


# --------------------------------------------------------------------------- info
def model_info(state: ServerState) -> dict:
    return {
        "model_path": state.args.model_path,
        "tokenizer_path": state.args.tokenizer_path,
        "served_model_name": state.args.served_model_name,
        "is_generation": True,
        "context_length": state.context_len,
        "vocab_size": state.tm.vocab_size,
    }


@router.get("/model_info")
@router.get("/get_model_info")
async def get_model_info(request: Request):
    return model_info(server_state(request))


@router.get("/server_info")
@router.get("/get_server_info")
async def get_server_info(request: Request):
    from loom.runtime.version import __version__

    state = server_state(request)
    internal = await control(state, state.tm.get_internal_state())
    return {
        **public_args(state.args),
        **internal,
        "internal_states": [internal],
        "process_pids": {p.name: p.pid for p in state.procs},
        "version": __version__,
    }


@router.get("/get_load")
async def get_load(request: Request):
    """SGLang's load report, one entry per data-parallel rank (loom's server is one rank):
    requests running or waiting, and tokens (KV held by live requests plus the prompts still
    waiting), which sglang-router's load monitor sums into each worker's load."""
    state = server_state(request)
    internal = await control(state, state.tm.get_internal_state())
    waiting = internal.get("num_waiting_reqs", 0)
    return [
        {
            "dp_rank": 0,
            "num_reqs": internal.get("num_running_reqs", 0) + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": internal.get("num_used_tokens", 0)
            + internal.get("num_waiting_tokens", 0),
            "ts_tic": time.perf_counter(),
        }
    ]


# --------------------------------------------------------------------------- control
@router.post("/flush_cache")
async def flush_cache(request: Request):
    state = server_state(request)
    out = await control(state, state.tm.flush_cache())
    if not out.ok:
        raise APIError(400, out.message or "flush_cache: refused")
    return PlainTextResponse("Cache flushed.\n")


# SGLang also answers GET; keep it out of the schema (one operation per path and method).
router.add_api_route("/flush_cache", flush_cache, methods=["GET"], include_in_schema=False)


# ---------------------------------------------------------------- pinned prefixes (CAG)
@router.post("/pin_prefix")
async def pin_prefix(body: PinPrefixRequest, request: Request):
    state = server_state(request)
    if state.tm.dead_reason:
        raise APIError(503, f"server unavailable: {state.tm.dead_reason}")
    return await state.tm.pin_prefix(body.name, body.text, body.input_ids)


@router.post("/unpin_prefix")
async def unpin_prefix(body: UnpinPrefixRequest, request: Request):
    state = server_state(request)
    return await control(state, state.tm.unpin_prefix(body.name))


@router.get("/list_pinned")
async def list_pinned(request: Request):
    state = server_state(request)
    return {"pinned": await control(state, state.tm.list_pinned())}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request):
    rid = "" if body.abort_all else body.rid
    server_state(request).tm.abort_request(rid)
    return Response(status_code=200)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    state = server_state(request)
    if state.tokenizer is None:
        raise APIError(400, "prompt: this server was started with skip_tokenizer_init")
    prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
    ids = await state.tm.off_loop(
        lambda: [
            state.tokenizer.encode(p, add_special_tokens=body.add_special_tokens) for p in prompts
        ]
    )
    tokens: Any = ids if isinstance(body.prompt, list) else ids[0]
    count: Any = [len(i) for i in ids] if isinstance(body.prompt, list) else len(ids[0])
    return {"tokens": tokens, "count": count, "max_model_len": state.context_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = server_state(request)
    if state.tokenizer is None:
        raise APIError(400, "tokens: this server was started with skip_tokenizer_init")
    batch = bool(body.tokens) and isinstance(body.tokens[0], list)
    lists = body.tokens if batch else [body.tokens]
    vocab = state.tm.vocab_size
    for lst in lists:
        bad = [t for t in lst if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside [0, {vocab})")
    texts = await state.tm.off_loop(
        lambda: [
            state.tokenizer.decode(lst, skip_special_tokens=body.skip_special_tokens)
            for lst in lists
        ]
    )
    return {"text": texts if batch else texts[0]}
