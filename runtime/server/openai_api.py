"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each request becomes one native /generate request (n copies, several prompts) handed to the
TokenizerManager; the results are reshaped into OpenAI's objects. Choice k of prompt i with
n copies has index i * n + k, the TokenizerManager's own order.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from loom.runtime.io_struct import GenerateReqInput
from loom.runtime.request_normalizer import RequestError
from loom.runtime.sampling_params import SamplingParams
from loom.runtime.server.chat import ReplyParser, ToolPlan, constrain, render_messages
from loom.runtime.server.common import APIError, JSONOut, ServerState
from loom.runtime.server.native import (
    prime,
    server_state,
    sse,
    sse_response,
    unless_disconnected,
)
from loom.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingExtras,
)

router = APIRouter()
logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def warn_unknown(model: BaseModel, path: str = "") -> None:
    """One warning log line per unknown field name (per process); the field is ignored."""
    for name in model.model_extra or {}:
        field = f"{path}{name}"
        if field not in _WARNED:
            _WARNED.add(field)
            logger.warning("ignoring unknown field %r (loom does not implement it)", field)
    for name, value in model:
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, BaseModel):
                warn_unknown(item, f"{path}{name}.")


# The OpenAI names of the native fields the runtime validates: its errors name the client's
# field (`max_tokens: must be >= 0`), not the native one.
def openai_names(prompt_field: str) -> dict[str, str]:
    return {
        "text": prompt_field,
        "input_ids": prompt_field,
        "max_new_tokens": "max_tokens",
        "min_new_tokens": "min_tokens",
        "sampling_seed": "seed",
        "top_logprobs_num": "logprobs" if prompt_field == "prompt" else "top_logprobs",
        "logprob_start_len": "echo",
        **{f: f for f in _SAMPLING_NAMES},
    }


# The sampling fields OpenAI requests share with SGLang's SamplingParams (same names, same
# meaning), passed through as they are; the renamed ones are set in `sampling_params`.
_SAMPLING_NAMES = tuple(
    sorted(set(SamplingParams.__struct_fields__) & set(_SamplingExtras.model_fields))
)


def check_model(state: ServerState, name: str) -> None:
    if name not in (state.args.served_model_name, state.args.model_path):
        raise APIError(
            404,
            f"model: {name!r} does not exist; this server serves {state.args.served_model_name!r}",
            "model_not_found",
        )


def sampling_params(state: ServerState, req: _SamplingExtras, max_tokens: int) -> dict:
    sp: dict[str, Any] = {"max_new_tokens": max_tokens, "min_new_tokens": req.min_tokens}
    for name in _SAMPLING_NAMES:
        value = getattr(req, name)
        if value is not None:
            sp[name] = value
    if req.seed is not None:
        sp["sampling_seed"] = req.seed
    rf = req.response_format
    if rf is not None and rf.type != "text":
        taken = [k for k in ("regex", "json_schema", "ebnf") if k in sp]
        if taken:
            raise RequestError(f"response_format: cannot be combined with {taken[0]}")
        if rf.type == "json_object":
            sp["json_schema"] = '{"type": "object"}'
        else:
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            if not isinstance(schema, dict):
                raise RequestError("response_format.json_schema.schema: a JSON schema is required")
            sp["json_schema"] = schema
        sp.setdefault("close_within_budget", "auto")  # the default for response_format
    return sp


def finish_reason(meta: dict) -> tuple[str | None, Any]:
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    kind = fr.get("type")
    return ("stop" if kind == "stop" else kind), fr.get("matched")


def usage(outs: list[dict], n: int) -> dict:
    firsts = outs[::n]  # the prompt is counted once, not once per copy
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    cached = sum(o["meta_info"].get("cached_tokens", 0) for o in firsts)
    out = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    closed = sum(bool(o["meta_info"].get("budget_closed")) for o in outs)
    if closed:  # loom: choices whose output was steered shut within max_tokens
        out["budget_closed"] = closed
    return out


def _stream_usage(req: _SamplingExtras) -> tuple[bool, bool]:
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise RequestError("stream_options: only allowed when stream is true")
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


# --------------------------------------------------------------------------- models
@router.get("/v1/models")
async def list_models(request: Request):
    state = server_state(request)
    return {
        "object": "list",
        "data": [
            {
                "id": state.args.served_model_name,
                "object": "model",
                "created": state.created,
                "owned_by": "loom",
                "root": state.args.model_path,
                "max_model_len": state.context_len,
            }
        ],
    }


