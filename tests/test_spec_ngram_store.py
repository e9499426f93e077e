"""The n-gram trie's node store: ids in int containers the cyclic collector does not track,
evicted ids reused, and a request's pointers to evicted nodes turned into holes."""

from __future__ import annotations

import gc
import random

from loom.runtime.spec.ngram import NgramDrafter, NgramState, NgramTrie


class _Req:
    def __init__(self, prompt, output=()):
        self.origin_input_ids = list(prompt)
        self.output_ids = list(output)

    @property
    def seq_len(self):
        return len(self.origin_input_ids) + len(self.output_ids)

    def tokens(self, start, end):
        return (self.origin_input_ids + self.output_ids)[start:end]


def _fill(trie, n, rng, lo=0, hi=4096):
    pointers = []
    for _ in range(n):
        pointers = trie.extend(pointers, rng.randrange(lo, hi))
    return pointers


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_growing_the_trie_adds_no_tracked_objects_per_node():
    """20,000+ nodes (a `_Node` with its dict each used to be two tracked objects: ~46,000
    here) add at most a few dozen objects to the collector's lists, created or evicted (the
    bound leaves room for whatever another thread of the test process allocates meanwhile)."""
    rng = random.Random(0)
    before = _tracked()
    trie = NgramTrie(depth=8, capacity=30_000)
    pointers = _fill(trie, 3_000, rng)
    assert len(trie) > 20_000
    grown = _tracked()
    assert grown - before < 256
    pointers = _fill(trie, 3_000, rng)  # at capacity: evictions and reused ids
    assert len(trie) == 30_000 and trie.evicted_at > 0
    assert _tracked() - grown < 256
    del pointers
    trie.check()


def test_evicted_ids_are_reused_and_the_store_stays_consistent():
    """Once full, a new node takes an evicted node's id: the store stops growing."""
    rng = random.Random(1)
    trie = NgramTrie(depth=5, capacity=10_000)
    _fill(trie, 3_000, rng, 0, 300)
    assert len(trie) == 10_000
    ids = len(trie.kids)
    for _ in range(5):
        _fill(trie, 1_000, rng, 0, 300)
        assert len(trie) == 10_000 and len(trie.kids) == ids
        trie.check()


def test_pointers_end_before_a_node_evicted_since_they_were_made():
    """A request's suffix pointers, held while other requests' inserts evict their nodes and
    reuse the ids, end before the first evicted one when it extends again: its next token
    goes under no node that now holds an old id (nothing but the root gets token 4 below),
    and it matches again as its suffixes regrow."""
    d = NgramDrafter(1, 3, 2, capacity=200)
    trie = d.trie
    req = _Req([1, 2, 3])
    state = NgramState(4)
    d.observe(req, state)
    held = list(state.pointers)
    rng = random.Random(2)
    _fill(trie, 400, rng, 100, 1000)  # evicts all of req's nodes, reuses their ids
    assert all(trie.kids[p] is not None and trie.died[p] > state.at for p in held)
    assert trie.fresh(state.pointers, state.at) == []
    req.output_ids.append(4)
    d.observe(req, state)
    assert state.pointers == [trie.walk(trie.root, [4])]
    assert sum(1 for k in trie.kids if k and 4 in k) == 1  # only the root's child
    trie.check()
    # the suffixes regrow, and the request drafts from its own history
    req.output_ids += [5, 6, 4, 5]
    assert d.propose(req, state, 2) == [6, 4]
    assert len(state.pointers) == trie.depth - 1
