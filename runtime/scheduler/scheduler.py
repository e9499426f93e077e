"""The scheduler: admits requests, builds batches, runs them, and turns results into outputs.

The loop is `schedule -> run -> process results`; policy lives in the owners composed here,
mechanics (forward, sampling, logprobs) behind the model runner. It runs in-process (tests, `Scheduler.step()`) or as its own process behind ZMQ
(`run_scheduler_process`).
"""

from __future__ import annotations

import gc
import logging
import random
import time

from loom.runtime.io_struct import (
    AbortReq,
    ControlOut,
    FlushCacheReq,
    PinReq,
    ReqOutput,
    StateReq,
    TokenizedGenerateReq,
)
from loom.runtime.req import Req
from loom.runtime.scheduler.batch import ScheduleBatch
from loom.runtime.scheduler.decode import DecodeManager
from loom.runtime.scheduler.grammar_queue import GrammarQueue
from loom.runtime.scheduler.kv import KVManager
from loom.runtime.scheduler.output import OutputProcessor
from loom.runtime.scheduler.prefill import PrefillManager
from loom.runtime.server_args import ServerArgs
from loom.runtime.step_grammar import StepGrammar

logger = logging.getLogger(__name__)


class Scheduler:
    """Composes the owners: `kv` (all KV memory), `grammar_queue` (compiling grammars),
    `prefill` (waiting queue, chunked request), `decode` (running and finishing requests) and
    `output` (result processing, outputs to stream). The scheduler only routes requests
    between them; none of them sees the scheduler."""

    def __init__(self, args: ServerArgs, model_runner=None, tokenizer=None, drafter=None):
        from loom.runtime.array_runner import create_runner

        self.args = args
        if tokenizer is None and model_runner is None:  # before the weights: the build's
            tokenizer = _load_tokenizer(args)  # transient (Gemma 3: +241 MB) passes over less
        self.runner = model_runner or create_runner(args)  # ArrayRunner (no torch) or torch's
        r = self.runner
        self.context_len = r.context_len
        self.vocab_size = r.vocab_size
        self.tree_cache = _make_tree_cache(args, r)
        self.kv = KVManager(r.req_to_token_pool, r.allocator, self.tree_cache, args.page_size)
        if self.kv.hierarchical:
            self.kv.restore_pins()
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(args)
        self.eos_token_ids = _eos_ids(args.model_path, self.tokenizer)
        self.stats = dict.fromkeys(
            ("num_retractions", "prompt_tokens", "cached_tokens", "steps", "generated_tokens",
             "decode_batch_sizes", "decode_steps"), 0)  # fmt: skip
        self.grammar_queue = GrammarQueue(
            self.tokenizer,
            self.vocab_size,
            self.eos_token_ids,
            args.grammar_compile_timeout,
            engine=args.grammar_backend,
            eager=args.grammar_backend_eager,  # else built by the first constrained request
        )
        self.prefill = PrefillManager(
            self.kv, args, r.max_running_requests, random.Random(args.random_seed)
        )
        # the one owner of a step's grammar rows (drafts' walks, mask rows, commit, jumps)
        self.grammar = StepGrammar(self.tokenizer, r.vocab_size, self.eos_token_ids,
                                   lazy=args.world_size == 1)  # fmt: skip
        if drafter is None:
            from loom.runtime.spec.factory import create_drafter

            drafter = create_drafter(args, self.tokenizer, self.vocab_size, self.eos_token_ids,
                                     runner=self.runner, grammar=self.grammar)  # fmt: skip
        self.decode = DecodeManager(
            self.kv, args.schedule_conservativeness, self.context_len, drafter
        )
        self.decode.step_token_cap = _fast_step_tokens(self.runner)
        # a drafter's first draft rides the prefill forward (PrefillAdder._draft)
        self.prefill.drafter, self.prefill.step_token_cap = drafter, self.decode.step_token_cap
        self.output = OutputProcessor(
            self.kv,
            self.tokenizer,
            self.context_len,
            not args.disable_jump_forward,
            self.stats,
            drafter,
            grammar=self.grammar,
        )
        # prefill/decode disaggregation (runtime/disagg/): the prefill or decode side
        self.disagg = None
        if args.disaggregation_mode != "null":
            from loom.runtime.disagg.factory import create_side

            self.disagg = create_side(args, self.kv, r.token_to_kv_pool, self.output, self.stats)
        self.check_integrity_every_step = False
        self.decode_timing: dict[int, list] = {}
        self._last_log = 0.0
        self._last_spec_log = time.monotonic()
        if drafter is not None and args.speculative_algorithm:
            # the verify cost table of this model (measured here, or cached: spec/cost.py)
            from loom.runtime.spec.cost import resolve

            cost = resolve(args, self)
            if cost is not None:
                drafter.set_verify_cost(cost)

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[ReqOutput]:
        """One iteration: schedule -> run -> process results. Returns the outputs to stream."""
        start = time.perf_counter()
        if self.disagg is not None:
            self._step_disagg()
        batch = self.schedule()
        if batch is None:
            self.check_integrity()
            return self.output.drain()
        inp = batch.build_input(self.vocab_size, self.grammar)
        drafter = self.decode.drafter
        if drafter is not None:  # the one speculation seam: what the forward keeps for it
            inp.capture = drafter.step_capture
        result = self.runner.forward(inp)
        if drafter is not None:  # the drafter reads the step (hidden states in `result.hidden`)
            drafter.after_forward(inp, result)
        routes = self.output.process(batch, result)
        self.decode.after_step(batch, routes.running, routes.finishing)
        self.prefill.requeue(routes.requeue, routes.chunked)
        if self.check_integrity_every_step:
            self.check_integrity()
        if batch.is_decode:
            self._record_decode_timing(
                len(batch), time.perf_counter() - start, self.runner.last_model_seconds
            )
            self._log_spec()
        return self.output.drain()

    def schedule(self) -> ScheduleBatch | None:
        """Finishing requests' KV first (so no prefix match misses it), then prefill, then
        decode."""
        self._poll_grammars()
        if not self.decode.finishing:
            batch = self.prefill.schedule(self.decode.running, self.decode.new_token_ratio)
            if batch is not None:
                self._log_prefill(batch)
                return batch
        batch, retracted = self.decode.schedule()
        if retracted:
            self.stats["num_retractions"] += len(retracted)
            self.prefill.requeue(retracted)
        return batch

    def _record_decode_timing(self, batch_size: int, step: float, forward: float) -> None:
        """Per decode batch size: [steps, total step seconds, model forward seconds] (the rest
        of a step is scheduling, input building, sampling and result processing)."""
        entry = self.decode_timing.setdefault(batch_size, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += step
        entry[2] += forward

    def close(self) -> None:
        """Release what outlives a dropped Scheduler: the grammar backend's worker
        processes. For in-process owners (benchmarks, tests); a scheduler process exits."""
        self.grammar_queue.close()

    def set_drafter(self, drafter) -> None:
        """Replace the drafter (tests drive a scripted one)."""
        self.decode.drafter = self.output.drafter = self.prefill.drafter = drafter

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    @property
    def pending_outputs(self) -> list[Req]:
        return self.output.pending

    @property
    def is_idle(self) -> bool:
        return not (
            len(self.prefill) or len(self.decode) or len(self.grammar_queue) or self._disagg_busy
        )

    @property
    def only_waiting_for_grammar(self) -> bool:
        """Nothing to compute, only grammars compiling or KV transfers in flight (the loop
        polls every millisecond instead of spinning)."""
        loading = self.kv.hierarchical and self.prefill.all_loading()
        waiting = len(self.grammar_queue) > 0 or self._disagg_busy or loading
        return waiting and not (len(self.decode) or (len(self.prefill) and not loading))

    @property
    def _disagg_busy(self) -> bool:
        return self.disagg is not None and self.disagg.busy

    # ---------------------------------------------------------------- messages
    def handle_message(self, msg) -> ControlOut | None:
        """One message from the tokenizer manager; returns the reply a control message gets."""
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            ok, message = self.flush_cache()
            return ControlOut(msg.request_id, ok, message)
        elif isinstance(msg, PinReq):
            return self.handle_pin(msg)
        elif isinstance(msg, StateReq):
            state = self.get_state()
            if getattr(msg, "list_rids", False):
                state["rids"] = self.known_rids()
            return ControlOut(msg.request_id, True, state=state)
        return None

    def known_rids(self) -> list[str]:
        """Every request not yet answered: compiling its grammar, waiting or chunked, running,
        finishing, or with outputs not yet sent (the tokenizer manager's lost-request check)."""
        reqs = [r for r, _, _ in self.grammar_queue.pending]
        reqs += self.prefill.waiting + self.decode.running + self.decode.finishing
        reqs += self.output.pending
        if self.disagg is not None:  # waiting for a KV transfer (either side)
            reqs += self.disagg.known()
        if self.prefill.chunked_req is not None:
            reqs.append(self.prefill.chunked_req)
        return sorted({r.rid for r in reqs})

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        p = msg.sampling_params
        req = Req(
            rid=msg.rid,
            input_ids=msg.input_ids,
            sampling_params=p,
            seed=msg.seed,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num,
            eos_token_ids=self.eos_token_ids,
            extra_key=msg.extra_key,
            bootstrap=msg.bootstrap,
        )
        error = self._validate(req)
        if error:
            self._fail(req, error)
            return
        if req.bootstrap_room is not None and self.args.disaggregation_mode == "prefill":
            p.max_new_tokens = min(p.max_new_tokens, 1)  # the decode server does the rest
            p.min_new_tokens = min(p.min_new_tokens, 1)
        spec = p.grammar_spec
        if spec is not None:
            error = self.grammar_queue.add(req, *spec)
            if error:
                self._fail(req, error)
            return
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        """A decode-side disaggregated request waits for its KV instead of a prefill."""
        if req.bootstrap_room is not None and self.args.disaggregation_mode == "decode":
            self.disagg.add(req)
        else:
            self.prefill.waiting.append(req)

    def _fail(self, req: Req, message: str) -> None:
        """Answer `req` with a 400; a disaggregated one's peer is told (it frees its KV)."""
        if req.bootstrap_room is not None and self.disagg is not None:
            self.disagg.peer_failed(req, message)
        self.output.finish_with_error(req, message)

    def _step_disagg(self) -> None:
        """Handshakes and KV transfers; on the decode side, requests whose KV arrived start
        decoding: their first token (sampled by the prefill server) is appended as if this
        server had sampled it, and they join the running batch."""
        for req, header in self.disagg.step():
            if header.first_token >= 0:
                lp = header.first_logprob[0] if header.first_logprob else None
                self.output.append_token(req, header.first_token, lp, header.first_top_logprobs)
            else:  # max_new_tokens 0
                req.finished_reason = {"type": "length", "length": 0}
            if req.finished:
                self.output.pending.append(req)
                self.kv.release(req)
                continue
            self.kv.cache_unfinished(req)
            self.decode.running.append(req)
            if req.stream:
                self.output.pending.append(req)

    def _poll_grammars(self) -> None:
        self.grammar_queue.attach_late()
        if len(self.grammar_queue):
            ready, failed = self.grammar_queue.poll()
            for req in ready:
                self._enqueue(req)
            for req, message in failed:
                self._fail(req, message)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        size = self.kv.size
        if n == 0:
            return "input_ids: the prompt is empty"
        if n >= self.context_len:
            return f"input_ids: the prompt has {n} tokens; the context length is {self.context_len}"
        if max(req.origin_input_ids) >= self.vocab_size or min(req.origin_input_ids) < 0:
            return f"input_ids: token ids must be in [0, {self.vocab_size})"
        if n + 1 > size:
            return (
                f"input_ids: the prompt needs {n + 1} KV slots; the KV cache holds "
                f"{size} (max_total_tokens)"
            )
        # a request running alone must always fit: cap its output by the context and the pool
        max_new = min(req.sampling_params.max_new_tokens, self.context_len - n, size - n)
        if max_new != req.sampling_params.max_new_tokens:
            req.sampling_params.max_new_tokens = max_new
            req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens, max_new)
        return None

    def abort(self, rid: str) -> None:
        """Abort one request (or all with rid ""), wherever it is; its KV is released now."""
        reqs = self.grammar_queue.remove(rid) + self.prefill.remove(rid)
        running, finishing = self.decode.remove(rid)
        for req in reqs + running + finishing:
            if req.req_pool_idx is not None:
                self.kv.release(req)
        if self.disagg is not None:
            for req in reqs + running:  # the peer frees its KV for these
                if req.bootstrap_room is not None:
                    self.disagg.peer_failed(req, "aborted by request")
            reqs += self.disagg.remove(rid)  # KV freed, the peer told
        for req in reqs + running:  # a finishing one was already answered
            self.output.finish_with_error(req, "aborted by request", status_code=None)

    # ---------------------------------------------------------------- control
    def flush_cache(self) -> tuple[bool, str]:
        # Finishing requests (already answered) are not work a caller can see: drop them, or
        # a flush right after the last answer is refused.
        for req in self.decode.finishing:
            self.kv.release(req)
        self.decode.finishing = []
        if not self.is_idle:
            return False, "flush_cache: refused while requests are running or waiting"
        self.kv.flush()
        self.check_integrity()
        return True, "cache flushed"

    def handle_pin(self, msg: PinReq) -> ControlOut:
        """Pinned prefixes (CAG): pin / unpin / list; needs --enable-hierarchical-cache."""
        if not self.kv.hierarchical:
            return ControlOut(
                msg.request_id, False, "pin_prefix: needs --enable-hierarchical-cache"
            )
        cache = self.tree_cache
        if msg.action == "pin":
            try:
                n = self.kv.pin(msg.name, msg.input_ids or [], msg.text)
            except ValueError as e:
                return ControlOut(msg.request_id, False, str(e))
            return ControlOut(msg.request_id, True, state={"name": msg.name, "tokens": n})
        if msg.action == "unpin":
            if msg.name not in cache.pins and msg.name not in {
                p["name"] for p in cache.list_pinned()
            }:
                return ControlOut(msg.request_id, False, f"name: no prefix pinned as {msg.name!r}")
            cache.unpin(msg.name)
            return ControlOut(msg.request_id, True, state={"name": msg.name})
        return ControlOut(msg.request_id, True, state={"pinned": cache.list_pinned()})

    def _log_prefill(self, batch: ScheduleBatch) -> None:
        now = time.monotonic()
        if now - self._last_log < 1.0:
            return
        self._last_log = now
        st = self.stats
        logger.info(
            "prefill batch: %d reqs, %d new tokens, %d cached | running %d, queued %d | "
            "cache hit rate %.1f%%, KV free %d/%d",
            len(batch),
            sum(r.extend_len for r in batch.reqs),
            sum(len(r.prefix_indices) for r in batch.reqs),
            len(self.decode.running),
            len(self.prefill.waiting),
            100 * st["cached_tokens"] / max(1, st["prompt_tokens"]),
            self.kv.available(),
            self.kv.size,
        )

    def _log_spec(self) -> None:
        """Speculative acceptance (by position, accept-length histogram) every 10 s."""
        now = time.monotonic()
        if self.decode.drafter is None or now - self._last_spec_log < 10.0:
            return
        self._last_spec_log = now
        line = self.decode.drafter.log_line()
        if line:
            logger.info("decode batch: %d running | %s", len(self.decode.running), line)

    def get_state(self) -> dict:
        st = self.stats
        return {
            "max_total_tokens": self.kv.size,
            "max_running_requests": self.prefill.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": self.vocab_size,
            "num_running_reqs": len(self.decode.running) + (self.prefill.chunked_req is not None),
            "num_waiting_reqs": len(self.prefill.waiting),
            "kv_available_tokens": self.kv.available(),
            # SGLang's /get_load num_tokens: KV in use by live requests plus waiting prompts
            "num_used_tokens": self.kv.size - self.kv.available() - self.kv.evictable(),
            "num_waiting_tokens": sum(len(r.origin_input_ids) for r in self.prefill.waiting),
            "cache_size_tokens": self.tree_cache.total_size(),
            "cache_hit_rate": st["cached_tokens"] / max(1, st["prompt_tokens"]),
            "grammar_engine_ready": self.grammar_queue.ready,
            "decode_timing": {str(k): v for k, v in self.decode_timing.items()},
            # objects out of the collector's sight (process.freeze_startup_heap) and the
            # collections run since, per generation
            "gc_frozen_objects": gc.get_freeze_count(),
            "gc_collections": [g["collections"] for g in gc.get_stats()],
            **(self.decode.drafter.summary() if self.decode.drafter is not None else {}),
            **(self.tree_cache.summary() if self.kv.hierarchical else {}),
            **st,
        }

    def check_integrity(self) -> None:
        """free + cached + in use == total, and every live request's invariants."""
        live = self.decode.finishing + self.decode.running + self.prefill.live()
        self.kv.check_integrity(live + (self.disagg.live() if self.disagg is not None else []))


