"""PrefillAdder: admits waiting requests into one extend batch under token and KV budgets."""

from __future__ import annotations

import torch

from loom.runtime.req import Req

# Future decode tokens reserved per running request are clipped to this many, as in SGLang.
CLIP_MAX_NEW_TOKENS = 4096


class PrefillAdder:
    """Admits requests front to back. For each it matches the cached prefix, locks it, and
    allocates KV for the rest; it stops at the first request that does not fit, so the queue
    order (the policy) is respected. A request that exceeds the chunk budget is cut at the
    budget and becomes the chunked request."""

    def __init__(self, sched, running: list[Req], new_token_ratio: float, slots_left: int):
        self.s = sched
        self.page = sched.page_size
        chunk = sched.args.effective_chunked_prefill_size
        self.chunked = chunk is not None
        self.rem_input = chunk if chunk is not None else sched.args.max_prefill_tokens
        reserved = sum(
            min(r.remaining_new_tokens, CLIP_MAX_NEW_TOKENS) * new_token_ratio for r in running
        )
        self.rem_total = (
            sched.allocator.available_size() + sched.tree_cache.evictable_size() - reserved
        )
        self.ratio = new_token_ratio
        self.slots_left = slots_left
        self.can_run: list[Req] = []

    def add(self, req: Req, continuing: bool = False) -> bool:
        """Try to admit `req` (`continuing`: the chunked request's next chunk); returns False
        when nothing more can be admitted this step."""
        s = self.s
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
        slots = s.alloc_for_req(req, extend)
        if slots is None:
            return self._undo(req)
        req.extend_len = extend
        req.is_chunked = truncated
        self.can_run.append(req)
        self.rem_input -= extend
        self.rem_total -= extend + future
        if not continuing:
            self.slots_left -= 1
        return not truncated

    def _admit(self, req: Req) -> bool:
        """Give `req` a request row and its cached prefix (locked)."""
        s = self.s
        row = s.req_to_token_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        limit = req.seq_len - 1  # compute at least one token: its logits give the next one
        if req.return_logprob and len(req.logprob.input_token_logprobs) == 0:
            limit = min(limit, max(req.logprob.start_len, 1) - 1)
        limit = max(0, limit) // self.page * self.page
        match = s.tree_cache.match_prefix(req.fill_ids[:limit], extra_key=req.extra_key)
        req.prefix_indices, req.last_node = match.indices, match.last_node
        s.tree_cache.inc_lock_ref(req.last_node)
        n = len(match.indices)
        if n:
            s.req_to_token_pool.req_to_token[row, :n] = match.indices.to(
                s.req_to_token_pool.req_to_token.device
            )
        req.kv_len = n
        if req.retract_count == 0:
            req.cached_tokens = n
        return True

    def _undo(self, req: Req) -> bool:
        """Release what `_admit` took for a request that does not fit after all."""
        if req.is_chunked or req.kv_len > len(req.prefix_indices):
            return False  # already holds computed KV (a chunked request): keep it
        self.s.tree_cache.dec_lock_ref(req.last_node)
        self.s.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv()
        return False


class InBatchPrefixes:
    """In-batch prefix sharing: a waiting request that shares a long prefix with one already
    admitted to this prefill batch (beyond what the cache holds) waits one step, so the
    shared part is computed once and then read from the radix cache."""

    THRESHOLD = 32

    def __init__(self, tree_cache):
        from loom.radix.tree import RadixTree

        self.cache = tree_cache
        self.tree = RadixTree(page_size=1)

    def should_defer(self, req: Req) -> bool:
        if req.req_pool_idx is not None or self.tree.total_size() == 0:
            return False
        shared = len(self.tree.match_prefix(req.fill_ids, extra_key=req.extra_key).indices)
        if shared < self.THRESHOLD:
            return False
        cached = len(self.cache.match_prefix(req.fill_ids, extra_key=req.extra_key).indices)
        return shared - cached >= self.THRESHOLD

    def add(self, req: Req) -> None:
        ids = req.fill_ids
        self.tree.insert(ids, torch.arange(len(ids), dtype=torch.int64), extra_key=req.extra_key)