# --------------------------------------------------------------------------- completions
def legacy_logprobs(token_lps: list, top_lps: list | None, offset: int = 0) -> dict:
    """OpenAI's legacy format: parallel lists of tokens, logprobs, top dicts, text offsets."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for i, (lp, _tid, text) in enumerate(token_lps):
        text = text or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        top = top_lps[i] if top_lps is not None and i < len(top_lps) else []
        out["top_logprobs"].append(None if top is None else {t or "": v for v, _, t in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


class _CompletionShaper:
    """Turns native outputs into completion choices; holds the stream's per-choice progress."""

    def __init__(self, req: CompletionRequest, prompt_texts: list[str]):
        self.req = req
        self.prompt_texts = prompt_texts
        self.sent_text: dict[int, int] = {}
        self.sent_lps: dict[int, int] = {}
        self.final: dict[int, dict] = {}

    def _echo(self, k: int) -> str:
        return self.prompt_texts[k // self.req.n] if self.req.echo else ""

    def choice(self, k: int, out: dict, delta: bool) -> dict | None:
        meta = out["meta_info"]
        first = k not in self.sent_text
        text = out["text"][self.sent_text.get(k, 0) :] if delta else out["text"]
        self.sent_text[k] = len(out["text"])
        prefix = self._echo(k) if first or not delta else ""
        logprobs = None
        if self.req.logprobs is not None:
            lps = meta.get("output_token_logprobs", [])
            tops = meta.get("output_top_logprobs")
            start = self.sent_lps.get(k, 0) if delta else 0
            self.sent_lps[k] = len(lps)
            lps, tops = lps[start:], (tops[start:] if tops is not None else None)
            if prefix:
                lps = meta.get("input_token_logprobs", []) + lps
                if tops is not None:
                    tops = meta.get("input_top_logprobs", []) + tops
            logprobs = legacy_logprobs(lps, tops)
        reason, matched = finish_reason(meta)
        if reason is not None:
            self.final[k] = out
        if delta and not (prefix or text or reason or (logprobs and logprobs["tokens"])):
            return None
        return {
            "index": k,
            "text": prefix + text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "matched_stop": matched,
        }


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    state = server_state(request)
    check_model(state, req.model)
    warn_unknown(req)
    if req.suffix:
        raise RequestError("suffix: not supported")
    if req.best_of is not None and req.best_of != req.n:
        raise RequestError("best_of: only best_of == n is supported")
    include_usage, continuous_usage = _stream_usage(req)
    prompt = req.prompt
    if not prompt or (
        isinstance(prompt, list) and any(len(p) == 0 for p in prompt if isinstance(p, (str, list)))
    ):
        raise RequestError("prompt: must not be empty")
    text = input_ids = None
    if isinstance(prompt, str) or isinstance(prompt[0], str):
        text = prompt
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
    else:
        input_ids = prompt
        lists = prompt if isinstance(prompt[0], list) else [prompt]
        vocab = state.tm.vocab_size
        for ids in lists:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt: token id {bad[0]} is outside [0, {vocab})")
        texts = (
            await state.tm.off_loop(lambda: [_decode(state, ids) for ids in lists])
            if req.echo
            else [""] * len(lists)
        )
    logprobs = req.logprobs is not None
    obj = GenerateReqInput(
        text=text,
        input_ids=input_ids,
        sampling_params=sampling_params(
            state, req, req.max_tokens if req.max_tokens is not None else 16
        ),
        return_logprob=logprobs,
        top_logprobs_num=req.logprobs if logprobs else None,
        return_text_in_logprobs=logprobs,
        logprob_start_len=0 if logprobs and req.echo else None,
        rid=req.rid or None,
        bootstrap_host=req.bootstrap_host,
        bootstrap_port=req.bootstrap_port,
        bootstrap_room=req.bootstrap_room,
    )
    names = openai_names("prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    shaper = _CompletionShaper(req, texts)

    def envelope(choices: list[dict]) -> dict:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": req.model,
            "choices": choices,
        }

    if not req.stream:
        res = await unless_disconnected(request, state.tm.generate(obj, names))
        outs = res if isinstance(res, list) else [res]
        body = envelope([shaper.choice(k, o, delta=False) for k, o in enumerate(outs)])
        body["usage"] = usage(outs, req.n)
        return JSONOut(body)

    agen = state.tm.generate_stream(obj, names, incremental=False)
    first = await prime(agen)

    def render(out: dict) -> list[str]:
        choice = shaper.choice(out.get("index", 0), out, delta=True)
        if choice is None:
            return []
        chunk = envelope([choice])
        if continuous_usage:
            chunk["usage"] = usage([out], 1)
        return [sse(chunk)]

    def tail() -> list[str]:
        if not include_usage:
            return []
        outs = [shaper.final[k] for k in sorted(shaper.final)]
        return [sse({**envelope([]), "usage": usage(outs, req.n)})]

    return sse_response(first, agen, render, tail)


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.tokenizer.decode(ids) if state.tokenizer is not None else ""


# --------------------------------------------------------------------------- chat
def render_chat(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan) -> list[int]:
    tok = state.tokenizer
    if tok is None:
        raise RequestError("messages: this server was started with skip_tokenizer_init")
    template = state.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise RequestError(
            "messages: the model has no chat template; start the server with --chat-template"
        )
    messages, extra = render_messages(req, plan, template)
    try:
        ids = tok.apply_chat_template(
            messages,
            chat_template=template,
            add_generation_prompt=not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            tokenize=True,
            **extra,
            **(req.chat_template_kwargs or {}),
        )
    except Exception as e:  # noqa: BLE001 - a template that cannot render this input is a 400
        raise RequestError(f"messages: the chat template cannot render them: {e}") from None
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def chat_logprobs(token_lps: list, top_lps: list | None) -> dict:
    def entry(lp, text):
        text = text or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (lp, _tid, text) in enumerate(token_lps):
        top = top_lps[i] if top_lps is not None and i < len(top_lps) else []
        content.append({**entry(lp, text), "top_logprobs": [entry(v, t) for v, _, t in top or []]})
    return {"content": content}


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    state = server_state(request)
    check_model(state, req.model)
    warn_unknown(req)
    if req.top_logprobs and not req.logprobs:
        raise RequestError("top_logprobs: requires logprobs to be true")
    include_usage, continuous_usage = _stream_usage(req)
    tok = state.tokenizer
    plan = ToolPlan(req, state.args, state.chat_template or getattr(tok, "chat_template", None))
    reasoning = state.args.reasoning_parser
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    sp = sampling_params(state, req, 0)
    await state.tm.off_loop(constrain, sp, req, plan, reasoning)  # schema translation: CPU
    ids = await state.tm.off_loop(render_chat, state, req, plan)
    if max_tokens is None:
        max_tokens = max(0, state.context_len - len(ids))
    sp["max_new_tokens"] = max_tokens
    obj = GenerateReqInput(
        input_ids=ids,
        sampling_params=sp,
        return_logprob=req.logprobs,
        top_logprobs_num=req.top_logprobs or 0,
        return_text_in_logprobs=req.logprobs,
        rid=req.rid or None,
        bootstrap_host=req.bootstrap_host,
        bootstrap_port=req.bootstrap_port,
        bootstrap_room=req.bootstrap_room,
    )
    names = openai_names("messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())

    def envelope(choices: list[dict], kind: str) -> dict:
        return {
            "id": rid,
            "object": kind,
            "created": created,
            "model": req.model,
            "choices": choices,
        }

    def logprobs_of(meta: dict, start: int) -> dict | None:
        if not req.logprobs:
            return None
        tops = meta.get("output_top_logprobs")
        return chat_logprobs(
            meta.get("output_token_logprobs", [])[start:],
            tops[start:] if tops is not None else None,
        )

    if not req.stream:
        res = await unless_disconnected(request, state.tm.generate(obj, names))
        outs = res if isinstance(res, list) else [res]
        choices = []
        for k, out in enumerate(outs):
            reason, matched = finish_reason(out["meta_info"])
            reply = ReplyParser(plan, reasoning)
            reply.feed(out["text"])
            reply.finish()
            choices.append(
                {
                    "index": k,
                    "message": reply.message(),
                    "logprobs": logprobs_of(out["meta_info"], 0),
                    "finish_reason": reply.finish_reason(reason),
                    "matched_stop": matched,
                }
            )
        body = envelope(choices, "chat.completion")
        body["usage"] = usage(outs, req.n)
        return JSONOut(body)

    agen = state.tm.generate_stream(obj, names, incremental=False)
    first = await prime(agen)
    sent_text: dict[int, int] = {}
    sent_lps: dict[int, int] = {}
    replies: dict[int, ReplyParser] = {}
    final: dict[int, dict] = {}

    def chunk(k: int, delta: dict, logprobs: dict | None, reason=None, matched=None) -> str:
        choice = {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = matched
        return sse(envelope([choice], "chat.completion.chunk"))

    def render(out: dict) -> list[str]:
        k = out.get("index", 0)
        meta = out["meta_info"]
        events = []
        if k not in sent_text:
            events.append(chunk(k, {"role": "assistant", "content": ""}, None))
            sent_text[k] = 0
            replies[k] = ReplyParser(plan, reasoning)
        reply = replies[k]
        text = out["text"][sent_text[k] :]
        sent_text[k] = len(out["text"])
        start = sent_lps.get(k, 0)
        sent_lps[k] = len(meta.get("output_token_logprobs", []))
        logprobs = logprobs_of(meta, start)
        reason, matched = finish_reason(meta)
        deltas = reply.feed(text) if text else []
        if reason is not None:
            deltas += reply.finish()
        if logprobs and logprobs["content"] and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            events.append(chunk(k, delta, logprobs if i == 0 else None))
        if reason is not None:
            final[k] = out
            events.append(chunk(k, {}, None, reply.finish_reason(reason), matched))
        if continuous_usage and events:
            events.append(sse({**envelope([], "chat.completion.chunk"), "usage": usage([out], 1)}))
        return events

    def tail() -> list[str]:
        if not include_usage:
            return []
        outs = [final[k] for k in sorted(final)]
        return [sse({**envelope([], "chat.completion.chunk"), "usage": usage(outs, req.n)})]

    return sse_response(first, agen, render, tail)