def _make_tree_cache(args: ServerArgs, runner):
    if args.disable_radix_cache:
        from loom.radix.chunk_cache import ChunkCache

        return ChunkCache(runner.req_to_token_pool, runner.allocator, args.page_size)
    if args.enable_hierarchical_cache:
        return _make_hicache(args, runner)
    from loom.radix.cache import RadixCache

    return RadixCache(runner.req_to_token_pool, runner.allocator, args.page_size)


def _make_hicache(args: ServerArgs, runner):
    import json

    from loom.radix.hicache import HiRadixCache
    from loom.radix.pages import model_identity
    from loom.radix.storage import create_storage

    pool = runner.token_to_kv_pool
    host_tokens = int(args.hicache_ratio * runner.allocator.size)
    storage = None
    if args.hicache_storage_backend is not None:
        storage = create_storage(
            args.hicache_storage_backend,
            args.hicache_storage_dir,
            args.hicache_storage_url,
            max_bytes=int(args.hicache_storage_size * 1e9),
        )
    config = json.dumps(runner.config.to_dict(), sort_keys=True, default=str)
    return HiRadixCache(
        runner.req_to_token_pool,
        runner.allocator,
        pool,
        args.page_size,
        identity=model_identity(args.model_path, config),
        host_tokens=host_tokens,
        storage=storage,
        write_policy=args.hicache_write_policy,
        l2_dtype=args.hicache_l2_dtype,
        host_bytes=int(args.hicache_size * 1e9),  # 0: host_tokens decides
        overlap_loads=not args.hicache_sync_loads,
    )


def _load_tokenizer(args: ServerArgs):
    if args.skip_tokenizer_init:
        return None
    from loom.runtime.gguf.vocab import scheduler_tokenizer  # a GGUF file's: lazy

    return scheduler_tokenizer(args.tokenizer_path, lazy=not args.speculative_algorithm)


def _eos_ids(model_path: str, tokenizer) -> frozenset[int]:
    from loom.runtime.gguf.vocab import scheduler_eos_ids

    return frozenset(scheduler_eos_ids(model_path, tokenizer))


def _fast_step_tokens(runner) -> int | None:
    """The most tokens a step may feed and still run the compiled CPU forward (None: no such
    path, e.g. on CUDA): verify steps keep their drafts within it, since a step past it runs
    the eager modules at twice the cost. A drafter's captures (Medusa's and EAGLE's final
    hidden states, EAGLE-3's aux layers) come back from the compiled forward too."""
    fast = getattr(runner, "cpu_forward", None)
    return None if fast is None else fast.max_tokens
