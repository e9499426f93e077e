"""Prefill: the waiting queue, the chunked request, and the adder that admits requests into one
extend batch under token and KV budgets."""

from __future__ import annotations

import numpy as np

from loom.runtime.req import Req
from loom.runtime.scheduler.batch import ScheduleBatch
from loom.runtime.scheduler.kv import KVManager
from loom.runtime.scheduler.policy import order_waiting

# Future decode tokens reserved per running request are clipped to this many, as in SGLang.
CLIP_MAX_NEW_TOKENS = 4096


class PrefillAdder:
    """Admits requests front to back. For each it matches the cached prefix, locks it, and
    allocates KV for the rest; it stops at the first request that does not fit, so the queue
    order (the policy) is respected. A request that exceeds the chunk budget is cut at the
    budget and becomes the chunked request."""

    def __init__(
        self,
        kv: KVManager,
        chunk_size: int | None,
        max_prefill_tokens: int,
        running: list[Req],
        new_token_ratio: float,
        slots_left: int,
        drafter=None,
        step_token_cap: int | None = None,
        decode_size: int | None = None,
    ):
        self.kv = kv
        # drafts verified by this prefill forward (None: none); see `_draft`
        self.drafter = drafter
        # the drafter's answer for this step, asked once (`_draft`): its gate counts declines
        # and spends probes per call, and a prefill of 24 requests asking 24 times used up a
        # probe and counted 24 declines in one step (a whole run could then draft nothing)
        self.drafting: bool | None = None
        self.step_token_cap = step_token_cap
        # the decode batch these requests join, as large as the queue could make it
        self.decode_size = len(running) + slots_left if decode_size is None else decode_size
        self.page = kv.page_size
        self.chunked = chunk_size is not None
        self.rem_input = chunk_size if chunk_size is not None else max_prefill_tokens
        reserved = sum(
            min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * new_token_ratio for r in running
        )
        self.rem_total = kv.available() + kv.evictable() - reserved
        self.ratio = new_token_ratio
        self.slots_left = slots_left
        self.can_run: list[Req] = []

    def add(self, req: Req, continuing: bool = False) -> bool:
        """Try to admit `req` (`continuing`: the chunked request's next chunk); returns False
        when nothing more can be admitted this step."""
        if self.rem_input <= 0 or (not continuing and self.slots_left <= 0):
            return False
        if req.req_pool_idx is None and not self._admit(req):
            return False
        extend = req.seq_len - req.kv_len
        truncated = False
        if extend > self.rem_input:
            if self.chunked:
                extend = (
                    self.rem_input if self.page == 1 else self.rem_input // self.page * self.page
                )
                truncated = True
            elif self.can_run:
                return self._undo(req)
        if extend <= 0:
            return self._undo(req)
        future = 0 if truncated else min(req.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * self.ratio
        if self.can_run and extend + future > self.rem_total:
            return self._undo(req)
        draft = [] if truncated else self._draft(req, extend)
        slots = self.kv.alloc(req, extend + len(draft))
        if slots is None and draft:  # drafts are optional: the prompt alone may still fit
            draft = req.draft_ids = []
            req.draft_masks = None
            slots = self.kv.alloc(req, extend)
        if slots is None:
            return self._undo(req)
        req.extend_len = extend + len(draft)
        req.is_chunked = truncated
        self.can_run.append(req)
        self.rem_input -= extend
        self.rem_total -= extend + future
        if not continuing:
            self.slots_left -= 1
        return not truncated

    def _draft(self, req: Req, extend: int) -> list[int]:
        """Tokens the drafter proposes after `req`'s prompt, fed and verified by this prefill
        forward (`req.draft_ids`). Only where the decode batch that follows would draft too,
        not for prompt logprobs or a disaggregated prefill, and within the compiled forward's
        step limit when the batch is still under it (past it, a few more rows of an eager
        prefill cost little)."""
        req.draft_ids, req.draft_masks = [], None
        req.draft_parents = req.draft_probs = None
        d = self.drafter
        if (
            d is None
            or req.return_logprob
            or req.bootstrap_room is not None
            or not req.samples_at(req.kv_len + extend)
        ):
            return []
        if self.drafting is None:
            self.drafting = d.enabled_for(self.decode_size)
        if not self.drafting:
            return []
        room = req.remaining_new_tokens - 1  # also keeps every draft inside the context
        if self.step_token_cap is not None:
            fed = extend + sum(r.extend_len for r in self.can_run)
            if fed <= self.step_token_cap:
                room = min(room, self.step_token_cap - fed)
        if room <= 0:
            return []
        req.draft_ids = list(d.draft_prefill(req, room))[:room]
        return req.draft_ids

    def _admit(self, req: Req) -> bool:
        """A request row and the cached prefix; at least one token is computed (its logits
        give the next one), and prompt logprobs asked for are not served from the cache."""
        limit = req.seq_len - 1
        if req.return_logprob and len(req.logprob.input_token_logprobs) == 0:
            limit = min(limit, max(req.logprob.start_len, 1) - 1)
        if not self.kv.admit(req, limit):
            return False
        if req.retract_count == 0:
            req.cached_tokens = req.kv_len
        return True

    def _undo(self, req: Req) -> bool:
        """Release what `_admit` took for a request that does not fit after all."""
        if req.is_chunked or req.kv_len > len(req.prefix_indices):
            return False  # already holds computed KV (a chunked request): keep it
        self.kv.undo_admit(req)
        return False


class PrefillManager:
    """Owns the waiting queue and the chunked request; builds prefill batches."""

    def __init__(self, kv: KVManager, args, max_running_requests: int, rng):
        self.kv = kv
        self.chunk_size = args.effective_chunked_prefill_size
        self.max_prefill_tokens = args.max_prefill_tokens
        self.policy = args.effective_schedule_policy
        self.max_running_requests = max_running_requests
        self.rng = rng
        self.waiting: list[Req] = []
        self.chunked_req: Req | None = None
        # the scheduler sets these when speculation is on: a `Drafter` whose drafts ride
        # prefill forwards (`draft_prefill`), and the compiled forward's step limit
        self.drafter = None
        self.step_token_cap: int | None = None

    def __len__(self) -> int:
        return len(self.waiting) + (self.chunked_req is not None)

    def live(self) -> list[Req]:
        """Requests here that hold KV (a chunked one, and retracted/jumped ones re-admitted)."""
        live = [r for r in self.waiting if r.req_pool_idx is not None]
        return live + ([self.chunked_req] if self.chunked_req is not None else [])

    def schedule(self, running: list[Req], new_token_ratio: float) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        slots_left = self.max_running_requests - len(running) - (self.chunked_req is not None)
        adder = PrefillAdder(
            self.kv,
            self.chunk_size,
            self.max_prefill_tokens,
            running,
            new_token_ratio,
            slots_left,
            self.drafter,
            self.step_token_cap,
            len(running)
            + (self.chunked_req is not None)
            + min(len(self.waiting), max(0, slots_left)),
        )
        if self.chunked_req is not None:
            adder.add(self.chunked_req, continuing=True)
            if self.chunked_req not in adder.can_run:
                return None  # KV short for its next chunk: nothing may overtake it (decode runs)
        if adder.rem_input > 0 and self.waiting:
            holding = [r for r in self.waiting if r.req_pool_idx is not None]
            fresh = [r for r in self.waiting if r.req_pool_idx is None]
            self.waiting = holding + order_waiting(fresh, self.policy, self.kv, self.rng)
            in_batch = None if self.kv.tree_cache.disable else InBatchPrefixes(self.kv)
            for req in list(self.waiting):
                if req.req_pool_idx is None and not self.kv.ready(req):
                    continue  # its prefix is being read from a lower tier: others go first
                if in_batch is not None and in_batch.should_defer(req):
                    continue
                if not adder.add(req):
                    break
                if in_batch is not None:
                    in_batch.add(req)
            admitted = {id(r) for r in adder.can_run}
            self.waiting = [r for r in self.waiting if id(r) not in admitted]
        if self.chunked_req in adder.can_run:
            self.chunked_req = None  # it comes back through `requeue` if still chunked
        if not adder.can_run:
            return None
        return ScheduleBatch(adder.can_run, is_decode=False)

    def all_loading(self) -> bool:
        """Every queued request waits for a lower tier's read (nothing to compute now)."""
        return (
            self.chunked_req is None
            and bool(self.waiting)
            and all(self.kv.loading(r) for r in self.waiting)
        )

    def requeue(self, reqs: list[Req], chunked: Req | None = None) -> None:
        """Put requests back at the front (retracted, or jumped forward: their new tail is
        computed by the next prefill); `chunked` continues with its next chunk."""
        self.waiting[:0] = reqs
        if chunked is not None:
            assert self.chunked_req is None
            self.chunked_req = chunked

    def remove(self, rid: str) -> list[Req]:
        """Take out the requests with this rid ("" = all); their KV is still theirs."""
        gone = [r for r in self.waiting if rid in ("", r.rid)]
        self.waiting = [r for r in self.waiting if r not in gone]
        if self.chunked_req is not None and rid in ("", self.chunked_req.rid):
            gone.append(self.chunked_req)
            self.chunked_req = None
        return gone


class InBatchPrefixes:
    """In-batch prefix sharing: a waiting request that shares a long prefix with one already
    admitted to this prefill batch (beyond what the cache holds) waits one step, so the
    shared part is computed once and then read from the radix cache."""

    THRESHOLD = 32

    def __init__(self, kv: KVManager):
        from loom.radix.tree import RadixTree

        self.kv = kv
        self.tree = RadixTree(page_size=1)

    def should_defer(self, req: Req) -> bool:
        if req.req_pool_idx is not None or self.tree.total_size() == 0:
            return False
        shared = len(self.tree.match_prefix(req.fill_ids, extra_key=req.extra_key).indices)
        if shared < self.THRESHOLD:
            return False
        cached, _ = self.kv.match_len(req)
        return shared - cached >= self.THRESHOLD

    def add(self, req: Req) -> None:
        ids = req.fill_ids
        self.tree.insert(ids, np.arange(len(ids), dtype=np.int64), extra_key=req.extra_key)
