"""The n-gram trie's node stores (Python objects; C arrays): ids in containers the cyclic
collector does not track, evicted ids reused, a request's pointers to evicted nodes turned
into holes, and the C store's every field, child order and pointer equal to the Python
store's on random streams."""

from __future__ import annotations

import gc
import random

import pytest

from loom.runtime.spec import ngram_store_c
from loom.runtime.spec.ngram import NgramLookup, NgramState
from loom.runtime.spec.ngram_store import PyNgramTrie

needs_c = pytest.mark.skipif(ngram_store_c.load() is None, reason="no C compiler")
STORES = [PyNgramTrie, pytest.param(ngram_store_c.CNgramTrie, marks=needs_c)]


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


@pytest.mark.parametrize("store", STORES)
def test_growing_the_trie_adds_no_tracked_objects_per_node(store):
    """20,000+ nodes (a `_Node` with its dict each used to be two tracked objects: ~46,000
    here) add at most a few dozen objects to the collector's lists, created or evicted (the
    bound leaves room for whatever another thread of the test process allocates meanwhile)."""
    rng = random.Random(0)
    before = _tracked()
    trie = store(depth=8, capacity=30_000)
    pointers = _fill(trie, 3_000, rng)
    assert len(trie) > 20_000
    grown = _tracked()
    assert grown - before < 256
    pointers = _fill(trie, 3_000, rng)  # at capacity: evictions and reused ids
    assert len(trie) == 30_000 and trie.evicted_at > 0
    assert _tracked() - grown < 256
    del pointers
    trie.check()


@pytest.mark.parametrize("store", STORES)
def test_evicted_ids_are_reused_and_the_store_stays_consistent(store):
    """Once full, a new node takes an evicted node's id: the store stops growing."""
    rng = random.Random(1)
    trie = store(depth=5, capacity=10_000)
    _fill(trie, 3_000, rng, 0, 300)
    assert len(trie) == 10_000
    ids = trie.n_ids
    for _ in range(5):
        _fill(trie, 1_000, rng, 0, 300)
        assert len(trie) == 10_000 and trie.n_ids == ids
        trie.check()


@pytest.mark.parametrize("store", STORES)
def test_pointers_end_before_a_node_evicted_since_they_were_made(store):
    """A request's suffix pointers, held while other requests' inserts evict their nodes and
    reuse the ids, end before the first evicted one when it extends again: its next token
    goes under no node that now holds an old id (nothing but the root gets token 4 below),
    and it matches again as its suffixes regrow."""
    d = NgramLookup(1, 3, 2, capacity=200)
    trie = d.trie = store(d.trie.depth, 200)
    req = _Req([1, 2, 3])
    state = NgramState(4)
    d.observe(req, state)
    held = list(state.pointers)
    rng = random.Random(2)
    _fill(trie, 400, rng, 100, 1000)  # evicts all of req's nodes, reuses their ids
    assert all(trie.alive(p) and trie.died[p] > state.at for p in held)
    assert trie.fresh(state.pointers, state.at) == []
    req.output_ids.append(4)
    d.observe(req, state)
    assert state.pointers == [trie.walk(trie.root, [4])]
    holders = [x for x in range(trie.n_ids) if trie.alive(x) and trie.child(x, 4) is not None]
    assert holders == [trie.root]
    trie.check()
    # the suffixes regrow, and the request drafts from its own history
    req.output_ids += [5, 6, 4, 5]
    assert d.propose(req, state, 2) == [6, 4]
    assert len(state.pointers) == trie.depth - 1


FIELDS = ("parent", "token", "count", "stamp", "ostamp", "queued", "nxt", "died")


def _same(py, c) -> None:
    """Every id's fields, liveness and children (in order), the free list and the queue."""
    assert (py.n_ids, py.size, py.tail, py.clock, py.evicted_at) == (
        c.n_ids,
        c.size,
        c.tail,
        c.clock,
        c.evicted_at,
    )
    assert py.free_ids() == c.free_ids() and list(py.queue()) == list(c.queue())
    for name in FIELDS:
        assert list(getattr(py, name)[: py.n_ids]) == list(getattr(c, name)[: c.n_ids]), name
    for x in range(py.n_ids):
        assert py.alive(x) == c.alive(x)
        if py.alive(x):
            assert py.children(x) == c.children(x)


