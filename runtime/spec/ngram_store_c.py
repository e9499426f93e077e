"""The n-gram trie's node store in C (kernels/cpu/ngram_store.c): `ngram_store.PyNgramTrie`'s
ids, fields and eviction, with no Python object per node.

The Python store keeps a dict (token -> child id) per node and its fields in lists: a token
inserts up to depth (~19-30) nodes, each a dict lookup, often a new dict and PyLongs, ~15 us
a token, most of it in making and filling those objects (updating them from C through the
C API saved a third). Here the fields are int64 arrays in one anonymous mmap (pages
materialize as ids are first used: ids are handed out ascending), a node's children are a
doubly linked sibling list in insertion order (a dict's order: a deleted key re-inserted goes
last), and one open-addressing table maps (parent, token) -> child. A table slot holds only
the child id (0: empty, the root is nobody's child); its key is the child's own parent and
token fields, so a node's entry is deleted before its parent field changes.

Same semantics, field for field, as the Python store (tests/test_spec_ngram_store.py runs
random streams through both and compares every field, child order and pointer): the same
ids (a free stack, grown _GROW ids at a time, ascending ids popped first), the same CLOCK
queue and SECOND_CHANCES, the same `fresh` after an eviction. `extend` takes many tokens in
one call (`NgramLookup.observe` inserts a request's new tokens at once). The readers'
loops over a node's children (the most recent / frequent child, the skip-gram's sibling
scan) are C calls too; the fields a reader indexes (`token`, `count`, `stamp`, `ostamp`,
`parent`, `died`) are memoryviews over the arrays.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from array import array
from collections.abc import Iterator, Sequence

from loom.runtime import native
from loom.runtime.spec.ngram_store import (
    _GROW,
    CUT,
    ROOT,
    SECOND_CHANCES,
    PyNgramTrie,
    check_store,
    fresh_pointers,
    store_queue,
)

# header slots (int64) at the start of the mapping, then the fields, max_ids entries each
_H = ("depth", "capacity", "max_ids", "n_ids", "size", "tail", "clock", "evicted_at",
      "nfree", "table", "mask")  # fmt: skip
_HEADER = 16
_N_IDS, _SIZE, _TAIL, _CLOCK, _EVICTED_AT, _NFREE = (
    _H.index(name) for name in ("n_ids", "size", "tail", "clock", "evicted_at", "nfree")
)
# a node's record (C's Node): 16 int64 fields; then the free stack, max_ids entries
_FIELDS = ("parent", "token", "count", "stamp", "ostamp", "queued", "nxt", "died",
           "first", "last", "next", "prev", "nkids", "live")  # fmt: skip
_RECORD = 16


@functools.cache
def load() -> ctypes.CDLL | None:
    """loom's C library (kernels/cpu/ngram_store.c: built on first use), its Node record,
    header slots and constants checked against this module's; None without a C compiler."""
    lib = native.load()
    if lib is not None:
        native.check_words(lib, "Node", _FIELDS, _RECORD)
        native.check_constants(
            lib,
            {
                **{f"NGT_{name.upper()}": i for i, name in enumerate(_H)},
                "NGT_HEADER": _HEADER,
                "NGT_ROOT": ROOT,
                "NGT_CUT": CUT,
                "NGT_GROW": _GROW,
                "NGT_SECOND_CHANCES": SECOND_CHANCES,
            },
        )
    return lib


