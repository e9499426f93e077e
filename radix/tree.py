"""RadixAttention's prefix tree: token-id sequences -> KV slot indices.

The tree knows nothing of requests, pools or devices: a value is a 1-D numpy int64 array of KV
slot indices, one per token of the node's key, and the only way slots leave the tree is
`evict`, which hands them to `on_free`. That keeps it testable with simulated slot numbers.

State contract:
- Every non-root node has a non-empty key whose length is a multiple of `page_size`, and a
  value of the same length. Each `page_size` run of a value is one whole KV page (the allocator
  frees by page). No slot appears in two nodes.
- A node's children are keyed by `(extra_key, first page of the child's key)`; the first page
  is a token id for `page_size == 1`, a tuple of `page_size` ids otherwise. Nodes under
  different `extra_key`s (LoRA id, cache salt) never share a node, hence never share KV.
- `lock_ref` counts the locks whose path root..node passes through the node: locking a node
  locks its whole path, so a parent's `lock_ref` is at least the sum of its children's. Nodes
  with `lock_ref > 0` are protected and never evicted; the rest are evictable.
- `evictable_size() + protected_size() == total_size()` == the sum of node key lengths.
- Splitting a node (on a partial match or insert) moves nothing between evictable and
  protected: the new upper half inherits the lower half's `lock_ref` and access time.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ChildKey = tuple[Any, Any]  # (extra_key, first token id | first page tuple)


def _as_list(key) -> list[int]:
    """A key as a list of ints (a list, a numpy array or a tensor of token ids)."""
    if hasattr(key, "tolist"):
        return key.tolist()
    return list(key)


def as_slots(value) -> np.ndarray:
    """A 1-D int64 numpy copy of slots (a numpy array, a list, or a tensor on any device)."""
    if hasattr(value, "cpu"):  # a tensor: through its own numpy view
        value = value.cpu().numpy()
    return np.array(value, dtype=np.int64).reshape(-1)


def empty_indices() -> np.ndarray:
    return np.empty(0, dtype=np.int64)


class TreeNode:
    """One edge of the radix tree: a run of tokens, their slots, and its lock/LRU state."""

    _ids = itertools.count()

    __slots__ = ("id", "children", "parent", "key", "value", "extra_key", "lock_ref", "last_access")

    def __init__(
        self,
        key: list[int],
        value: np.ndarray,
        parent: TreeNode | None,
        extra_key: str | None,
        last_access: int,
    ) -> None:
        self.id = next(TreeNode._ids)
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.extra_key = extra_key
        self.lock_ref = 0
        self.last_access = last_access

    def __len__(self) -> int:
        return len(self.key)

    def __lt__(self, other: TreeNode) -> bool:  # heap tie-break: LRU first, then oldest node
        return (self.last_access, self.id) < (other.last_access, other.id)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass(frozen=True)
class MatchResult:
    """A prefix match: the matched slots (a fresh tensor) and the node the match ends at.

    `last_node` is the root when nothing matched (None from a ChunkCache). Unpacks as
    `indices, last_node = result`.
    """

    indices: np.ndarray
    last_node: TreeNode | None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.indices, self.last_node))


class RadixTree:
    """Radix tree over token ids whose values are KV slot indices (see the module docstring)."""

    def __init__(
        self,
        page_size: int = 1,
        on_free: Callable[[np.ndarray], None] | None = None,
        on_evict: Callable[[TreeNode], None] | None = None,
    ) -> None:
        assert page_size >= 1, page_size
        self.page_size = page_size
        self.on_free = on_free
        # called with each node about to be evicted, its ancestors still attached (the
        # hierarchical cache copies the node's KV to a lower tier before the slots are freed)
        self.on_evict = on_evict
        self.reset()

    # ---- state ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Drop every node WITHOUT calling on_free (RadixCache.reset evicts first)."""
        self._clock = 0
        self.root = TreeNode([], empty_indices(), None, None, 0)
        self.root.lock_ref = 1  # the root is never evicted nor counted
        self._evictable = 0
        self._protected = 0

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, extra_key: str | None, key: list[int], pos: int) -> ChildKey:
        if self.page_size == 1:
            return (extra_key, key[pos])
        return (extra_key, tuple(key[pos : pos + self.page_size]))

    def _match_len(self, node_key: list[int], key: list[int], pos: int) -> int:
        """Common prefix length of node_key and key[pos:], rounded down to whole pages."""
        n = min(len(node_key), len(key) - pos)
        if node_key[:n] == key[pos : pos + n]:  # the common case, compared in C
            return n - n % self.page_size
        i = 0
        while i < n and node_key[i] == key[pos + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut node's key at `at`; return the new upper node (node keeps the tail)."""
        assert 0 < at < len(node.key) and at % self.page_size == 0, (at, len(node.key))
        parent = node.parent
        assert parent is not None
        upper = TreeNode(node.key[:at], node.value[:at], parent, node.extra_key, node.last_access)
        upper.lock_ref = node.lock_ref
        parent.children[self._child_key(node.extra_key, node.key, 0)] = upper
        node.key = node.key[at:]
        node.value = node.value[at:]
        node.parent = upper
        upper.children[self._child_key(node.extra_key, node.key, 0)] = node
        return upper

    # ---- match / insert -------------------------------------------------------------------

    def match_prefix(
        self, key: Sequence[int] | np.ndarray, extra_key: str | None = None
    ) -> MatchResult:
        """Longest cached (page-aligned) prefix of `key` under `extra_key`.

        Splits a node the match ends inside, so `last_node` covers exactly the match. Touches
        the LRU time of every node on the path. The returned array is a copy.
        """
        key = _as_list(key)
        key = key[: len(key) - len(key) % self.page_size]
        now = self._tick()
        node, pos, values = self.root, 0, []
        while pos < len(key):
            child = node.children.get(self._child_key(extra_key, key, pos))
            if child is None:
                break
            n = self._match_len(child.key, key, pos)
            split = n < len(child.key)
            if split:
                child = self._split(child, n)  # the unmatched tail keeps its old LRU time
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
            if split:  # key diverges inside the old node: nothing further can match
                break
        indices = np.concatenate(values) if values else empty_indices()
        return MatchResult(indices, node)

    def insert(
        self,
        key: Sequence[int] | np.ndarray,
        value: np.ndarray,
        extra_key: str | None = None,
    ) -> int:
        """Cache `key -> value`; return how many leading tokens were already cached.

        The tree keeps the slots it did not have (a copy of that part of `value`); the caller
        still owns `value[:returned]` and must free those duplicates itself. `key` must be
        page-aligned (the caller trims the unaligned tail, which stays its own).
        """
        key = _as_list(key)
        assert len(key) == len(value), (len(key), len(value))
        assert len(key) % self.page_size == 0, f"unaligned insert: {len(key)} % {self.page_size}"
        now = self._tick()
        node, pos = self.root, 0
        while pos < len(key):
            ck = self._child_key(extra_key, key, pos)
            child = node.children.get(ck)
            if child is None:
                leaf = TreeNode(
                    key[pos:],
                    as_slots(value[pos:]),
                    node,
                    extra_key,
                    now,
                )
                node.children[ck] = leaf
                self._evictable += len(leaf.key)
                return pos
            n = self._match_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            node, pos = child, pos + n
        return pos

    # ---- locks / eviction -----------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root..node; return the growth of protected_size()."""
        delta = 0
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
                delta += len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock the path root..node; return the change of protected_size() (<= 0)."""
        delta = 0
        while node is not self.root:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked {node!r}"
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                delta -= len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until `num_tokens` are freed.

        A parent left as an unlocked leaf becomes a candidate too. Returns tokens freed (less
        than asked only when nothing evictable remains).
        """
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and not node.children
            if self.on_evict is not None:
                self.on_evict(node)
            del parent.children[self._child_key(node.extra_key, node.key, 0)]
            self._evictable -= len(node.key)
            freed += len(node.key)
            if self.on_free is not None:
                self.on_free(node.value)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    # ---- inspection -----------------------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_values(self) -> np.ndarray:
        """Every slot the tree owns, concatenated (order unspecified)."""
        values = [n.value for n in self._nodes()]
        return np.concatenate(values) if values else empty_indices()

    def pretty_print(self) -> str:
        lines: list[str] = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                tag = f" [{child.extra_key}]" if child.extra_key is not None else ""
                lines.append(
                    f"{'  ' * depth}{child.key[:8]}{'...' if len(child.key) > 8 else ''}"
                    f" len={len(child.key)} lock={child.lock_ref}{tag}"
                )
                walk(child, depth + 1)

        walk(self.root, 0)
        lines.append(f"evictable={self._evictable} protected={self._protected}")
        return "\n".join(lines)

    def check_integrity(self) -> None:
        """Recompute every invariant of the module docstring from scratch; AssertionError if not."""
        ps = self.page_size
        assert self.root.lock_ref == 1 and not self.root.key, "root must be locked and empty"
        evictable = protected = 0
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            node = stack.pop()
            child_locks = 0
            for ck, child in node.children.items():
                where = f"{child!r} under {node!r}"
                assert child.parent is node, f"{where}: parent pointer is wrong"
                assert child.key, f"{where}: empty key"
                assert len(child.key) % ps == 0, f"{where}: key length not a multiple of {ps}"
                assert ck == self._child_key(child.extra_key, child.key, 0), (
                    f"{where}: child key {ck} does not match its first page"
                )
                if node is not self.root:
                    assert child.extra_key == node.extra_key, f"{where}: extra_key differs"
                v = child.value
                assert isinstance(v, np.ndarray) and v.dtype == np.int64 and v.ndim == 1, (
                    f"{where}: value must be a 1-D numpy int64 array"
                )
                assert len(v) == len(child.key), f"{where}: {len(v)} slots for {len(child.key)}"
                if ps > 1:
                    pages = v.reshape(-1, ps)
                    assert bool((pages[:, 0] % ps == 0).all()) and bool(
                        (pages - pages[:, :1] == np.arange(ps)).all()
                    ), f"{where}: a page-sized run of slots is not one whole KV page"
                slots = v.tolist()
                dup = seen.intersection(slots)
                assert not dup and len(set(slots)) == len(slots), f"{where}: duplicate slots"
                seen.update(slots)
                assert child.lock_ref >= 0, f"{where}: negative lock_ref"
                if child.lock_ref > 0:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
                child_locks += child.lock_ref
                stack.append(child)
            if node is not self.root:
                assert node.lock_ref >= child_locks, (
                    f"{node!r}: lock_ref {node.lock_ref} < children's {child_locks}"
                )
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected {self._protected} != {protected}"
