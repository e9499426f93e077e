"""TokenizerManager: validates and tokenizes requests, sends them to the scheduler, and
gathers the detokenizer's outputs into SGLang-shaped results (rid -> state lives here)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import re
import time
import uuid
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
    TokenizedGenerateReq,
    ToTokenizer,
    decode_generate_request,
    decoder,
    encode,
)
from loom.runtime.sampling_params import make_sampling_params

logger = logging.getLogger(__name__)

_NATIVE: Mapping[str, str] = {}

MAX_TOP_LOGPROBS = 128  # top_logprobs_num bound: each one costs a top-k per token

# Lost-request safety net: while requests wait and nothing has arrived for PROBE_QUIET_S, the
# watchdog asks the scheduler which rids it holds; a request sent before that probe, with no
# final output and missing from LOST_AFTER_PROBES replies in a row, is failed (never waited for
# forever). The pipe is ordered (TM -> scheduler -> detokenizer -> TM), so a request sent before
# a probe is either listed in its reply or its final output arrived before the reply.
PROBE_QUIET_S = 2.0
LOST_AFTER_PROBES = 2


PIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


class RequestError(ValueError):
    """Bad input; the message names the field. The HTTP layer returns it as a 400."""

    status_code = 400


@dataclasses.dataclass
class ReqState:
    msg: TokenizedGenerateReq
    with_text: bool  # return_text_in_logprobs
    log_metrics: bool
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
    streamed_text: int = 0  # chars / ids already sent (incremental streaming, stream_interval)
    streamed_ids: int = 0
    streamed_lps: int = 0  # output / prompt logprob entries already sent (incremental)
    streamed_input: int = 0
    sent_seq: int = 0  # TokenizerManager._sent_count once this request was sent
    missing: int = 0  # consecutive probe replies that did not list this unfinished request
    abandoned: bool = False  # its caller left; dropped from rid_to_state once it finishes
    # a streaming call's one wake-up event, shared by its requests (set with `event`)
    wake: asyncio.Event | None = None

    def notify(self) -> None:
        self.event.set()
        if self.wake is not None:
            self.wake.set()


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

    # ------------------------------------------------------------------ input
    async def normalize(
        self, obj: GenerateReqInput, names: Mapping[str, str] = _NATIVE
    ) -> tuple[list[ReqState], bool]:
        """Expand a request into one state per prompt and copy (n); returns (states, is_batch).
        Every check runs before anything is sent. `names` maps native field names to the ones
        the client used (the OpenAI layer's `max_tokens`, `prompt`), so errors name its field."""

        def name(field: str) -> str:
            return names.get(field, field)

        prompt_field = name("text") if obj.text is not None else name("input_ids")
        if (obj.text is None) == (obj.input_ids is None):
            raise RequestError(f"{name('text')}, {name('input_ids')}: exactly one must be given")
        if obj.text is not None:
            is_batch = isinstance(obj.text, list)
            texts: list[str | None] = obj.text if is_batch else [obj.text]
        else:
            ids = obj.input_ids
            is_batch = bool(ids) and isinstance(ids[0], list)
            id_lists = ids if is_batch else [ids]
            for lst in id_lists:
                if not isinstance(lst, list) or not all(type(i) is int for i in lst):
                    raise RequestError(
                        f"{prompt_field}: must be a list of integers or a list of such lists"
                    )
            texts = [None] * len(id_lists)
        count = len(texts)
        if is_batch and not count:
            raise RequestError(f"{prompt_field}: the batch is empty")
        params = self._per_prompt(obj.sampling_params, "sampling_params", count, None)
        sps = []
        for raw in params:
            try:
                sps.append(make_sampling_params(raw, self.vocab_size))
            except ValueError as e:
                field, _, why = str(e).partition(": ")
                where = names.get(field) or (
                    field if field == "sampling_params" else f"sampling_params.{field}"
                )
                raise RequestError(f"{where}: {why}") from None
        total = sum(sp.n for sp in sps)
        cap = self.args.max_batch_request
        if total > cap:
            raise RequestError(
                f"{prompt_field}: this request expands to {total} generations (prompts x n); "
                f"the server's --max-batch-request is {cap}"
            )
        rids = self._rids(obj.rid, is_batch, count, name("rid"))
        return_logprob = self._per_prompt(obj.return_logprob, "return_logprob", count, False)
        starts = self._per_prompt(obj.logprob_start_len, "logprob_start_len", count, -1)
        tops = self._per_prompt(obj.top_logprobs_num, "top_logprobs_num", count, 0)
        if obj.text is not None:
            prompts = await self.off_loop(self._encode_all, texts, prompt_field)
        else:
            prompts = [list(lst) for lst in id_lists]
        bootstraps = iter(self._bootstrap(obj, [sp.n for sp in sps], names))
        extra_key = obj.extra_key
        if obj.cache_salt is not None:
            extra_key = f"{extra_key or ''}\x00{obj.cache_salt}"
        states: list[ReqState] = []
        now = time.monotonic()
        for i, (input_ids, sp, rid) in enumerate(zip(prompts, sps, rids)):
            self._check_prompt(input_ids, prompt_field)
            room = self.context_len - len(input_ids)
            if sp.min_new_tokens > room:
                raise RequestError(
                    f"{name('min_new_tokens')}: {sp.min_new_tokens} new tokens do not fit the "
                    f"context ({self.context_len}) after a {len(input_ids)}-token prompt"
                )
            if not 0 <= tops[i] <= MAX_TOP_LOGPROBS:
                raise RequestError(
                    f"{name('top_logprobs_num')}: must be in [0, {MAX_TOP_LOGPROBS}], got {tops[i]}"
                )
            start = starts[i]
            if not -1 <= start <= len(input_ids):
                raise RequestError(
                    f"{name('logprob_start_len')}: must be in [-1, {len(input_ids)}] (-1: output "
                    f"logprobs only; the prompt has {len(input_ids)} tokens), got {start}"
                )
            if start == -1:  # SGLang: no input logprobs
                start = len(input_ids)
            for j in range(sp.n):
                copy = msgspec.structs.replace(sp, n=1, max_new_tokens=min(sp.max_new_tokens, room))
                seed = (
                    sp.sampling_seed + j
                    if sp.sampling_seed is not None
                    else self._rng.getrandbits(62)
                )
                msg = TokenizedGenerateReq(
                    rid=rid if sp.n == 1 else f"{rid}-{j}",
                    input_ids=input_ids,
                    sampling_params=copy,
                    seed=seed,
                    stream=obj.stream,
                    return_logprob=return_logprob[i],
                    logprob_start_len=start,
                    top_logprobs_num=tops[i],
                    extra_key=extra_key,
                    bootstrap=next(bootstraps),
                )
                states.append(
                    ReqState(
                        msg, obj.return_text_in_logprobs, obj.log_metrics, now, asyncio.Event()
                    )
                )
        seen: set[str] = set()
        for st in states:
            rid = st.msg.rid
            if rid in seen or rid in self.rid_to_state:
                raise RequestError(f"{name('rid')}: {rid!r} is already running or repeated")
            seen.add(rid)
        return states, is_batch or len(states) > 1

    @staticmethod
    def _per_prompt(value, field: str, n: int, default) -> list:
        """One value per prompt: a list of n, or one value (None: the default) for all."""
        if value is None:
            return [default] * n
        if isinstance(value, list):
            if len(value) != n:
                raise RequestError(f"{field}: a list of {len(value)} for a batch of {n}")
            return [default if v is None else v for v in value]
        return [value] * n

    def _bootstrap(self, obj, counts: list[int], names: dict) -> list[tuple[str, int, int] | None]:
        """One (host, port, room) per generation, in expansion order (prompt-major, then copy),
        `counts` being each prompt's n. A PD-mode server needs all three fields (the router
        sets them); a plain server refuses them by name. As SGLang does, each field is one
        value or a list: one per prompt (sglang-router's batches) or one per generation (its
        chat n > 1). One room pairs one generation, so a room given once for several
        generations counts up from it (room + k for the k-th), on the prefill and the decode
        server alike, and a room listed per prompt counts up over that prompt's copies."""
        mode = self.args.disaggregation_mode
        fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        given = {f: getattr(obj, f) for f in fields if getattr(obj, f) is not None}
        total = sum(counts)
        if mode == "null":
            if given:
                raise RequestError(
                    f"{names.get(next(iter(given))) or next(iter(given))}: needs a server "
                    "started with --disaggregation-mode prefill|decode"
                )
            return [None] * total
        for f in fields:
            if f not in given:
                raise RequestError(
                    f"{names.get(f) or f}: required on a --disaggregation-mode {mode} server "
                    "(send requests through a PD router: sglang-router or `loom router "
                    "--pd-disaggregation`)"
                )
        per_gen = {f: _per_generation(given[f], counts, names.get(f) or f) for f in fields}
        out = []
        for (host, _), (port, _), (room, step) in zip(
            per_gen["bootstrap_host"], per_gen["bootstrap_port"], per_gen["bootstrap_room"]
        ):
            if type(room) is int:
                room += step
            if not isinstance(host, str) or not host:
                raise RequestError(
                    f"{names.get('bootstrap_host') or 'bootstrap_host'}: a host name, got {host!r}"
                )
            if type(port) is not int or not 0 < port < 65536:
                raise RequestError(
                    f"{names.get('bootstrap_port') or 'bootstrap_port'}: a port in [1, 65535], "
                    f"got {port!r}"
                )
            if type(room) is not int or not 0 <= room < 2**64:
                raise RequestError(
                    f"{names.get('bootstrap_room') or 'bootstrap_room'}: an integer in "
                    f"[0, 2**64), got {room!r}"
                )
            out.append((host, port, room))
        return out

    @staticmethod
    def _rids(rids, is_batch: bool, n: int, field: str) -> list[str]:
        if rids is None:
            return [uuid.uuid4().hex for _ in range(n)]
        if not is_batch:
            if isinstance(rids, list):
                raise RequestError(f"{field}: a single prompt takes a single rid string")
            return [rids]
        if not isinstance(rids, list) or len(rids) != n:
            raise RequestError(f"{field}: a batch needs a list of rids, one per prompt")
        return list(rids)

    async def off_loop(self, fn, *args):
        """Run tokenizer work (encode, decode, chat templates) in the tokenization pool, so a
        long prompt never stalls the event loop that serves every other request."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    def _encode_all(self, texts: list[str], field: str) -> list[list[int]]:
        if self.tokenizer is None:
            raise RequestError(
                f"{field}: this server was started with skip_tokenizer_init; send input_ids"
            )
        return [self.tokenizer.encode(t) for t in texts]

    def _check_prompt(self, ids: list[int], field: str) -> None:
        if not ids:
            raise RequestError(f"{field}: the prompt is empty")
        if len(ids) >= self.context_len:
            raise RequestError(
                f"{field}: the prompt has {len(ids)} tokens; the context length is {self.context_len}"
            )
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(f"{field}: token id {bad[0]} is outside [0, {self.vocab_size})")

    # ------------------------------------------------------------------ requests
    async def generate(
        self, obj: GenerateReqInput, names: Mapping[str, str] = _NATIVE
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
        names: Mapping[str, str] = _NATIVE,
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

    # ------------------------------------------------------------------ health
    async def _watchdog(self) -> None:
        """Child death is event-driven (each process's sentinel fd wakes the loop the moment
        it exits, whatever the machine's load); while requests wait and nothing arrives, the
        runtime is probed: no answer within `watchdog_timeout` seconds declares it stuck, and
        an answer that does not list a request sent before it fails that request (_probe)."""
        loop = asyncio.get_running_loop()
        for proc in self.watched_processes:
            loop.add_reader(proc.sentinel, self._child_exited, proc)
        timeout = self.args.watchdog_timeout
        try:
            while self.dead_reason is None:
                await asyncio.sleep(min(1.0, timeout / 4))
                self._drain()  # a lost fd wake-up costs at most this tick
                quiet = time.monotonic() - self._last_recv
                waiting = any(s.finished_reason is None for s in self.rid_to_state.values())
                if waiting and quiet > min(PROBE_QUIET_S, timeout / 2):
                    try:
                        await self._probe(timeout)
                    except asyncio.TimeoutError:
                        self._declare_dead(
                            f"the runtime did not answer for {timeout:g}s (watchdog_timeout)"
                        )
        finally:
            for proc in self.watched_processes:
                loop.remove_reader(proc.sentinel)

    async def _probe(self, timeout: float) -> None:
        """Ask the scheduler which requests it holds; fail each unfinished request sent before
        the probe that LOST_AFTER_PROBES replies in a row did not list. A reply without 'rids'
        (a front that cannot list them) checks nothing."""
        sent_before = self._sent_count
        reply = await self._control(lambda i: StateReq(i, list_rids=True), timeout=timeout)
        listed = (reply.state or {}).get("rids")
        if listed is None:
            return
        listed = set(listed)
        for rid, state in list(self.rid_to_state.items()):
            if state.finished_reason is not None or state.sent_seq > sent_before or rid in listed:
                state.missing = 0
                continue
            state.missing += 1
            if state.missing >= LOST_AFTER_PROBES:
                self._fail_lost(state)

    def _fail_lost(self, state: ReqState) -> None:
        rid = state.msg.rid
        age = time.monotonic() - state.created
        message = (
            f"request {rid!r} was lost: the scheduler does not hold it and sent no final output "
            f"({LOST_AFTER_PROBES} probes, {age:.1f}s after it was sent); please retry"
        )
        logger.error(message)
        self.lost_requests += 1
        self.send_sock.send(encode(AbortReq(rid)))  # in case it is still somewhere after all
        state.finished_reason = {"type": "abort", "message": message, "status_code": 500}
        if state.abandoned:
            self.rid_to_state.pop(rid, None)
        state.notify()

    def _child_exited(self, proc) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1.0)  # reap it, so its exit code is known
        self._declare_dead(f"the {proc.name} process died (exit code {proc.exitcode})")

    def _declare_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error(reason)
        for state in list(self.rid_to_state.values()):
            state.finished_reason = {"type": "abort", "message": reason, "status_code": 503}
            state.notify()
        if self.on_dead is not None:
            self.on_dead(reason)

    on_dead = None


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


def _per_generation(value, counts: list[int], field: str) -> list[tuple]:
    """A bootstrap field as (value, offset) per generation: a scalar for all, a list of one per
    prompt (offset = the copy's index j: its room is room + j) or one per generation."""
    total = sum(counts)
    if not isinstance(value, list):
        return [(value, k) for k in range(total)]
    if len(value) == total:
        return [(v, 0) for v in value]
    if len(value) == len(counts):
        return [(v, j) for v, n in zip(value, counts) for j in range(n)]
    raise RequestError(
        f"{field}: a list of {len(value)} for {len(counts)} prompt(s) and {total} generation(s)"
    )
