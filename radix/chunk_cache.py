"""ChunkCache: the prefix cache with caching turned off (`--disable-radix-cache`).

Nothing is shared and nothing outlives its request: a match is always empty, a finished
request frees every slot it holds, and an unfinished one (chunked prefill) just records its
own slots as its prefix so the next chunk computes only the rest. All sizes are 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loom.radix.base import BasePrefixCache, ReqLike
from loom.radix.tree import MatchResult, empty_indices


class ChunkCache(BasePrefixCache):
    """Same interface as RadixCache; `last_node` is always None."""

    disable = True

    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        return MatchResult(empty_indices(), None)

    def cache_finished_req(self, req: ReqLike, insert: bool = True) -> None:
        """Free all of the request's slots `[0, kv_len)`."""
        if req.kv_len > 0:
            self.token_to_kv_pool_allocator.free(self._row(req))
        req.last_node = None

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """`req.prefix_indices` = its own slots `[0, kv_len)` (still owned by the request)."""
        req.prefix_indices = self._row(req)
        req.last_node = None

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def check_integrity(self) -> None:
        pass
