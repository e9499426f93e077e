"""TokenizerManager: validates and tokenizes requests, sends them to the scheduler, and
gathers the detokenizer's outputs into SGLang-shaped results (rid -> state lives here)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from loom.runtime.io_struct import (
    AbortReq,
    BatchStrOut,
    ControlOut,
    FlushCacheReq,
    StateReq,
    TokenizedGenerateReq,
    ToTokenizer,
    decoder,
    encode,
)
from loom.runtime.sampling_params import make_sampling_params

logger = logging.getLogger(__name__)

_GENERATE_FIELDS = {
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "extra_key",
    "modalities",
    "lora_path",
    "custom_logit_processor",
    "image_data",
    "bootstrap_host",
}


class RequestError(ValueError):
    """Bad input; the message names the field. The HTTP layer returns it as a 400."""

    status_code = 400


@dataclasses.dataclass
class SingleReq:
    rid: str
    input_ids: list[int]
    text: str | None
    sampling_params: Any
    seed: int
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    return_text_in_logprobs: bool
    stream: bool
    extra_key: str | None = None


@dataclasses.dataclass
class ReqState:
    req: SingleReq
    created: float
    event: asyncio.Event
    text: str = ""
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished_reason: dict | None = None
    meta: dict = dataclasses.field(default_factory=dict)
    input_token_logprobs: list = dataclasses.field(default_factory=list)
    input_top_logprobs: list = dataclasses.field(default_factory=list)
    output_token_logprobs: list = dataclasses.field(default_factory=list)
    output_top_logprobs: list = dataclasses.field(default_factory=list)
    first_token_time: float | None = None


class TokenizerManager:
    def __init__(self, args, ipc, tokenizer, context_len: int, vocab_size: int):
        self.args = args
        self.ipc = ipc
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.rid_to_state: dict[str, ReqState] = {}
        self.control_waiters: dict[int, asyncio.Future] = {}
        self.dead_reason: str | None = None
        self.watched_processes: list = []
        self.on_output = None  # metrics hook: on_output(state, num_new_tokens, now)
        self._next_control_id = 0
        self._rng = random.Random()
        self._started = False

    async def start(self) -> None:
        """Open sockets on the running event loop and start the receive and watchdog tasks."""
        import zmq
        import zmq.asyncio

        if self._started:
            return
        self._started = True
        self.ctx = zmq.asyncio.Context()
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(self.ipc.scheduler)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(self.ipc.tokenizer)
        self._tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._watchdog()),
        ]

    async def close(self) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        await asyncio.gather(*getattr(self, "_tasks", []), return_exceptions=True)
        if self._started:
            self.send_sock.close(linger=0)
            self.recv_sock.close(linger=0)

    # ------------------------------------------------------------------ input
    def normalize(self, obj: dict) -> tuple[list[SingleReq], bool]:
        """Expand a /generate body into single requests; returns (requests, is_batch)."""
        if not isinstance(obj, dict):
            raise RequestError("request: the body must be a JSON object")
        unknown = sorted(set(obj) - _GENERATE_FIELDS)
        if unknown:
            raise RequestError(f"request: unknown field(s) {', '.join(unknown)}")
        text, ids = obj.get("text"), obj.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("text, input_ids: exactly one of them must be given")
        if text is not None:
            is_batch = isinstance(text, list)
            texts = text if is_batch else [text]
            if not all(isinstance(t, str) for t in texts):
                raise RequestError("text: must be a string or a list of strings")
            prompts = [(t, self._encode(t)) for t in texts]
        else:
            is_batch = isinstance(ids, list) and len(ids) > 0 and isinstance(ids[0], list)
            id_lists = ids if is_batch else [ids]
            for lst in id_lists:
                if not isinstance(lst, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in lst
                ):
                    raise RequestError(
                        "input_ids: must be a list of integers or a list of such lists"
                    )
            prompts = [(None, list(lst)) for lst in id_lists]
        if is_batch and not prompts:
            raise RequestError("text, input_ids: the batch is empty")
        params = obj.get("sampling_params")
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise RequestError(
                    f"sampling_params: a list of {len(params)} for a batch of {len(prompts)}"
                )
            param_list = params
        else:
            param_list = [params] * len(prompts)
        rids = obj.get("rid")
        if rids is None:
            rid_list = [uuid.uuid4().hex for _ in prompts]
        elif is_batch:
            if not isinstance(rids, list) or len(rids) != len(prompts):
                raise RequestError("rid: a batch needs a list of rids, one per prompt")
            rid_list = [str(r) for r in rids]
        else:
            if isinstance(rids, (list, dict)):
                raise RequestError("rid: a single prompt takes a single rid string")
            rid_list = [str(rids)]
        return_logprob = self._per_item(obj, "return_logprob", False, len(prompts), bool)
        start = self._per_item(obj, "logprob_start_len", -1, len(prompts), int)
        top = self._per_item(obj, "top_logprobs_num", 0, len(prompts), int)
        with_text = bool(obj.get("return_text_in_logprobs", False))
        stream = bool(obj.get("stream", False))
        out: list[SingleReq] = []
        for i, ((t, input_ids), raw, rid) in enumerate(zip(prompts, param_list, rid_list)):
            try:
                sp = make_sampling_params(raw, self.vocab_size)
            except ValueError as e:
                raise RequestError(f"sampling_params.{e}") from None
            self._check_prompt(input_ids, sp)
            if not 0 <= top[i] <= self.vocab_size:
                raise RequestError(
                    f"top_logprobs_num: must be in [0, {self.vocab_size}], got {top[i]}"
                )
            if start[i] >= max(1, len(input_ids)):
                raise RequestError(
                    f"logprob_start_len: {start[i]} is past the prompt ({len(input_ids)} tokens)"
                )
            for j in range(sp.n):
                copy = make_sampling_params(_single_copy(sp))
                seed = (
                    sp.sampling_seed + j
                    if sp.sampling_seed is not None
                    else self._rng.getrandbits(62)
                )
                out.append(
                    SingleReq(
                        rid if sp.n == 1 else f"{rid}-{j}",
                        input_ids,
                        t,
                        copy,
                        seed,
                        return_logprob[i],
                        start[i],
                        top[i],
                        with_text,
                        stream,
                        obj.get("extra_key"),
                    )
                )
        return out, is_batch or len(out) > 1

    @staticmethod
    def _per_item(obj, name, default, n, kind):
        value = obj.get(name, default)
        if value is None:
            value = default
        values = value if isinstance(value, list) else [value] * n
        if len(values) != n:
            raise RequestError(f"{name}: a list of {len(values)} for a batch of {n}")
        for v in values:
            if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
                raise RequestError(f"{name}: must be an integer, got {v!r}")
            if kind is bool and not isinstance(v, bool):
                raise RequestError(f"{name}: must be a boolean, got {v!r}")
        return values

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise RequestError(
                "text: this server was started with skip_tokenizer_init; send input_ids"
            )
        return self.tokenizer.encode(text)

    def _check_prompt(self, ids: list[int], sp) -> None:
        if not ids:
            raise RequestError("text, input_ids: the prompt is empty")
        if len(ids) >= self.context_len:
            raise RequestError(
                f"input_ids: the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(f"input_ids: token id {bad[0]} is outside [0, {self.vocab_size})")

    # ------------------------------------------------------------------ requests
    async def generate(self, obj: dict) -> dict | list[dict]:
        reqs, is_batch = self.normalize(obj)
        if any(r.stream for r in reqs):
            raise RequestError("stream: use generate_stream for streaming requests")
        states = self._send(reqs)
        try:
            results = await asyncio.gather(*(self._wait_finished(s) for s in states))
        except asyncio.CancelledError:
            for s in states:
                self.abort_request(s.req.rid)
            raise
        return results if is_batch else results[0]

    async def generate_stream(self, obj: dict) -> AsyncIterator[dict]:
        """Yields cumulative outputs as they grow; with several requests, each carries 'index'."""
        reqs, is_batch = self.normalize(obj)
        for r in reqs:
            r.stream = True
        states = self._send(reqs)
        pending = {i: s for i, s in enumerate(states)}
        try:
            while pending:
                done, _ = await asyncio.wait(
                    [asyncio.ensure_future(s.event.wait()) for s in pending.values()],
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for t in done:
                    t.result()
                for i, s in list(pending.items()):
                    if not s.event.is_set():
                        continue
                    s.event.clear()
                    out = self._result(s)
                    if is_batch:
                        out["index"] = i
                    if s.finished_reason is not None:
                        del pending[i]
                        self.rid_to_state.pop(s.req.rid, None)
                        self._raise_if_rejected(s)
                    yield out
        finally:
            for s in pending.values():
                self.abort_request(s.req.rid)

    def _send(self, reqs: list[SingleReq]) -> list[ReqState]:
        if self.dead_reason:
            raise RuntimeError(self.dead_reason)
        states = []
        for r in reqs:
            if r.rid in self.rid_to_state:
                raise RequestError(f"rid: {r.rid!r} is already running")
            state = ReqState(r, time.monotonic(), asyncio.Event())
            self.rid_to_state[r.rid] = state
            states.append(state)
            self.send_sock.send(
                encode(
                    TokenizedGenerateReq(
                        r.rid,
                        r.input_ids,
                        r.sampling_params,
                        r.seed,
                        r.stream,
                        r.return_logprob,
                        r.logprob_start_len,
                        r.top_logprobs_num,
                        r.extra_key,
                    )
                )
            )
        return states

    async def _wait_finished(self, state: ReqState) -> dict:
        while state.finished_reason is None:
            await state.event.wait()
            state.event.clear()
        self.rid_to_state.pop(state.req.rid, None)
        self._raise_if_rejected(state)
        return self._result(state)

    def _raise_if_rejected(self, state: ReqState) -> None:
        fr = state.finished_reason or {}
        if fr.get("type") == "abort" and fr.get("status_code") == 400:
            raise RequestError(fr.get("message", "bad request"))
        if fr.get("type") == "abort" and fr.get("status_code") == 503:
            raise RuntimeError(fr.get("message", "server unavailable"))

    def abort_request(self, rid: str) -> None:
        if rid in self.rid_to_state or rid == "":
            self.send_sock.send(encode(AbortReq(rid)))

    # ------------------------------------------------------------------ outputs
    async def _recv_loop(self) -> None:
        dec = decoder(ToTokenizer)
        while True:
            msg = dec.decode(await self.recv_sock.recv())
            if isinstance(msg, BatchStrOut):
                self._handle_outputs(msg)
            elif isinstance(msg, ControlOut):
                fut = self.control_waiters.pop(msg.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _handle_outputs(self, batch: BatchStrOut) -> None:
        now = time.monotonic()
        for item in batch.outputs:
            state = self.rid_to_state.get(item.rid)
            if state is None:
                continue
            tok = item.token
            state.text += item.text_delta
            if tok.rewind:
                del state.output_ids[len(state.output_ids) - tok.rewind :]
            state.output_ids.extend(tok.new_ids)
            if tok.new_ids and state.first_token_time is None:
                state.first_token_time = now
            state.meta = {
                "prompt_tokens": tok.prompt_tokens,
                "completion_tokens": tok.completion_tokens,
                "cached_tokens": tok.cached_tokens,
                "jump_forward_tokens": tok.jump_forward_tokens,
                "spec_verify_ct": tok.spec_verify_ct,
                "first_decode_step": tok.first_decode_step,
                "last_decode_step": tok.last_decode_step,
                "decode_batch_max": tok.decode_batch_max,
            }
            if tok.input_token_logprobs is not None:
                state.input_token_logprobs = tok.input_token_logprobs
                state.input_top_logprobs = tok.input_top_logprobs or []
            if tok.output_token_logprobs:
                state.output_token_logprobs.extend(tok.output_token_logprobs)
            if tok.output_top_logprobs:
                state.output_top_logprobs.extend(tok.output_top_logprobs)
            state.finished_reason = tok.finished_reason
            if self.on_output is not None:
                self.on_output(state, len(tok.new_ids), now)
            state.event.set()

    def _triples(self, pairs, with_text: bool) -> list[list]:
        if not pairs:
            return []
        texts = (
            [self.tokenizer.decode([tid]) for _, tid in pairs]
            if with_text and self.tokenizer is not None
            else [None] * len(pairs)
        )
        return [[lp, tid, t] for (lp, tid), t in zip(pairs, texts)]

    def _result(self, state: ReqState) -> dict:
        r = state.req
        meta = {
            "id": r.rid,
            "finish_reason": state.finished_reason,
            "prompt_tokens": state.meta.get("prompt_tokens", len(r.input_ids)),
            "completion_tokens": state.meta.get("completion_tokens", len(state.output_ids)),
            "cached_tokens": state.meta.get("cached_tokens", 0),
            "jump_forward_tokens": state.meta.get("jump_forward_tokens", 0),
            "spec_verify_ct": state.meta.get("spec_verify_ct", 0),
            "first_decode_step": state.meta.get("first_decode_step"),
            "last_decode_step": state.meta.get("last_decode_step"),
            "decode_batch_max": state.meta.get("decode_batch_max", 0),
            "e2e_latency": time.monotonic() - state.created,
        }
        if r.return_logprob:
            wt = r.return_text_in_logprobs
            meta["input_token_logprobs"] = self._triples(state.input_token_logprobs, wt)
            meta["output_token_logprobs"] = self._triples(state.output_token_logprobs, wt)
            if r.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    None if top is None else self._triples(top, wt)
                    for top in state.input_top_logprobs
                ]
                meta["output_top_logprobs"] = [
                    self._triples(top, wt) for top in state.output_top_logprobs
                ]
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ control
    async def _control(self, msg_factory, timeout: float = 60.0) -> ControlOut:
        self._next_control_id += 1
        rid = self._next_control_id
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[rid] = fut
        self.send_sock.send(encode(msg_factory(rid)))
        return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> ControlOut:
        return await self._control(FlushCacheReq)

    async def get_internal_state(self) -> dict:
        return (await self._control(StateReq)).state or {}

    # ------------------------------------------------------------------ health
    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for proc in self.watched_processes:
                if not proc.is_alive() and self.dead_reason is None:
                    self.dead_reason = f"the {proc.name} process died (exit code {proc.exitcode})"
                    logger.error(self.dead_reason)
                    for state in list(self.rid_to_state.values()):
                        state.finished_reason = {
                            "type": "abort",
                            "message": self.dead_reason,
                            "status_code": 503,
                        }
                        state.event.set()
                    if self.on_dead is not None:
                        self.on_dead(self.dead_reason)

    on_dead = None


def _single_copy(sp):
    """The per-copy params of an n > 1 request: n becomes 1."""
    import msgspec

    return msgspec.structs.replace(sp, n=1)
