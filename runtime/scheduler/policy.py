"""Orders the waiting queue before the prefill adder takes from its front."""

from __future__ import annotations

import random
from collections import defaultdict

from loom.runtime.req import Req

# Prefix matching every waiting request each step costs O(queue); past this length lpm and
# dfs-weight fall back to first-come-first-served, as SGLang does.
_MAX_QUEUE_FOR_CACHE_AWARE = 128


def order_waiting(queue: list[Req], policy: str, kv, rng: random.Random) -> list[Req]:
    """`kv` answers `match_len(req) -> (cached tokens, radix node)` (the KV manager)."""
    if policy in ("lpm", "dfs-weight") and (
        kv.tree_cache.disable or len(queue) > _MAX_QUEUE_FOR_CACHE_AWARE
    ):
        policy = "fcfs"
    if policy == "fcfs" or len(queue) < 2:
        return queue
    if policy == "lof":
        return sorted(queue, key=lambda r: -r.sampling_params.max_new_tokens)
    if policy == "random":
        shuffled = list(queue)
        rng.shuffle(shuffled)
        return shuffled
    matches = {id(r): kv.match_len(r) for r in queue}
    if policy == "lpm":
        return sorted(queue, key=lambda r: -matches[id(r)][0])
    return _dfs_weight(queue, matches)


def _dfs_weight(queue: list[Req], matches: dict) -> list[Req]:
    """Visit the radix tree depth first, heaviest subtree (most waiting requests) first, so
    requests that share a prefix run back to back while it is cached."""
    by_node: dict[int, list[Req]] = defaultdict(list)
    nodes: dict[int, object] = {}
    weight: dict[int, int] = defaultdict(int)
    children: dict[int, list[object]] = defaultdict(list)
    root = None
    for req in queue:
        node = matches[id(req)][1]
        by_node[id(node)].append(req)
        while node is not None:
            weight[id(node)] += 1
            parent = getattr(node, "parent", None)
            if id(node) not in nodes:
                nodes[id(node)] = node
                if parent is not None:
                    children[id(parent)].append(node)
            if parent is None:
                root = node
            node = parent
    out: list[Req] = []

    def visit(node) -> None:
        out.extend(by_node.get(id(node), ()))
        for child in sorted(children.get(id(node), ()), key=lambda c: -weight[id(c)]):
            visit(child)

    if root is not None:
        visit(root)
    seen = {id(r) for r in out}
    return out + [r for r in queue if id(r) not in seen]
