"""An approximate radix tree of what the router sent to each worker (cache-aware routing).

The router never sees a worker's real radix cache; it remembers the prompts it routed there,
which is a good guess of what that cache holds (SGLang's router keeps the same "approximate
tree"). One tree, many tenants: each node carries the workers (tenants) that were sent a
prompt running through it, with the time each last did, so that

- `match(key)` finds the longest routed prefix of `key` and the workers that hold it;
- `evict(tenant, max_size)` drops a tenant's least recently used leaves until it holds at most
  `max_size` characters (a worker's cache is finite too);
- `remove_tenant(tenant)` forgets a worker that left.

Keys are strings: prompt text, or token ids mapped one id per character (`ids_key`).
State contract: `size[t]` == the total edge length of the nodes that list `t`; a node that
lists `t` has a parent that lists `t` (checked by `check()`).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Hashable, Sequence

_IDS_PREFIX = "\x00ids:"  # token-id keys never share a prefix with text keys


def ids_key(ids: Sequence[int]) -> str:
    """A tree key for a token-id prompt: one character per id (ids < 0x110000)."""
    return _IDS_PREFIX + "".join(chr(i) for i in ids if 0 <= i < 0x110000)


class _Node:
    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: str = "", parent: _Node | None = None):
        self.key = key
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.tenants: dict[Hashable, float] = {}  # tenant -> last access


class ApproxTree:
    def __init__(self) -> None:
        self.root = _Node()
        self.size: dict[Hashable, int] = {}
        self._clock = itertools.count()  # ties in time.monotonic() still order accesses

    def _now(self) -> float:
        return time.monotonic() + next(self._clock) * 1e-9

    # ------------------------------------------------------------------ routing
    def insert(self, key: str, tenant: Hashable) -> None:
        now = self._now()
        self.size.setdefault(tenant, 0)
        node, i = self.root, 0
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                child = _Node(key[i:], node)
                node.children[key[i]] = child
            else:
                common = _common_len(child.key, key, i)
                if common < len(child.key):
                    child = self._split(child, common)
            if tenant not in child.tenants:
                self.size[tenant] += len(child.key)
            child.tenants[tenant] = now
            node, i = child, i + len(child.key)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge after `at` characters; returns the new upper node."""
        parent = child.parent
        upper = _Node(child.key[:at], parent)
        upper.tenants = dict(child.tenants)  # every tenant of the lower half holds the upper
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def match(self, key: str) -> tuple[int, list[Hashable]]:
        """(characters of `key` matched, the tenants holding that whole prefix). Tenants
        along the path are refreshed (the worker's cache would refresh them too)."""
        node, i, holders = self.root, 0, []
        now = self._now()
        while i < len(key):
            child = node.children.get(key[i])
            if child is None or not child.tenants:
                break
            common = _common_len(child.key, key, i)
            i += common
            holders = list(child.tenants)
            for t in holders:
                child.tenants[t] = now
            if common < len(child.key):
                break
            node = child
        return i, holders

    def smallest_tenant(self, tenants: Sequence[Hashable]) -> Hashable:
        return min(tenants, key=lambda t: self.size.get(t, 0))

    # ------------------------------------------------------------------ forgetting
    def evict(self, tenant: Hashable, max_size: int) -> int:
        """Drop `tenant`'s least recently used leaves until it holds <= max_size chars."""
        if self.size.get(tenant, 0) <= max_size:
            return 0
        heap = [(n.tenants[tenant], id(n), n) for n in self._leaves(tenant)]
        heapq.heapify(heap)
        dropped = 0
        while heap and self.size[tenant] > max_size:
            _, _, node = heapq.heappop(heap)
            dropped += self._drop(node, tenant)
            parent = node.parent
            if (
                parent is not self.root
                and tenant in parent.tenants
                and not any(tenant in c.tenants for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return dropped

    def remove_tenant(self, tenant: Hashable) -> None:
        for node in reversed(list(self._nodes())):  # children before their parents
            if tenant in node.tenants:
                self._drop(node, tenant)
        self.size.pop(tenant, None)

    def _drop(self, node: _Node, tenant: Hashable) -> int:
        del node.tenants[tenant]
        self.size[tenant] -= len(node.key)
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.key[0]]
        return len(node.key)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self, tenant: Hashable) -> list[_Node]:
        return [
            n
            for n in self._nodes()
            if tenant in n.tenants and not any(tenant in c.tenants for c in n.children.values())
        ]

    def check(self) -> None:
        """Integrity: sizes add up and every tenant's nodes form a rooted subtree."""
        sizes: dict[Hashable, int] = {}
        for node in self._nodes():
            assert node.key and node.parent.children[node.key[0]] is node
            for t in node.tenants:
                sizes[t] = sizes.get(t, 0) + len(node.key)
                assert node.parent is self.root or t in node.parent.tenants, t
        for t, n in self.size.items():
            assert sizes.get(t, 0) == n, (t, sizes.get(t, 0), n)


def _common_len(edge: str, key: str, start: int) -> int:
    n = min(len(edge), len(key) - start)
    i = 0
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i
