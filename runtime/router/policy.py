"""Routing policies: which worker gets a request (SGLang's router ladder).

- round_robin: the next worker in turn.
- shortest_queue: the worker with the fewest requests in flight through this router.
- cache_aware: the worker that was sent the longest prefix of this prompt before (an
  approximate radix tree, tree.py), so its radix cache probably holds it; when no worker holds
  more than `cache_threshold` of the prompt, the worker whose tree is smallest (most room).
  Load balance overrides both when the loads drift apart: if max - min load exceeds
  `balance_abs_threshold` AND max exceeds `balance_rel_threshold` x min, the least loaded
  worker gets it (the tree still learns the prompt went there).

A policy sees the healthy workers (objects with `.url` and `.in_flight`) and the request's key
(prompt text or `ids_key(input_ids)`; None when the body has no prompt) and returns one.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence

from loom.runtime.router.tree import ApproxTree
from loom.runtime.server_args_choices import LOAD_BALANCE_METHODS as POLICIES


class Policy(ABC):
    name: str

    @abstractmethod
    def select(self, workers: Sequence, key: str | None):
        """One of `workers` (never empty)."""

    def remove_worker(self, url: str) -> None:  # noqa: B027 (stateless policies keep nothing)
        """Forget what was routed to `url` (it left)."""


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def select(self, workers, key):
        return workers[next(self._turn) % len(workers)]


def least_loaded(workers):
    return min(workers, key=lambda w: w.in_flight)


class ShortestQueue(Policy):
    name = "shortest_queue"

    def select(self, workers, key):
        return least_loaded(workers)


class CacheAware(Policy):
    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.0001,
        max_tree_size: int = 2**24,
    ):
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.max_tree_size = max_tree_size
        self.tree = ApproxTree()
        # what the router decided, for /metrics and the benchmark
        self.decisions = {"prefix_match": 0, "smallest_tree": 0, "balance": 0, "no_key": 0}

    def imbalanced(self, workers) -> bool:
        loads = [w.in_flight for w in workers]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def select(self, workers, key):
        if not key:
            self.decisions["no_key"] += 1
            return least_loaded(workers)
        by_url = {w.url: w for w in workers}
        if self.imbalanced(workers):
            self.decisions["balance"] += 1
            chosen = least_loaded(workers)
        else:
            matched, holders = self.tree.match(key)
            holders = [by_url[u] for u in holders if u in by_url]
            if holders and matched / len(key) > self.cache_threshold:
                self.decisions["prefix_match"] += 1
                chosen = least_loaded(holders)
            else:
                self.decisions["smallest_tree"] += 1
                chosen = by_url[self.tree.smallest_tenant(list(by_url))]
        self.tree.insert(key, chosen.url)
        if self.tree.size[chosen.url] > self.max_tree_size:  # evict in steps, not per insert
            self.tree.evict(chosen.url, int(self.max_tree_size * 0.9))
        return chosen

    def remove_worker(self, url: str) -> None:
        self.tree.remove_tenant(url)


def make_policy(name: str, **cache_aware_knobs) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    if name == "cache_aware":
        return CacheAware(**cache_aware_knobs)
    raise ValueError(f"policy: must be one of {POLICIES}, got {name!r}")
