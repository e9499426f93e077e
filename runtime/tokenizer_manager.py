"""TokenizerManager: sends requests to the scheduler and gathers the detokenizer's outputs
into SGLang-shaped results (the rid -> state registry and streaming live here). Its input
side (validation, tokenization: `RequestNormalizer`) and its health side (`Liveness`) are
base classes in their own modules."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor

import msgspec

from loom.runtime.io_struct import (
    AbortReq,
    BatchStrOut,
    ControlOut,
    FlushCacheReq,
    GenerateReqInput,
    PinReq,
    StateReq,
    ToTokenizer,
    decode_generate_request,
    decoder,
    encode,
)
from loom.runtime.request_normalizer import NATIVE_NAMES, RequestError, RequestNormalizer
from loom.runtime.request_state import ReqState
from loom.runtime.tokenizer_liveness import Liveness

logger = logging.getLogger(__name__)


PIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


class TokenizerManager(RequestNormalizer, Liveness):
    def __init__(self, args, ipc, tokenizer, context_len: int, vocab_size: int):
        self.args = args
        self.ipc = ipc
        self.tokenizer = tokenizer
        self.context_len = context_len
        self.vocab_size = vocab_size
        self.rid_to_state: dict[str, ReqState] = {}
        self.control_waiters: dict[int, asyncio.Future] = {}
        self.dead_reason: str | None = None
        self._died: list[str] = []  # Liveness._child_exited: the processes that exited
        self.watched_processes: list = []
        self.on_output = None  # metrics hook: on_output(state, num_new_tokens, now)
        self._next_control_id = 0
        self._rng = random.Random()
        self._started = False
        self._last_recv = time.monotonic()
        self._sent_count = 0  # requests sent so far (orders requests against probes)
        self.lost_requests = 0  # requests failed by the lost-request safety net
        self.recv_errors = 0  # output messages that failed in _drain (logged, skipped)
        # Tokenizing a long prompt takes milliseconds of CPU: off the event loop.
        self._tokenize_pool = ThreadPoolExecutor(2, thread_name_prefix="loom-tokenize")

    async def start(self) -> None:
        """Open sockets on the running event loop; start receiving and the watchdog.

        Outputs arrive on a channel (runtime/channel.py) drained on the loop (`_drain`:
        every whole message waiting), run when its fd wakes the loop and on every watchdog
        tick; requests leave on a ZMQ PUSH socket."""
        import zmq
        import zmq.asyncio

        from loom.runtime.channel import Receiver

        if self._started:
            return
        self._started = True
        self.ctx = zmq.asyncio.Context()
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(self.ipc.scheduler)
        # the detokenizer listens before it reports ready, so this connects at once
        self.recv_sock = Receiver(self.ipc.tokenizer, timeout=30.0)
        self._recv_decoder = decoder(ToTokenizer)
        self._loop = asyncio.get_running_loop()
        self._recv_fd = self.recv_sock.fileno()
        self._loop.add_reader(self._recv_fd, self._drain)
        self._tasks = [asyncio.create_task(self._watchdog())]
        self._drain()

    async def close(self) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        await asyncio.gather(*getattr(self, "_tasks", []), return_exceptions=True)
        self._tokenize_pool.shutdown(wait=False)
        if getattr(self, "_recv_fd", None) is not None:
            self._loop.remove_reader(self._recv_fd)
            self._recv_fd = None
        if getattr(self, "send_sock", None) is not None:  # start() may have failed part-way
            self.send_sock.close(linger=0)
        if getattr(self, "recv_sock", None) is not None:
            self.recv_sock.close()
        if getattr(self, "ctx", None) is not None:
            self.ctx.term()

    async def off_loop(self, fn, *args):
        """Run tokenizer work (encode, decode, chat templates) in the tokenization pool, so a
        long prompt never stalls the event loop that serves every other request."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    # ------------------------------------------------------------------ requests
    async def generate(
        self, obj: GenerateReqInput, names: Mapping[str, str] = NATIVE_NAMES
    ) -> dict | list[dict]:
        if obj.stream:
            raise RequestError("stream: use generate_stream for streaming requests")
        states, is_batch = await self.normalize(obj, names)
        self._send(states)
        try:
            results = await asyncio.gather(*(self._wait_finished(s) for s in states))
        except BaseException:
            self._abandon(states)
            raise
        return results if is_batch else results[0]

    async def generate_stream(
        self,
        obj: GenerateReqInput,
        names: Mapping[str, str] = NATIVE_NAMES,
        incremental: bool | None = None,
    ) -> AsyncIterator[dict]:
        """Yields outputs as they grow, every `stream_interval` tokens: cumulative, or with
        `incremental` (None: --incremental-streaming-output) only what is new in each chunk
        (see `_result`); with several requests, each carries 'index'. The OpenAI layer
        computes its own deltas and asks for cumulative outputs whatever the flag."""
        if incremental is None:
            incremental = self.args.incremental_streaming_output
        obj = msgspec.structs.replace(obj, stream=True)
        states, is_batch = await self.normalize(obj, names)
        # one event wakes this call for any of its requests (a waiter task per request cost
        # B task creations and cancellations per step: ~1 ms of a batch-64 step's CPU)
        wake = asyncio.Event()
        for s in states:
            s.wake = wake
        self._send(states)
        pending = dict(enumerate(states))
        try:
            while pending:
                await wake.wait()
                wake.clear()  # before the scan: an output arriving during it wakes us again
                for i, s in list(pending.items()):
                    if not s.event.is_set():
                        continue
                    s.event.clear()
                    finished = s.finished_reason is not None
                    interval = s.msg.sampling_params.stream_interval
                    if interval and not finished and len(s.output_ids) - s.streamed_ids < interval:
                        continue
                    out = self._result(s, incremental=incremental)
                    if is_batch:
                        out["index"] = i
                    if finished:
                        del pending[i]
                        self.rid_to_state.pop(s.msg.rid, None)
                        self._raise_if_rejected(s)
                    yield out
        finally:
            self._abandon(pending.values())

    def _abandon(self, states) -> None:
        """The caller left (cancelled, disconnected, failed): abort what is unfinished and
        forget every state once it has finished, so rid_to_state holds only live requests."""
        for s in states:
            if s.finished_reason is not None:
                self.rid_to_state.pop(s.msg.rid, None)
            elif s.msg.rid in self.rid_to_state:
                s.abandoned = True
                self.abort_request(s.msg.rid)

    def _send(self, states: list[ReqState]) -> None:
        """Register and send every request, or none: a failure part-way aborts what was sent."""
        if self.dead_reason:
            raise RuntimeError(self.dead_reason)
        sent: list[str] = []
        try:
            for state in states:
                self.rid_to_state[state.msg.rid] = state
                self.send_sock.send(encode(state.msg))
                sent.append(state.msg.rid)
                self._sent_count += 1
                state.sent_seq = self._sent_count
        except BaseException:
            for state in states:
                self.rid_to_state.pop(state.msg.rid, None)
            for rid in sent:
                self.send_sock.send(encode(AbortReq(rid)))
            raise

    async def _wait_finished(self, state: ReqState) -> dict:
        while state.finished_reason is None:
            await state.event.wait()
            state.event.clear()
        self.rid_to_state.pop(state.msg.rid, None)
        self._raise_if_rejected(state)
        return self._result(state)

    def _raise_if_rejected(self, state: ReqState) -> None:
        fr = state.finished_reason or {}
        if fr.get("type") == "abort" and fr.get("status_code") == 400:
            raise RequestError(fr.get("message", "bad request"))
        if fr.get("type") == "abort" and fr.get("status_code") in (500, 503):
            raise RuntimeError(fr.get("message", "server unavailable"))

    def abort_request(self, rid: str) -> None:
        if rid in self.rid_to_state or rid == "":
            self.send_sock.send(encode(AbortReq(rid)))

    # ------------------------------------------------------------------ outputs
    def _drain(self) -> int:
        """Handle every message waiting on the output channel (up to its read size; the fd
        stays readable for the rest, so a flood does not starve other tasks); returns how
        many. A message that fails here (a bug) is logged and skipped: receiving must outlive
        it, and a request it leaves unfinished is failed by the watchdog's probe."""
        if self.recv_sock.closed:  # the detokenizer has gone: the watchdog reports it
            return 0
        raws = self.recv_sock.read(block=False)
        if self.recv_sock.closed and self._recv_fd is not None:
            self._loop.remove_reader(self._recv_fd)  # end of stream reads as ready forever
            self._recv_fd = None
        if raws:
            self._last_recv = time.monotonic()
        for raw in raws:
            try:
                self._on_message(self._recv_decoder.decode(raw))
            except Exception:  # noqa: BLE001 - logged; receiving goes on
                self.recv_errors += 1
                logger.exception("tokenizer manager: an output message failed; skipped")
        return len(raws)

    def _on_message(self, msg) -> None:
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
                "spec_accepted": tok.spec_accepted,
                "spec_proposed": tok.spec_proposed,
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
            if state.abandoned and state.finished_reason is not None:
                self.rid_to_state.pop(item.rid, None)
            state.notify()
            if self.on_output is not None and state.log_metrics:
                try:
                    self.on_output(state, len(tok.new_ids), now)
                except Exception:  # noqa: BLE001 - a metrics bug must not cost outputs
                    logger.exception("tokenizer manager: the on_output hook failed")

    def _triples(self, pairs, with_text: bool) -> list[list]:
        if not pairs:
            return []
        texts = (
            [self.tokenizer.decode([tid]) for _, tid in pairs]
            if with_text and self.tokenizer is not None
            else [None] * len(pairs)
        )
        return [[lp, tid, t] for (lp, tid), t in zip(pairs, texts)]

    def _result(self, state: ReqState, incremental: bool = False) -> dict:
        r = state.msg
        meta = {
            "id": r.rid,
            "finish_reason": state.finished_reason,
            "prompt_tokens": state.meta.get("prompt_tokens", len(r.input_ids)),
            "completion_tokens": state.meta.get("completion_tokens", len(state.output_ids)),
            "cached_tokens": state.meta.get("cached_tokens", 0),
            "jump_forward_tokens": state.meta.get("jump_forward_tokens", 0),
            **_spec_meta(state.meta),
            "first_decode_step": state.meta.get("first_decode_step"),
            "last_decode_step": state.meta.get("last_decode_step"),
            "decode_batch_max": state.meta.get("decode_batch_max", 0),
            "e2e_latency": time.monotonic() - state.created,
        }
        if (state.finished_reason or {}).get("budget_closed"):
            meta["budget_closed"] = True  # grammar/closing.py steered the output shut
        # Incremental (SGLang's --incremental-streaming-output): every per-token list covers
        # exactly this chunk's new tokens (ids, output logprobs and top logprobs from where
        # the last chunk ended; the prompt's logprobs in the chunk they arrive with), so the
        # chunks concatenated equal the cumulative answer.
        lp_from = state.streamed_lps if incremental else 0
        input_from = state.streamed_input if incremental else 0
        if r.return_logprob:
            wt = state.with_text
            inputs = state.input_token_logprobs[input_from:]
            meta["input_token_logprobs"] = self._triples(inputs, wt)
            meta["output_token_logprobs"] = self._triples(state.output_token_logprobs[lp_from:], wt)
            meta["output_token_logprobs_length"] = len(state.output_token_logprobs)
            if r.top_logprobs_num:
                meta["input_top_logprobs"] = [
                    None if top is None else self._triples(top, wt)
                    for top in state.input_top_logprobs[input_from:]
                ]
                meta["output_top_logprobs"] = [
                    self._triples(top, wt) for top in state.output_top_logprobs[lp_from:]
                ]
        text, ids = state.text, state.output_ids
        if incremental:
            text, ids = text[state.streamed_text :], ids[state.streamed_ids :]
        state.streamed_text, state.streamed_ids = len(state.text), len(state.output_ids)
        state.streamed_lps = len(state.output_token_logprobs)
        state.streamed_input = len(state.input_token_logprobs)
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    # ------------------------------------------------------------------ control
    async def _control(self, msg_factory, timeout: float = 60.0) -> ControlOut:
        self._next_control_id += 1
        rid = self._next_control_id
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters[rid] = fut
        self.send_sock.send(encode(msg_factory(rid)))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.control_waiters.pop(rid, None)

    async def flush_cache(self) -> ControlOut:
        return await self._control(FlushCacheReq)

    async def pin_prefix(
        self, name: str, text: str | None = None, input_ids: list[int] | None = None
    ) -> dict:
        """CAG: compute the prefix (a prefill-only request puts it in the cache), then pin it
        under `name` (radix/hicache.py). Retried once if the cache evicted it in between."""
        if not self.args.enable_hierarchical_cache:
            raise RequestError("pin_prefix: needs --enable-hierarchical-cache")
        if not isinstance(name, str) or not PIN_NAME.fullmatch(name):
            raise RequestError("name: 1-128 characters of letters, digits, '_', '-' or '.'")
        if (text is None) == (input_ids is None):
            raise RequestError("text: give exactly one of text or input_ids")
        ids = (
            input_ids
            if text is None
            else (await self.off_loop(self._encode_all, [text], "text"))[0]
        )
        self._check_prompt(ids, "input_ids" if text is None else "text")
        out = None
        for _ in range(2):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}
            await self.generate(decode_generate_request(body))
            out = await self._control(lambda rid: PinReq(rid, "pin", name, ids, text))
            if out.ok:
                return {"name": name, "tokens": out.state["tokens"], "prompt_tokens": len(ids)}
        raise RequestError(out.message or "pin_prefix: failed")

    async def unpin_prefix(self, name: str) -> dict:
        if not self.args.enable_hierarchical_cache:
            raise RequestError("unpin_prefix: needs --enable-hierarchical-cache")
        out = await self._control(lambda rid: PinReq(rid, "unpin", name))
        if not out.ok:
            raise RequestError(out.message)
        return {"name": name, "unpinned": True}

    async def list_pinned(self) -> list[dict]:
        if not self.args.enable_hierarchical_cache:
            return []
        return (await self._control(lambda rid: PinReq(rid, "list"))).state["pinned"]

    async def get_internal_state(self) -> dict:
        return (await self._control(StateReq)).state or {}


def _spec_meta(meta: dict) -> dict:
    """SGLang's speculative-decoding fields: verify steps, tokens per verify step (the sampled
    token included) and the share of proposed draft tokens accepted."""
    verify, accepted, proposed = (
        meta.get(k, 0) for k in ("spec_verify_ct", "spec_accepted", "spec_proposed")
    )
    return {
        "spec_verify_ct": verify,
        "spec_accept_length": 1 + accepted / verify if verify else 1.0,
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
    }
