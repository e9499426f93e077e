"""The prefix-cache interface the scheduler talks to, and the duck types it relies on.

Two implementations: `RadixCache` (radix/cache.py, the default) and `ChunkCache`
(radix/chunk_cache.py, `--disable-radix-cache`). The scheduler never branches on which one it
has, except through `disable`.

Slot ownership (the contract `check_integrity` and the scheduler's idle check rely on):
every KV slot is exactly one of free (in the allocator), cached (owned by the tree), or owned
by a live request. A request owns `req_to_token[row, len(req.prefix_indices):req.kv_len]`;
`req.prefix_indices` are the tree's slots it borrowed, kept alive by the lock on
`req.last_node`. (ChunkCache has no tree: its `prefix_indices` are the request's own slots,
so the request owns all of `[0, kv_len)`.) Hence `available_size + total_size + sum(owned by live requests) == total`
(counted in whole pages when page_size > 1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from loom.radix.tree import MatchResult, as_slots


class ReqToTokenPoolLike(Protocol):
    req_to_token: Any  # int32/int64 [max_reqs, max_context], numpy or a tensor; row = req_pool_idx


class AllocatorLike(Protocol):
    page_size: int

    def free(self, slots: np.ndarray) -> None:
        """Return slots; with page_size > 1 frees the unique pages `slots // page_size`."""

    def available_size(self) -> int: ...


class ReqLike(Protocol):
    fill_ids: list[int]  # prompt + output ids the request holds
    kv_len: int  # leading fill_ids whose KV is written at req_to_token[row, :kv_len]
    req_pool_idx: int
    prefix_indices: np.ndarray  # the tree's slots the request borrowed (never freed by it)
    last_node: Any  # the node locked on the request's behalf, or None
    extra_key: str | None


class BasePrefixCache(ABC):
    """What the scheduler needs from a prefix cache (see the module docstring for ownership)."""

    disable: bool

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPoolLike,
        token_to_kv_pool_allocator: AllocatorLike,
        page_size: int = 1,
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, key: Sequence[int], extra_key: str | None = None) -> MatchResult:
        """Longest cached page-aligned prefix; the caller locks `last_node` if it keeps it."""

    @abstractmethod
    def cache_finished_req(self, req: ReqLike, insert: bool = True) -> None:
        """Hand the request's KV to the cache (or free it) and release its lock.

        Afterwards the request owns no slots and `req.last_node is None`; its req_to_token row
        is left for the scheduler to free.
        """

    @abstractmethod
    def cache_unfinished_req(self, req: ReqLike) -> None:
        """Cache what the request has computed so far and keep it locked for the request.

        Afterwards `req.prefix_indices` is the slots it need not compute again and the row
        holds them; the request still owns `[len(req.prefix_indices), req.kv_len)`.
        """

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> int: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache, returning its slots to the allocator; only when no lock is held."""

    @abstractmethod
    def check_integrity(self) -> None: ...

    def _row(self, req: ReqLike) -> np.ndarray:
        """The request's first kv_len slots as int64 (a copy: the row gets rewritten)."""
        return read_slots(self.req_to_token_pool.req_to_token, req.req_pool_idx, 0, req.kv_len)


def read_slots(table, row: int, start: int, end: int) -> np.ndarray:
    """`table[row, start:end]` as a numpy int64 array (a copy), from a numpy table or a tensor
    on any device. Slots are numpy on the host (radix values, `Req.prefix_indices`, the
    allocator's); the request table is the runner's, a tensor where the forward reads it."""
    return as_slots(table[row, start:end])


def write_slots(table, row: int, start: int, slots: np.ndarray) -> None:
    """`table[row, start:start+len(slots)] = slots` for a numpy table or a tensor on any device
    (a CPU tensor is written through its numpy view: no torch index_put)."""
    end = start + len(slots)
    if isinstance(table, np.ndarray):
        table[row, start:end] = slots
    elif table.device.type == "cpu":
        table.numpy()[row, start:end] = slots
    else:
        table[row, start:end] = table.new_tensor(slots)
