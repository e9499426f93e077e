"""RadixCache / ChunkCache glue with fake pools, a fake paged allocator and fake requests.

The identity checked throughout: every KV page is exactly one of free, cached by the tree, or
owned by a live request (`row[len(prefix_indices):kv_len]`; ChunkCache: `row[:kv_len]`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.radix.base import BasePrefixCache
from loom.radix.cache import RadixCache
from loom.radix.chunk_cache import ChunkCache

MAX_REQS, MAX_CONTEXT = 8, 64


class FakeAllocator:
    """Paged free list: slot s lives on page s // page_size; free() frees whole pages."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages = set(range(num_pages))

    def alloc_page(self) -> int | None:
        if not self.free_pages:
            return None
        page = min(self.free_pages)
        self.free_pages.remove(page)
        return page

    def free(self, slots: np.ndarray) -> None:
        pages = set((slots // self.page_size).tolist())
        twice = pages & self.free_pages
        assert not twice, f"pages {sorted(twice)} freed twice"
        self.free_pages |= pages

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size


class FakeReqToTokenPool:
    def __init__(self) -> None:
        self.req_to_token = torch.full((MAX_REQS, MAX_CONTEXT), -1, dtype=torch.int32)
        self.free_rows = list(range(MAX_REQS))


@dataclass
class FakeReq:
    fill_ids: list[int]
    req_pool_idx: int
    extra_key: str | None = None
    kv_len: int = 0
    prefix_indices: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    last_node: object = None


class Harness:
    """Plays the scheduler: admits requests, computes KV chunk by chunk, checks ownership."""

    def __init__(self, cache_cls: type[BasePrefixCache], page_size: int, num_pages: int = 32):
        self.ps = page_size
        self.pool = FakeReqToTokenPool()
        self.alloc = FakeAllocator(num_pages, page_size)
        self.cache = cache_cls(self.pool, self.alloc, page_size)
        self.live: list[FakeReq] = []

    def row(self, req: FakeReq) -> torch.Tensor:
        return self.pool.req_to_token[req.req_pool_idx]

    def admit(self, tokens: list[int], extra_key: str | None = None) -> FakeReq:
        req = FakeReq(list(tokens), self.pool.free_rows.pop(0), extra_key)
        m = self.cache.match_prefix(tokens, extra_key)
        self.cache.inc_lock_ref(m.last_node)
        req.prefix_indices, req.last_node, req.kv_len = m.indices, m.last_node, len(m.indices)
        self.row(req)[: req.kv_len] = torch.from_numpy(m.indices).to(torch.int32)
        self.live.append(req)
        return req

    def pages_needed(self, req: FakeReq, n: int) -> int:
        return sum(1 for p in range(req.kv_len, req.kv_len + n) if p % self.ps == 0)

    def compute(self, req: FakeReq, n: int) -> bool:
        """Allocate and 'write' KV for the next n tokens (evicting if needed)."""
        assert req.kv_len + n <= len(req.fill_ids)
        need = self.pages_needed(req, n)
        if need > len(self.alloc.free_pages):
            self.cache.evict((need - len(self.alloc.free_pages)) * self.ps)
        if need > len(self.alloc.free_pages):
            return False
        row = self.row(req)
        for p in range(req.kv_len, req.kv_len + n):
            row[p] = self.alloc.alloc_page() * self.ps if p % self.ps == 0 else row[p - 1] + 1
        req.kv_len += n
        return True

    def finish(self, req: FakeReq, insert: bool = True) -> None:
        self.cache.cache_finished_req(req, insert=insert)
        assert req.last_node is None
        self.live.remove(req)
        self.row(req).fill_(-1)
        self.pool.free_rows.append(req.req_pool_idx)

    def owned_pages(self, req: FakeReq) -> set[int]:
        start = 0 if self.cache.disable else len(req.prefix_indices)
        return set((self.row(req)[start : req.kv_len].long() // self.ps).tolist())

    def check(self) -> None:
        self.cache.check_integrity()
        tree = self.cache.tree.all_values() if not self.cache.disable else np.empty(0, np.int64)
        tree_pages = set((tree // self.ps).tolist())
        assert len(tree_pages) * self.ps == self.cache.total_size()
        parts = [self.alloc.free_pages, tree_pages] + [self.owned_pages(r) for r in self.live]
        assert sum(len(p) for p in parts) == self.alloc.num_pages, "a page leaked or is shared"
        assert set().union(*parts) == set(range(self.alloc.num_pages))
        owned = sum(len(self.owned_pages(r)) for r in self.live) * self.ps
        total = self.alloc.num_pages * self.ps
        assert self.alloc.available_size() + self.cache.total_size() + owned == total
        for r in self.live:  # the borrowed prefix is what the row points at
            n = len(r.prefix_indices)
            assert self.row(r)[:n].long().tolist() == r.prefix_indices.tolist()


PAGE_SIZES = [1, 4]


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_finished_request_is_reused(ps: int):
    h = Harness(RadixCache, ps)
    a = h.admit(list(range(10)))
    assert a.kv_len == 0 and h.compute(a, 10)
    a_slots = h.row(a)[:10].long().clone()
    h.finish(a)
    aligned = 10 - 10 % ps
    assert h.cache.total_size() == aligned and h.cache.protected_size() == 0
    h.check()

    b = h.admit(list(range(9)) + [99, 98])
    expect = 9 - 9 % ps
    assert b.prefix_indices.tolist() == a_slots[:expect].tolist()
    assert h.cache.protected_size() == expect
    h.check()
    assert h.compute(b, len(b.fill_ids) - b.kv_len)
    h.check()
    h.finish(b)
    assert h.cache.protected_size() == 0
    assert h.cache.total_size() == aligned + (11 - 11 % ps) - expect
    h.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_concurrent_duplicates_are_freed(ps: int):
    h = Harness(RadixCache, ps)
    a, b = h.admit(list(range(10))), h.admit(list(range(10)))  # neither sees the other
    h.compute(a, 10)
    h.compute(b, 10)
    h.check()
    h.finish(a)
    free_before = h.alloc.available_size()
    h.finish(b)  # everything b computed is a duplicate or its own tail
    assert h.alloc.available_size() == free_before + (10 + (-10 % ps))
    assert h.cache.total_size() == 10 - 10 % ps
    h.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_chunked_prefill_then_decode(ps: int):
    h = Harness(RadixCache, ps)
    prompt = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    req = h.admit(prompt)
    for chunk in (3, 3, 3, 2):
        assert h.compute(req, chunk)
        h.cache.cache_unfinished_req(req)
        aligned = req.kv_len - req.kv_len % ps
        assert len(req.prefix_indices) == aligned
        assert h.cache.protected_size() == aligned == h.cache.total_size()
        assert req.last_node is not None
        h.check()
    for tok in (11, 12, 13):  # decode: the previous token's KV gets written
        req.fill_ids.append(tok)
        assert h.compute(req, 1)
        h.check()
    h.finish(req)
    kv = len(prompt) + 3
    assert h.cache.total_size() == kv - kv % ps and h.cache.protected_size() == 0
    assert h.cache.match_prefix(req.fill_ids).indices.size == kv - kv % ps
    h.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_unfinished_duplicate_repoints_row(ps: int):
    h = Harness(RadixCache, ps)
    a, b = h.admit(list(range(12))), h.admit(list(range(12)))
    h.compute(a, 12)
    h.compute(b, 9)
    h.finish(a)
    b_own = h.row(b)[:9].long().clone()
    h.cache.cache_unfinished_req(b)
    aligned = 9 - 9 % ps
    tree_slots = h.cache.match_prefix(list(range(12))).indices
    assert b.prefix_indices.tolist() == tree_slots[:aligned].tolist()
    assert h.row(b)[:aligned].long().tolist() == tree_slots[:aligned].tolist()
    assert h.row(b)[aligned:9].long().tolist() == b_own[aligned:].tolist()  # its tail
    h.check()
    h.compute(b, 3)
    h.finish(b)
    assert h.cache.total_size() == 12 and h.cache.protected_size() == 0
    h.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_abort_frees_without_inserting(ps: int):
    h = Harness(RadixCache, ps)
    a = h.admit(list(range(8)))
    h.compute(a, 8)
    h.finish(a)
    b = h.admit(list(range(8)) + [50, 51, 52])
    h.compute(b, 3)
    h.check()
    h.finish(b, insert=False)
    assert h.cache.total_size() == 8 and h.cache.protected_size() == 0
    h.check()


def test_eviction_returns_pages_and_spares_locked_prefixes():
    h = Harness(RadixCache, 4, num_pages=6)
    a = h.admit(list(range(8)))
    h.compute(a, 8)
    h.finish(a)
    b = h.admit(list(range(100, 108)))
    h.compute(b, 8)
    h.finish(b)
    c = h.admit(list(range(8)) + [9])  # locks a's prefix
    assert h.cache.protected_size() == 8 and h.cache.evictable_size() == 8
    assert h.cache.evict(100) == 8  # only b's
    assert h.alloc.available_size() == 6 * 4 - 8 and h.cache.total_size() == 8
    h.check()
    h.finish(c, insert=False)
    assert h.cache.evict(100) == 8
    h.check()
    assert h.alloc.available_size() == 6 * 4


def test_extra_key_isolation():
    h = Harness(RadixCache, 1)
    a = h.admit([1, 2, 3, 4], extra_key="lora-a")
    h.compute(a, 4)
    h.finish(a)
    assert h.admit([1, 2, 3, 4]).kv_len == 0
    assert h.admit([1, 2, 3, 4], extra_key="lora-b").kv_len == 0
    assert h.admit([1, 2, 3, 4], extra_key="lora-a").kv_len == 4
    h.check()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_chunk_cache(ps: int):
    h = Harness(ChunkCache, ps)
    assert h.cache.disable
    a = h.admit(list(range(10)))
    assert a.kv_len == 0 and a.last_node is None
    h.compute(a, 6)
    h.cache.cache_unfinished_req(a)
    assert a.prefix_indices.tolist() == h.row(a)[:6].long().tolist()
    h.check()
    h.compute(a, 4)
    h.finish(a)
    assert h.alloc.available_size() == h.alloc.num_pages * ps
    assert h.admit(list(range(10))).kv_len == 0
    c = h.cache
    assert c.total_size() == c.evictable_size() == c.protected_size() == c.evict(10) == 0
    assert c.inc_lock_ref(None) == c.dec_lock_ref(None) == 0
    h.check()


def test_reset():
    h = Harness(RadixCache, 1)
    a = h.admit([1, 2, 3])
    h.compute(a, 3)
    h.finish(a)
    h.cache.reset()  # returns the cached slots to the allocator
    assert h.cache.total_size() == 0
    assert h.cache.match_prefix([1, 2, 3]).indices.size == 0
    assert h.alloc.available_size() == h.alloc.num_pages
    h.check()
    b = h.admit([1, 2, 3])
    h.compute(b, 3)
    h.cache.cache_unfinished_req(b)  # b now locks its prefix
    with pytest.raises(AssertionError, match="locked"):
        h.cache.reset()


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    ps=st.sampled_from(PAGE_SIZES),
    disable=st.booleans(),
)
def test_random_schedules_keep_pages_accounted(seed: int, ps: int, disable: bool):
    """A toy scheduler: admit / chunk / decode / finish / abort / evict in random order."""
    rng = random.Random(seed)
    h = Harness(ChunkCache if disable else RadixCache, ps, num_pages=40 // ps + 6)
    stems = [[0, 0, 0, 0, 1, 1], [0, 0, 0, 0, 2], [3, 3, 3]]
    ops = ["admit"] * 3 + ["chunk"] * 4 + ["decode"] * 2 + ["finish"] * 2 + ["abort", "evict"]
    for _ in range(50):
        op = rng.choice(ops)
        if op == "admit" and h.pool.free_rows:
            # Identical prompts are common, so concurrent requests compute duplicates.
            tokens = rng.choice(stems) + [rng.randint(0, 1)] * rng.randint(0, 3)
            h.admit(tokens, extra_key=rng.choice([None, None, "salt"]))
        elif op == "chunk":
            todo = [r for r in h.live if r.kv_len < len(r.fill_ids)]
            if todo:
                req = rng.choice(todo)
                if h.compute(req, rng.randint(1, len(req.fill_ids) - req.kv_len)):
                    h.cache.cache_unfinished_req(req)
        elif op == "decode":
            done = [r for r in h.live if r.kv_len == len(r.fill_ids) and r.kv_len < 40]
            if done:
                req = rng.choice(done)
                req.fill_ids.append(rng.randint(0, 3))
                h.compute(req, 1)
        elif op in ("finish", "abort") and h.live:
            h.finish(rng.choice(h.live), insert=op == "finish")
        elif op == "evict":
            h.cache.evict(rng.randint(1, 12))
        h.check()
    for req in list(h.live):
        h.finish(req)
    assert h.cache.protected_size() == 0
    h.check()
