"""The scheduler: admits requests, builds batches, runs them, and turns results into outputs.

The loop is `schedule -> run -> process results`; policy lives here, mechanics in the model
runner. It runs in-process (tests, `Scheduler.step()`) or as its own process behind ZMQ
(`run_scheduler_process`).
"""

from __future__ import annotations

import logging
import random
import time

import torch

from loom.runtime.forward_batch import ForwardMode
from loom.runtime.io_struct import ReqOutput, TokenizedGenerateReq
from loom.runtime.req import Req
from loom.runtime.sampler import SamplingInfo, sample
from loom.runtime.scheduler.batch import ScheduleBatch
from loom.runtime.scheduler.decode import INIT_NEW_TOKEN_RATIO, DecodeMixin
from loom.runtime.scheduler.grammar_queue import GrammarQueue
from loom.runtime.scheduler.output import OutputMixin
from loom.runtime.scheduler.policy import order_waiting
from loom.runtime.scheduler.prefill import InBatchPrefixes, PrefillAdder
from loom.runtime.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Scheduler(DecodeMixin, OutputMixin):
    def __init__(self, args: ServerArgs, model_runner=None, tokenizer=None):
        from loom.runtime.model_runner import ModelRunner

        self.args = args
        self.runner = model_runner or ModelRunner(args)
        r = self.runner
        self.page_size = args.page_size
        self.req_to_token_pool, self.allocator = r.req_to_token_pool, r.allocator
        self.max_running_requests = r.max_running_requests
        self.context_len = r.context_len
        self.vocab_size = r.vocab_size
        self.tree_cache = _make_tree_cache(args, r)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(args)
        self.eos_token_ids = _eos_ids(args.model_path, self.tokenizer)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.rng = random.Random(args.random_seed)
        self.stats = {
            "num_retractions": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "steps": 0,
            "generated_tokens": 0,
            "decode_batch_sizes": 0,
            "decode_steps": 0,
        }
        self.check_integrity_every_step = False
        self.pending_outputs: list[Req] = []
        self.jumped: list[Req] = []
        self.grammar_queue = GrammarQueue(
            self.tokenizer, self.vocab_size, self.eos_token_ids, args.grammar_compile_timeout
        )
        self._last_log = 0.0
        self.decode_timing: dict[int, list] = {}

    # ---------------------------------------------------------------- the loop
    def step(self) -> list[ReqOutput]:
        """One iteration: schedule -> run -> process results. Returns the outputs to stream."""
        self._step_start = time.perf_counter()
        batch = self.get_next_batch()
        if batch is None:
            self.check_integrity()
            return self.drain_outputs()
        inp = batch.build_input()
        t1 = time.perf_counter()
        logits = self.runner.forward(inp)
        t2 = time.perf_counter()
        next_ids, logprob_info = self.sample(batch, logits)
        self.process_batch_result(batch, next_ids, logprob_info, logits)
        if self.check_integrity_every_step:
            self.check_integrity()
        outputs = self.drain_outputs()
        if batch.mode is ForwardMode.DECODE:
            self._record_decode_timing(len(batch), time.perf_counter() - self._step_start, t2 - t1)
        return outputs

    def _record_decode_timing(self, batch_size: int, step: float, forward: float) -> None:
        """Per decode batch size: [steps, total step seconds, model forward seconds]."""
        entry = self.decode_timing.setdefault(batch_size, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += step
        entry[2] += forward

    @property
    def is_idle(self) -> bool:
        return not (
            self.waiting
            or self.running
            or self.chunked_req
            or self.jumped
            or len(self.grammar_queue)
        )

    @property
    def only_waiting_for_grammar(self) -> bool:
        return len(self.grammar_queue) > 0 and not (
            self.waiting or self.running or self.chunked_req
        )

    # ---------------------------------------------------------------- admission
    def add_request(self, msg: TokenizedGenerateReq) -> None:
        p = msg.sampling_params
        req = Req(
            msg.rid,
            msg.input_ids,
            p,
            msg.seed,
            msg.stream,
            msg.return_logprob,
            msg.logprob_start_len,
            msg.top_logprobs_num,
            self.eos_token_ids,
            msg.extra_key,
        )
        error = self._validate(req)
        if error:
            req.finished_reason = {"type": "abort", "message": error, "status_code": 400}
            self.pending_outputs.append(req)
            return
        spec = p.grammar_spec
        if spec is not None:
            error = self.grammar_queue.add(req, *spec)
            if error:
                req.finished_reason = {"type": "abort", "message": error, "status_code": 400}
                self.pending_outputs.append(req)
            return
        self.waiting.append(req)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "input_ids: the prompt is empty"
        if n >= self.context_len:
            return f"input_ids: the prompt has {n} tokens; the context length is {self.context_len}"
        if max(req.origin_input_ids) >= self.vocab_size or min(req.origin_input_ids) < 0:
            return f"input_ids: token ids must be in [0, {self.vocab_size})"
        if n + 1 > self.allocator.size:
            return (
                f"input_ids: the prompt needs {n + 1} KV slots; the KV cache holds "
                f"{self.allocator.size} (max_total_tokens)"
            )
        # a request running alone must always fit: cap its output by the context and the pool
        max_new = min(
            req.sampling_params.max_new_tokens, self.context_len - n, self.allocator.size - n
        )
        if max_new != req.sampling_params.max_new_tokens:
            req.sampling_params.max_new_tokens = max_new
            req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens, max_new)
        return None

    def abort(self, rid: str) -> None:
        """Abort one request (or all with rid ""), wherever it is; its KV is released now."""
        for req in self.grammar_queue.remove(rid):
            self._finish_abort(req)
        for req in [r for r in self.waiting if rid in ("", r.rid)]:
            self.waiting.remove(req)
            if req.req_pool_idx is not None:
                self._release(req)
            self._finish_abort(req)
        for req in [r for r in self.jumped if rid in ("", r.rid)]:
            self.jumped.remove(req)
            self._release(req)
            self._finish_abort(req)
        for req in [r for r in self.running if rid in ("", r.rid)]:
            self.running.remove(req)
            self._release(req)
            if not req.finished:  # a finished one is only completing its KV: already answered
                self._finish_abort(req)
        if self.chunked_req is not None and rid in ("", self.chunked_req.rid):
            req, self.chunked_req = self.chunked_req, None
            self._release(req)
            self._finish_abort(req)

    def _finish_abort(self, req: Req) -> None:
        req.finished_reason = {"type": "abort", "message": "aborted by request"}
        self.pending_outputs.append(req)

    # ---------------------------------------------------------------- scheduling
    def get_next_batch(self) -> ScheduleBatch | None:
        if self.jumped:  # jump-forward text is computed by the next extend, before anything new
            self.waiting[:0] = self.jumped
            self.jumped = []
        if len(self.grammar_queue):
            ready, failed = self.grammar_queue.poll()
            self.waiting.extend(ready)
            for req, message in failed:
                req.finished_reason = {"type": "abort", "message": message, "status_code": 400}
                self.pending_outputs.append(req)
        if any(r.finished for r in self.running):
            # a finished request's last token KV goes to the cache before any new prefix match
            return self.prepare_decode()
        batch = self.get_new_prefill_batch()
        if batch is not None:
            return batch
        if not self.running:
            return None
        return self.prepare_decode()

    def get_new_prefill_batch(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        slots_left = self.max_running_requests - len(self.running) - (self.chunked_req is not None)
        adder = PrefillAdder(self, self.running, self.new_token_ratio, slots_left)
        if self.chunked_req is not None:
            adder.add(self.chunked_req, continuing=True)
        if adder.rem_input > 0 and self.waiting:
            holding = [r for r in self.waiting if r.req_pool_idx is not None]
            fresh = [r for r in self.waiting if r.req_pool_idx is None]
            self.waiting = holding + order_waiting(
                fresh, self.args.effective_schedule_policy, self.tree_cache, self.rng
            )
            in_batch = None if self.tree_cache.disable else InBatchPrefixes(self.tree_cache)
            for req in list(self.waiting):
                if in_batch is not None and in_batch.should_defer(req):
                    continue
                if not adder.add(req):
                    break
                if in_batch is not None:
                    in_batch.add(req)
            admitted = {id(r) for r in adder.can_run}
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
        if not adder.can_run:
            return None
        batch = ScheduleBatch(adder.can_run, ForwardMode.EXTEND)
        batch.out_cache_loc = torch.cat([r.new_slots for r in adder.can_run])
        self._log_prefill(batch)
        return batch

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
            len(self.running),
            len(self.waiting),
            100 * st["cached_tokens"] / max(1, st["prompt_tokens"]),
            self.allocator.available_size(),
            self.allocator.size,
        )

    def alloc_for_req(self, req: Req, n: int) -> torch.Tensor | None:
        """KV slots for positions kv_len .. kv_len+n-1 of `req`, evicting cache if needed.
        The slots are written into the request's row and kept on `req.new_slots`."""
        need = self.allocator.pages_needed(req.kv_len, n) * self.page_size
        if need > self.allocator.available_size():
            self.tree_cache.evict(need - self.allocator.available_size())
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        last = int(row[req.kv_len - 1]) if req.kv_len > 0 else 0
        slots = self.allocator.alloc_extend(req.kv_len, last, n)
        if slots is None:
            return None
        row[req.kv_len : req.kv_len + n] = slots.to(row.device)
        req.new_slots = slots
        return slots

    def _release(self, req: Req) -> None:
        """Hand the request's KV to the prefix cache (which frees what it does not keep)."""
        self.tree_cache.cache_finished_req(req)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    # ---------------------------------------------------------------- sampling
    def sample(self, batch: ScheduleBatch, logits: torch.Tensor):
        inp = batch.model_input
        rows = [(i, r) for i, r in enumerate(inp.sample_rows) if r is not None]
        logprob_info = None
        if any(batch.reqs[i].return_logprob for i, _ in rows) or any(
            lp is not None for lp in inp.input_logprob_rows
        ):
            logprob_info = logits.clone()
        if not rows:
            return None, logprob_info
        reqs = [batch.reqs[i] for i, _ in rows]
        sample_logits = logits[[r for _, r in rows]]
        info = SamplingInfo.from_reqs(reqs, self.vocab_size, str(logits.device))
        self.fill_grammar_mask(reqs, info)
        return sample(sample_logits, info).tolist(), logprob_info

    def fill_grammar_mask(self, reqs: list[Req], info: SamplingInfo) -> None:
        if not any(r.grammar is not None for r in reqs):
            return
        from loom.grammar.base import allocate_token_bitmask

        mask = allocate_token_bitmask(len(reqs), self.vocab_size)
        for i, r in enumerate(reqs):
            if r.grammar is not None:
                r.grammar.fill_mask(mask, i)
        info.vocab_mask = mask

    # ---------------------------------------------------------------- control
    def flush_cache(self) -> tuple[bool, str]:
        # Finished requests still writing their last token's KV (already answered) are not
        # work a caller can see: drop them, or a flush right after the last answer is refused.
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self._release(req)
        if not self.is_idle:
            return False, "flush_cache: refused while requests are running or waiting"
        self.tree_cache.reset()
        self.check_integrity()
        return True, "cache flushed"

    def get_state(self) -> dict:
        st = self.stats
        return {
            "max_total_tokens": self.allocator.size,
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "vocab_size": self.vocab_size,
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            "num_waiting_reqs": len(self.waiting),
            "kv_available_tokens": self.allocator.available_size(),
            "cache_size_tokens": self.tree_cache.total_size(),
            "cache_hit_rate": st["cached_tokens"] / max(1, st["prompt_tokens"]),
            "decode_timing": {str(k): v for k, v in self.decode_timing.items()},
            **st,
        }

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """free + cached + in use == total, and every request's invariants."""
        live = self.running + ([self.chunked_req] if self.chunked_req else [])
        live += [r for r in self.waiting + self.jumped if r.req_pool_idx is not None]
        in_use = 0
        for req in live:
            req.check()
            shared = 0 if self.tree_cache.disable else len(req.prefix_indices)
            own = req.kv_len - shared
            in_use += -(-own // self.page_size) * self.page_size
        free = self.allocator.available_size()
        cached = self.tree_cache.total_size()
        assert free + cached + in_use == self.allocator.size, (
            f"KV leak: free {free} + cached {cached} + in use {in_use} != total {self.allocator.size}"
        )
        self.allocator.check_no_duplicates()
        if hasattr(self.tree_cache, "check_integrity"):
            self.tree_cache.check_integrity()
        assert self.req_to_token_pool.available_size() + len(live) == self.req_to_token_pool.size


def _make_tree_cache(args: ServerArgs, runner):
    if args.disable_radix_cache:
        from loom.radix.chunk_cache import ChunkCache

        return ChunkCache(runner.req_to_token_pool, runner.allocator, args.page_size)
    from loom.radix.cache import RadixCache

    return RadixCache(runner.req_to_token_pool, runner.allocator, args.page_size)


def _load_tokenizer(args: ServerArgs):
    if args.skip_tokenizer_init:
        return None
    from loom.runtime.tokenizer import load_tokenizer

    return load_tokenizer(args.tokenizer_path)


def _eos_ids(model_path: str, tokenizer) -> frozenset[int]:
    from loom.runtime.tokenizer import eos_token_ids

    return frozenset(eos_token_ids(model_path, tokenizer))