@needs_c
@pytest.mark.parametrize("seed", range(12))
def test_the_c_store_matches_the_python_store(seed):
    """Random token streams (several requests' pointers held across each other's inserts,
    prompt and generated tokens, a vocabulary from 3 to 3,000, capacities that evict from
    the first tokens and one past the first _GROW ids): the same returned pointers, fresh
    pointers, walks, readers' answers and, every few hundred steps, every field."""
    rng = random.Random(seed)
    depth = (1, 2, 3, 5, 8, 19, 30)[seed % 7]
    capacity = (5, 12, 60, 300, 6_000)[seed % 5]
    vocab = (3, 10, 100, 3_000)[seed % 4]
    py, c = PyNgramTrie(depth, capacity), ngram_store_c.CNgramTrie(depth, capacity)
    streams, ats = [[] for _ in range(4)], [0] * 4
    for step in range(2_500):
        s = rng.randrange(4)
        pointers = py.fresh(streams[s], ats[s])
        assert c.fresh(streams[s], ats[s]) == pointers
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
        generated_from = rng.randrange(7)
        out = py.extend_many(pointers, tokens, generated_from)
        assert c.extend_many(pointers, tokens, generated_from) == out
        streams[s], ats[s] = out, py.clock
        t = rng.randrange(vocab)
        assert c.extend(out, t, True) == py.extend(out, t, True)
        for x in rng.sample(range(py.n_ids), min(6, py.n_ids)):
            if not py.alive(x):
                continue
            for by_count in (False, True):
                assert c.best_child(x, by_count) == py.best_child(x, by_count)
            other = rng.choice([-1, *py.children(x)])
            for generated in (False, True):
                scan = rng.choice((1, 2, 32))
                want = py.recent_child(x, other, generated, scan)
                assert c.recent_child(x, other, generated, scan) == want
            assert c.child(x, t) == py.child(x, t) and c.has_kids(x) == py.has_kids(x)
        walk = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
        assert c.walk(c.root, walk) == py.walk(py.root, walk)
        assert c.deepest(walk + out[:1], 1) == py.deepest(walk + out[:1], 1)
        j = rng.randrange(4)
        held = py.fresh(streams[j], ats[j])  # another request's suffix
        for after in ([], walk):
            for skip in (True, False):
                args = (held, after, (1, max(1, depth - 2)), skip, 2, rng.choice((1, 32)))
                assert c.match(*args) == py.match(*args)
        if step % 400 == 0:
            _same(py, c)
    _same(py, c)
    py.check()
    c.check()
    if seed == 4:  # 3 ** 8 windows of 8 tokens
        assert py.n_ids > 4097 and py.evicted_at > 0  # grown past the first _GROW ids, full
    if capacity <= 60 and vocab**depth > 2 * capacity:
        assert py.evicted_at > 0


@needs_c
@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_drafts_are_the_same_from_either_store(match_type):
    """A drafter over each store, the same requests (shared history, skip-grams, rematches,
    trees, evictions; most recent or most frequent child): the same drafts."""
    rng = random.Random(5)
    words = [[rng.randrange(50) for _ in range(rng.randrange(1, 5))] for _ in range(40)]
    drafters = []
    for store in (PyNgramTrie, ngram_store_c.CNgramTrie):
        d = NgramLookup(1, 4, 3, capacity=400, match_type=match_type)
        d.trie = store(d.trie.depth, 400)
        drafters.append(d)
    for _ in range(30):
        text = [t for _ in range(12) for t in rng.choice(words)]
        out = []
        for d in drafters:
            req, state = _Req(text[:20]), NgramState(4)
            drafts = []
            for t in text[20:]:
                drafts.append(d.propose(req, state, 4))
                drafts.append(d.propose_tree(req, state, 6, 3, (1, 3)))
                req.output_ids.append(t)
            d.observe(req, state)
            out.append(drafts)
        assert out[0] == out[1]
    for d in drafters:
        d.trie.check()
