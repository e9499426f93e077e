"""KVManager: the scheduler's one owner of KV memory.

KV regions. Every KV slot (counted in whole pages) is exactly one of:

- free: in the allocator's free list;
- cached: held by the prefix cache (radix tree) and evictable unless a live request locks it;
- owned by a live request: `req_to_token[row, len(req.prefix_indices):req.kv_len]`, plus, for
  the length of one step, the slots allocated for the positions that step computes
  (`req.new_slots`, positions kv_len .. kv_len + extend_len - 1). Owned slots fill whole pages;
  the request's last page may be partly filled.

A live request also borrows `req_to_token[row, :len(req.prefix_indices)]` from the cache (kept
alive by the lock on `req.last_node`), and holds one request row of the ReqToTokenPool from
admission to release. Hence `free + cached + owned == total` whenever no step is in flight
(`check_integrity`).

Only this class allocates, frees, truncates or retracts KV; prefill, decode, result
processing and jump-forward ask it.
"""

from __future__ import annotations

import numpy as np

from loom.radix.base import read_slots, write_slots
from loom.runtime.req import Req

_NO_LOAD = object()  # a request `ready` has not looked at yet


class KVManager:
    def __init__(self, req_to_token_pool, allocator, tree_cache, page_size: int):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        self._table_np = None  # (req_to_token, its numpy view) on the CPU (alloc_decode)

    @property
    def hierarchical(self) -> bool:
        return getattr(self.tree_cache, "hierarchical", False)

    def _alloc_cached(self, n: int) -> np.ndarray | None:
        """Fresh slots for n tokens the prefix cache loads from a lower tier (they enter the
        tree at once, so they are cached, never owned by a request); evicts if needed."""
        need = -(-n // self.page_size) * self.page_size
        if need > self.allocator.available_size():
            self.tree_cache.evict(need - self.allocator.available_size())
        return self.allocator.alloc(n)

    # ------------------------------------------------------------ overlapped loads
    def ready(self, req: Req) -> bool:
        """False while the hierarchical cache's loader thread reads this waiting request's
        prefix from L3 (radix/hicache.py, `prefetch`): it stays queued, others are scheduled.
        The job is started on the first call; once done its pages are in L2 for `admit`."""
        if not self.hierarchical:
            return True
        job = req.__dict__.get("_hicache_load", _NO_LOAD)
        if job is _NO_LOAD:  # first look: start the read (the last token is always computed)
            job = self.tree_cache.prefetch(req.fill_ids[:-1], req.extra_key)
            req._hicache_load = job
        if job is None:
            return True
        if not job.done.is_set():
            return False
        self.tree_cache.finish_prefetch(job)
        req._hicache_load = None
        return True

    def loading(self, req: Req) -> bool:
        """A read started by `ready` and not finished yet."""
        job = req.__dict__.get("_hicache_load")
        return job is not None and job is not _NO_LOAD and not job.done.is_set()

    # ------------------------------------------------------------ pinned prefixes (CAG)
    def pin(self, name: str, input_ids: list[int], text: str | None) -> int:
        """Pin the cached prefix `input_ids` (loading lower tiers' pages first); returns the
        tokens pinned. ValueError when the prefix is not cached."""
        self.tree_cache.load_back(input_ids, None, self._alloc_cached)
        return self.tree_cache.pin(name, list(input_ids), text)

    def restore_pins(self) -> int:
        """Re-lock the pins recorded in L3 (a restart, another replica's pins); returns how
        many. A pin whose pages are gone is left to its next /pin_prefix."""
        restored = 0
        for rec in self.tree_cache.stored_pins():
            ids = rec["input_ids"]
            self.tree_cache.load_back(ids, rec.get("extra_key"), self._alloc_cached)
            try:
                self.tree_cache.pin(rec["name"], ids, rec.get("text"), persist=False)
                restored += 1
            except ValueError:
                continue
        return restored

    @property
    def size(self) -> int:
        return self.allocator.size

    def available(self) -> int:
        return self.allocator.available_size()

    def evictable(self) -> int:
        return self.tree_cache.evictable_size()

    def match_len(self, req: Req) -> tuple[int, object]:
        """Cached prefix length of `req` (and the node it ends at), without locking it."""
        m = self.tree_cache.match_prefix(req.fill_ids, extra_key=req.extra_key)
        return len(m.indices), m.last_node

    # ------------------------------------------------------------ admission
    def admit(self, req: Req, limit: int) -> bool:
        """Give `req` a request row and its cached prefix of at most `limit` tokens (locked).
        False when no request row is free."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        req.req_pool_idx = row
        limit = max(0, limit) // self.page_size * self.page_size
        if self.hierarchical:  # lower tiers' pages of this prefix come back into the pool
            self.tree_cache.load_back(req.fill_ids[:limit], req.extra_key, self._alloc_cached)
        match = self.tree_cache.match_prefix(req.fill_ids[:limit], extra_key=req.extra_key)
        req.prefix_indices, req.last_node = match.indices, match.last_node
        self.tree_cache.inc_lock_ref(req.last_node)
        n = len(match.indices)
        if n:
            write_slots(self.req_to_token_pool.req_to_token, row, 0, match.indices)
        req.kv_len = n
        return True

    def undo_admit(self, req: Req) -> None:
        """Give back what `admit` took (the request computed nothing yet)."""
        assert req.kv_len == len(req.prefix_indices) and not req.is_chunked
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.reset_kv()

    # ------------------------------------------------------------ allocation
    def pages_short(self, reqs: list[Req], n_each: list[int]) -> int:
        """Slots missing to give each request n_each more positions, after evicting cache."""
        if self.page_size == 1:  # a slot a position (a decode step: sum(n_each) == len(reqs))
            need = sum(n_each)
        else:
            need = (
                sum(self.allocator.pages_needed(r.kv_len, n) for r, n in zip(reqs, n_each))
                * self.page_size
            )
        short = need - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
            short = need - self.allocator.available_size()
        return short

    def alloc(self, req: Req, n: int) -> np.ndarray | None:
        """Slots for positions kv_len .. kv_len+n-1 of `req`, evicting cache if needed; they
        are written into the request's row and kept on `req.new_slots`."""
        need = self.allocator.pages_needed(req.kv_len, n) * self.page_size
        if need > self.allocator.available_size():
            self.tree_cache.evict(need - self.allocator.available_size())
        view = self._table_view()
        if view is not None:  # page size 1 on the CPU: a verify's slots, written through numpy
            slots = self.allocator.alloc(n)
            if slots is None:
                return None
            view[req.req_pool_idx, req.kv_len : req.kv_len + n] = slots
            req.new_slots = slots
            return slots
        table = self.req_to_token_pool.req_to_token
        last = int(table[req.req_pool_idx, req.kv_len - 1]) if req.kv_len > 0 else 0
        slots = self.allocator.alloc_extend(req.kv_len, last, n)
        if slots is None:
            return None
        write_slots(table, req.req_pool_idx, req.kv_len, slots)
        req.new_slots = slots
        return slots

    def _host_table(self) -> np.ndarray | None:
        """`req_to_token` as a numpy array of the same memory (the table itself when it is
        numpy, a CPU tensor's view); None for a table on a device. Kept per table."""
        table = self.req_to_token_pool.req_to_token
        if self._table_np is None or self._table_np[0] is not table:
            if isinstance(table, np.ndarray):
                view = table
            else:
                view = table.numpy() if table.device.type == "cpu" else None
            self._table_np = (table, view)
        return self._table_np[1]

    def _table_view(self) -> np.ndarray | None:
        """The host table with page size 1 (a slot needs no page arithmetic); None otherwise."""
        return self._host_table() if self.page_size == 1 else None

    def alloc_decode(self, reqs: list[Req]) -> np.ndarray:
        """One slot per request for position kv_len (the caller checked `pages_short`), in
        one vectorized step; returns the slots in request order."""
        table = self.req_to_token_pool.req_to_token
        b = len(reqs)
        view = self._table_view()
        if view is not None:
            # the common CPU case in plain Python and numpy: a torch index_put and the index
            # tensors cost ~30 us of a batch-1 step's ~300 us outside the forward
            slots = self.allocator.alloc(b)
            assert slots is not None, "alloc_decode after pages_short said it fits"
            if b == 1:
                view[reqs[0].req_pool_idx, reqs[0].kv_len] = slots[0]
            else:
                view[[r.req_pool_idx for r in reqs], [r.kv_len for r in reqs]] = slots
            return slots
        rows = np.array([r.req_pool_idx for r in reqs], dtype=np.int64)
        pos = np.array([r.kv_len for r in reqs], dtype=np.int64)
        t = self._host_table()
        if t is not None:  # page size > 1 on the host: through the table's numpy view
            last = t[rows, np.maximum(pos - 1, 0)].astype(np.int64)
            slots = self.allocator.alloc_decode(pos, last)
            assert slots is not None, "alloc_decode after pages_short said it fits"
            t[rows, pos] = slots
            return slots
        dev_rows, dev_pos = table.new_tensor(rows).long(), table.new_tensor(pos).long()
        last = None
        if self.page_size > 1:
            last = table[dev_rows, (dev_pos - 1).clamp(min=0)].cpu().numpy().astype(np.int64)
        slots = self.allocator.alloc_decode(pos, last)
        assert slots is not None, "alloc_decode after pages_short said it fits"
        table[dev_rows, dev_pos] = table.new_tensor(slots)
        return slots

    def truncate(self, req: Req, new_len: int, written_end: int) -> None:
        """Keep the request's KV for positions < new_len; free its slots for positions up to
        written_end (all owned by the request). The partial last page stays: alloc refills it."""
        assert len(req.prefix_indices) <= new_len <= written_end, (req, new_len, written_end)
        first_free = -(-new_len // self.page_size) * self.page_size
        if first_free < written_end:
            table = self.req_to_token_pool.req_to_token
            self.allocator.free(read_slots(table, req.req_pool_idx, first_free, written_end))
        req.kv_len = new_len

    # ------------------------------------------------------------ caching and release
    def cache_unfinished(self, req: Req) -> None:
        """Share what `req` has computed so far through the cache (it keeps running)."""
        self.tree_cache.cache_unfinished_req(req)

    def release(self, req: Req, insert: bool = True) -> None:
        """Hand the request's KV to the prefix cache (which frees what it does not keep) and
        free its row; `insert=False` frees its own slots uncached (KV never written)."""
        self.tree_cache.cache_finished_req(req, insert=insert)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None

    def retract(self, req: Req) -> None:
        """Release `req`'s KV (into the cache when enabled); it is recomputed on readmission."""
        self.release(req)
        req.reset_kv()
        req.retract_count += 1

    def flush(self) -> None:
        self.tree_cache.reset()

    # ------------------------------------------------------------ integrity
    def check_integrity(self, live: list[Req]) -> None:
        """free + cached + owned == total, every live request's invariants, one row each."""
        in_use = 0
        for req in live:
            req.check()
            shared = 0 if self.tree_cache.disable else len(req.prefix_indices)
            in_use += -(-(req.kv_len - shared) // self.page_size) * self.page_size
        free = self.allocator.available_size()
        cached = self.tree_cache.total_size()
        assert free + cached + in_use == self.allocator.size, (
            f"KV leak: free {free} + cached {cached} + in use {in_use} != total {self.allocator.size}"
        )
        self.allocator.check_no_duplicates()
        self.tree_cache.check_integrity()
        pool = self.req_to_token_pool
        assert pool.available_size() + len(live) == pool.size, "request rows leaked"
