"""Random insert / match / lock / unlock / evict sequences against a naive reference model.

The reference keeps every cached page-aligned prefix explicitly: `ref[(extra_key,
tokens[:k * page_size])]` is the slots of its last page, for every k. The tree must agree with it on every match, account for every
slot exactly once (free list or tree), and never evict a locked prefix.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
)

from loom.radix.tree import RadixTree

EXTRA_KEYS = [None, "lora-a"]
NUM_PAGES = 24
CHUNKS = [(0, 0, 0, 0), (0, 0, 0, 1), (0, 1, 0, 0), (0,), (1,), (2,)]

Prefix = tuple[object, tuple[int, ...]]


class RadixMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        ps = self.page_size
        self.free_pages: set[int] = set(range(NUM_PAGES))
        self.tree = RadixTree(ps, on_free=self._on_free)
        self.ref: dict[Prefix, tuple[int, ...]] = {}  # cached prefix -> its last page's slots
        self.locks: list[tuple[object, Prefix]] = []  # (node, prefix it covers)
        self.lock_count: dict[Prefix, int] = {}
        self.freed_by_last_evict: list[int] = []

    # ---- the simulated allocator ----------------------------------------------------------

    def _alloc(self, n_tokens: int) -> torch.Tensor | None:
        ps = self.page_size
        n_pages = n_tokens // ps
        if n_pages > len(self.free_pages):
            self.tree.evict((n_pages - len(self.free_pages)) * ps)
            self._forget_freed()
        if n_pages > len(self.free_pages):
            return None
        pages = sorted(self.free_pages)[:n_pages]
        self.free_pages.difference_update(pages)
        return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)

    def _free(self, value: torch.Tensor) -> list[int]:
        ps = self.page_size
        pages = sorted({s // ps for s in value.tolist()})
        for p in pages:
            assert p not in self.free_pages, f"page {p} freed twice"
        self.free_pages.update(pages)
        return pages

    def _on_free(self, value: torch.Tensor) -> None:
        self.freed_by_last_evict.extend(value.tolist())
        self._free(value)

    def _forget_freed(self) -> None:
        """Drop the evicted slots from the reference; they must not be locked."""
        freed = set(self.freed_by_last_evict)
        self.freed_by_last_evict = []
        if not freed:
            return
        gone = [p for p, s in self.ref.items() if s[0] in freed]
        assert len(gone) * self.page_size == len(freed), "evicted slots the reference lacks"
        for p in gone:
            assert self.lock_count.get(p, 0) == 0, f"evicted locked prefix {p}"
            del self.ref[p]
        ps = self.page_size
        for extra, toks in self.ref:  # still prefix-closed: only leaves were evicted
            assert len(toks) == ps or (extra, toks[:-ps]) in self.ref

    # ---- reference queries ----------------------------------------------------------------

    def _aligned(self, key: list[int]) -> list[int]:
        return key[: len(key) - len(key) % self.page_size]

    def _ref_match(self, key: list[int], extra: object) -> list[int]:
        ps, out = self.page_size, []
        for k in range(1, len(key) // ps + 1):
            page = self.ref.get((extra, tuple(key[: k * ps])))
            if page is None:
                break
            out.extend(page)
        return out

    # ---- rules ----------------------------------------------------------------------------

    # Keys are runs of a few chunks, so prefixes collide both at page boundaries and inside
    # pages (for page_size 4) and for single tokens (for page_size 1).
    keys = st.lists(st.sampled_from(CHUNKS), max_size=5).map(lambda cs: [t for c in cs for t in c])
    extras = st.sampled_from(EXTRA_KEYS)

    inserted = Bundle("inserted")  # (key, extra) pairs once inserted, to match and lock

    @rule(target=inserted, key=keys, extra=extras)
    def insert(self, key: list[int], extra: object) -> object:
        key = self._aligned(key)
        value = self._alloc(len(key))
        if value is None:
            return multiple()
        expected = len(self._ref_match(key, extra))
        present = self.tree.insert(key, value, extra_key=extra)
        assert present == expected, (present, expected)
        if present:
            self._free(value[:present])  # the caller frees its duplicates
        ps = self.page_size
        for end in range(present + ps, len(key) + 1, ps):
            self.ref[(extra, tuple(key[:end]))] = tuple(value[end - ps : end].tolist())
        return (key, extra)

    @rule(key=keys, extra=extras)
    def match(self, key: list[int], extra: object) -> None:
        m = self.tree.match_prefix(key, extra_key=extra)
        assert m.indices.tolist() == self._ref_match(key, extra)

    @rule(entry=inserted, cut=st.integers(0, 24))
    def match_cached(self, entry: tuple[list[int], object], cut: int) -> None:
        self.match(entry[0][:cut] + [1, 2], entry[1])

    @rule(entry=inserted, cut=st.integers(0, 24))
    def lock_cached(self, entry: tuple[list[int], object], cut: int) -> None:
        self.lock(entry[0][:cut], entry[1])

    @rule(key=keys, extra=extras)
    def lock(self, key: list[int], extra: object) -> None:
        m = self.tree.match_prefix(key, extra_key=extra)
        ps = self.page_size
        covered = [(extra, tuple(key[:end])) for end in range(ps, len(m.indices) + 1, ps)]
        newly = ps * sum(1 for p in covered if self.lock_count.get(p, 0) == 0)
        before = self.tree.protected_size()
        assert self.tree.inc_lock_ref(m.last_node) == newly
        assert self.tree.protected_size() == before + newly
        for p in covered:
            self.lock_count[p] = self.lock_count.get(p, 0) + 1
        self.locks.append((m.last_node, covered))

    @precondition(lambda self: self.locks)
    @rule(which=st.integers(0, 1000))
    def unlock(self, which: int) -> None:
        node, covered = self.locks.pop(which % len(self.locks))
        for p in covered:
            self.lock_count[p] -= 1
        released = self.page_size * sum(1 for p in covered if self.lock_count[p] == 0)
        assert self.tree.dec_lock_ref(node) == -released

    @rule(n=st.integers(0, 3 * NUM_PAGES))
    def evict(self, n: int) -> None:
        evictable = self.tree.evictable_size()
        freed = self.tree.evict(n)
        assert freed == len(self.freed_by_last_evict)
        assert freed >= min(n, evictable) or self.tree.evictable_size() == 0
        self._forget_freed()

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        ps = self.page_size
        protected = ps * sum(1 for p in self.ref if self.lock_count.get(p, 0) > 0)
        assert self.tree.total_size() == ps * len(self.ref)
        assert self.tree.protected_size() == protected
        assert self.tree.evictable_size() == ps * len(self.ref) - protected
        tree_slots = self.tree.all_values().tolist()
        assert sorted(tree_slots) == sorted(s for page in self.ref.values() for s in page)
        tree_pages = {s // ps for s in tree_slots}
        assert len(tree_pages) * ps == len(tree_slots)
        assert not tree_pages & self.free_pages, "a page is both free and cached"
        assert len(tree_pages) + len(self.free_pages) == NUM_PAGES, "a page leaked"


class RadixMachinePaged(RadixMachine):
    page_size = 4


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixStateMachine = RadixMachine.TestCase
TestRadixStateMachine.settings = _settings
TestRadixStateMachinePaged = RadixMachinePaged.TestCase
TestRadixStateMachinePaged.settings = _settings
