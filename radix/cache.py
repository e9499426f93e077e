"""RadixCache: the radix tree wired to requests, the req_to_token pool and the KV allocator.

A request's KV goes into the tree twice in its life: while it runs (`cache_unfinished_req`,
after each prefill chunk, so later chunks and concurrent requests reuse it) and when it ends
(`cache_finished_req`, so the next turn or sibling fork reuses prompt AND output). Only whole
pages enter the tree; the unaligned tail stays the request's own until it finishes.

Duplicates: two requests may compute the same tokens before either is cached. `insert`
reports how much was already cached; the slots the request computed for that range
(`[len(req.prefix_indices), already_cached)`) are freed here, and for a running request its
row is rewritten to point at the tree's copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from loom.radix.base import (
    AllocatorLike,
    BasePrefixCache,
    ReqLike,
    ReqToTokenPoolLike,
    write_slots,
)
from loom.radix.tree import MatchResult, RadixTree, TreeNode


class RadixCache(BasePrefixCache):
    """Prefix cache backed by a `RadixTree` whose evictions go back to the allocator."""

    disable = False

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPoolLike,
        token_to_kv_pool_allocator: AllocatorLike,
        page_size: int = 1,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        self.tree = RadixTree(page_size, on_free=token_to_kv_pool_allocator.free)

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return self.tree.match_prefix(key, extra_key)

    def _insert_computed(self, req: ReqLike) -> tuple[list[int], np.ndarray, int]:
        """Insert the request's page-aligned KV and free the duplicates it computed.

        Returns (aligned tokens, the request's slots for [0, kv_len), aligned length).
        """
        kv_len = req.kv_len
        n_borrowed = len(req.prefix_indices)
        assert n_borrowed <= kv_len <= len(req.fill_ids), (n_borrowed, kv_len, len(req.fill_ids))
        slots = self._row(req)
        aligned = kv_len - kv_len % self.page_size
        tokens = list(req.fill_ids[:aligned])
        present = self.tree.insert(tokens, slots[:aligned], getattr(req, "extra_key", None))
        if present > n_borrowed:
            self.token_to_kv_pool_allocator.free(slots[n_borrowed:present])
        return tokens, slots, aligned

    def cache_finished_req(self, req: ReqLike, insert: bool = True) -> None:
        """Insert the request's KV (or, with insert=False, e.g. on abort, just free it).

        Frees: duplicates of what the tree already had, and the unaligned tail (its page is
        the request's alone). Releases the request's lock and sets `req.last_node = None`.
        """
        if insert:
            _, slots, aligned = self._insert_computed(req)
            if aligned < req.kv_len:
                self.token_to_kv_pool_allocator.free(slots[aligned:])
        else:
            slots = self._row(req)
            if len(req.prefix_indices) < req.kv_len:
                self.token_to_kv_pool_allocator.free(slots[len(req.prefix_indices) :])
        self.dec_lock_ref(req.last_node)
        req.last_node = None

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """Insert the computed page-aligned KV and re-point the request at the tree's copy.

        Afterwards: `req_to_token[row, :aligned]` == `req.prefix_indices` (the tree's slots),
        `req.last_node` is locked (the old one unlocked), and the tail `[aligned, kv_len)`
        still belongs to the request.
        """
        tokens, _, aligned = self._insert_computed(req)
        match = self.tree.match_prefix(tokens, getattr(req, "extra_key", None))
        assert len(match.indices) == aligned, (len(match.indices), aligned)
        write_slots(self.req_to_token_pool.req_to_token, req.req_pool_idx, 0, match.indices)
        self.inc_lock_ref(match.last_node)  # lock the new path before releasing the old one
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = match.indices
        req.last_node = match.last_node

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock root..node (None: no-op); returns the growth of protected_size()."""
        return 0 if node is None else self.tree.inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlock root..node (None: no-op); returns the change of protected_size() (<= 0)."""
        return 0 if node is None else self.tree.dec_lock_ref(node)

    def evict(self, num_tokens: int) -> int:
        return self.tree.evict(num_tokens)

    def evictable_size(self) -> int:
        return self.tree.evictable_size()

    def protected_size(self) -> int:
        return self.tree.protected_size()

    def total_size(self) -> int:
        return self.tree.total_size()

    def reset(self) -> None:
        """Free every cached slot back to the allocator and empty the tree (flush_cache).

        Only valid when no request holds a lock (the scheduler is idle).
        """
        self.tree.evict(self.tree.total_size())
        assert self.tree.total_size() == 0, (
            f"reset with {self.tree.protected_size()} tokens still locked by live requests"
        )
        self.tree.reset()

    def check_integrity(self) -> None:
        self.tree.check_integrity()

    def pretty_print(self) -> str:
        return self.tree.pretty_print()