class CNgramTrie:
    """`PyNgramTrie`'s interface and semantics over the C store (`load()` must not be None)."""

    def __init__(self, depth: int, capacity: int):
        self._lib = lib = load()
        self.depth = depth
        self.capacity = capacity
        self.root = ROOT
        # every id a trie can hold: the root, `capacity` nodes, the `depth` one extend adds
        # before it evicts, rounded up to the next _GROW
        max_ids = 1 + capacity + depth + _GROW
        if capacity >= 1 << 31:
            raise ValueError("capacity: at most 2^31 - 1 nodes (a table key holds an id)")
        self._map = mmap.mmap(-1, 8 * (_HEADER + (_RECORD + 1) * max_ids))
        words = memoryview(self._map).cast("q")
        self._h = words[:_HEADER]
        self._h[_H.index("depth")], self._h[_H.index("capacity")] = depth, capacity
        self._h[_H.index("max_ids")] = max_ids
        nodes = _HEADER + _RECORD * max_ids
        for i, name in enumerate(_FIELDS):  # strided views: field i of every record
            setattr(self, name, words[_HEADER + i : nodes : _RECORD])
        self.free = words[nodes : nodes + max_ids]
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if lib.ngt_init(self._addr) != 0:
            raise MemoryError("the n-gram store's table")
        self._buf = array("q", bytes(16 * (depth + 1)))
        self._buf_addr = self._buf.buffer_info()[0]
        stamp, ostamp, count = self.stamp, self.ostamp, self.count
        self.recency = lambda c: (ostamp[c], stamp[c])
        self.frequency = lambda c: (count[c], stamp[c])

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is not None and hasattr(self, "_addr"):
            lib.ngt_free(self._addr)

    def __len__(self) -> int:
        return self._h[_SIZE]

    size = property(lambda self: self._h[_SIZE], doc="nodes in the queue (all but the root)")
    clock = property(lambda self: self._h[_CLOCK])
    evicted_at = property(lambda self: self._h[_EVICTED_AT])
    tail = property(lambda self: self._h[_TAIL])
    n_ids = property(lambda self: self._h[_N_IDS], doc="ids made so far (root, queued and free)")

    def free_ids(self) -> list[int]:
        return self.free[: self._h[_NFREE]].tolist()

    def alive(self, node: int) -> bool:
        return self.live[node] != 0

    def extend(self, pointers: list[int], token: int, generated: bool = False) -> list[int]:
        return self.extend_many(pointers, (token,), 0 if generated else 1)

    def extend_many(
        self, pointers: list[int], tokens: Sequence[int], generated_from: int
    ) -> list[int]:
        """`extend` for each of `tokens` in turn, tokens[i] generated when i >=
        generated_from; returns the last pointers."""
        if len(pointers) >= self.depth:
            raise ValueError("more pointers than the trie's depth")
        ptrs, toks = array("q", pointers), array("q", tokens)
        n = self._lib.ngt_extend(
            self._addr,
            ptrs.buffer_info()[0],
            len(ptrs),
            toks.buffer_info()[0],
            len(toks),
            generated_from,
            self._buf_addr,
        )
        if n == -2:
            raise ValueError("a token out of [0, 2^32)")
        if n < 0:
            raise MemoryError("the n-gram store ran out of ids")
        return self._buf[:n].tolist()

    def fresh(self, pointers: list[int], at: int) -> list[int]:
        return fresh_pointers(self, pointers, at)

    def walk(self, node: int, tokens: Sequence[int]) -> int | None:
        if not tokens:
            return node
        toks = array("q", tokens)
        node = self._lib.ngt_walk(self._addr, node, toks.buffer_info()[0], len(toks))
        return None if node < 0 else node

    def child(self, node: int, token: int) -> int | None:
        return self._lib.ngt_child(self._addr, node, token) or None

    def has_kids(self, node: int) -> bool:
        return self.nkids[node] > 0

    def match(
        self,
        pointers: list[int],
        after: Sequence[int],
        windows: tuple[int, int],
        skip: bool,
        skip_min_context: int,
        skip_scan: int,
    ) -> int | None:
        """`NgramLookup._match`'s search in one call (see there); None: no match."""
        ptrs, toks = array("q", pointers), array("q", after)
        node = self._lib.ngt_match(
            self._addr,
            ptrs.buffer_info()[0],
            len(ptrs),
            toks.buffer_info()[0],
            len(toks),
            windows[0],
            windows[1],
            skip,
            skip_min_context,
            skip_scan,
        )
        return node or None

    def deepest(self, tokens: Sequence[int], min_window: int) -> int | None:
        """The node of the longest suffix of `tokens` (at least min_window long) that the
        trie holds with a continuation (None: none)."""
        toks = array("q", tokens)
        return (
            self._lib.ngt_deepest(self._addr, toks.buffer_info()[0], len(toks), min_window) or None
        )

    def children(self, node: int) -> list[int]:
        out = array("q", bytes(8 * self.nkids[node]))
        n = self._lib.ngt_children(self._addr, node, out.buffer_info()[0])
        return out[:n].tolist()

    def best_child(self, node: int, by_count: bool = False) -> int | None:
        return self._lib.ngt_best(self._addr, node, by_count) or None

    def recent_child(
        self, parent: int, other_than: int = -1, generated: bool = False, scan: int = 1 << 62
    ) -> int | None:
        return self._lib.ngt_recent(self._addr, parent, other_than, generated, scan) or None

    def queue(self) -> Iterator[int]:
        return store_queue(self)

    def check(self) -> None:
        assert self._lib.ngt_check(self._addr) == 0, self._lib.ngt_check(self._addr)
        check_store(self)


def new_ngram_store(depth: int, capacity: int) -> CNgramTrie | PyNgramTrie:
    """A trie's node store: the C one (`CNgramTrie`: same ids, fields and eviction as the
    Python store, no Python object per node) where the C library builds, else `PyNgramTrie`."""
    if load() is not None:
        return CNgramTrie(depth, capacity)
    return PyNgramTrie(depth, capacity)


__all__ = ["CNgramTrie", "CUT", "load", "new_ngram_store"]
