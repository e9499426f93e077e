"""The n-gram drafter's read-only datastore (`ngram_corpus.CorpusIndex`): the longest known
window's most frequent continuation, against a brute-force count, and its place after the
request's own tokens and the trie (`NgramLookup.propose`)."""

from __future__ import annotations

import random
from collections import Counter

from loom.runtime.req import Req
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.spec.ngram import NgramLookup, NgramState
from loom.runtime.spec.ngram_corpus import CorpusIndex


def _brute_next(docs: list[list[int]], ctx: list[int], window: int, min_window: int):
    """(token, count, total) after the longest suffix of ctx (<= window) seen in a document."""
    for w in range(min(window, len(ctx)), min_window - 1, -1):
        suffix = ctx[len(ctx) - w :]
        c = Counter(d[i + w] for d in docs for i in range(len(d) - w) if d[i : i + w] == suffix)
        if c:
            best = max(c.items(), key=lambda kv: (kv[1], -kv[0]))
            return best[0], best[1], sum(c.values())
    return None


def test_corpus_draft_matches_a_brute_force_back_off_walk():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice((3, 6, 15))
        docs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 30))] for _ in range(4)]
        window, min_window = rng.choice((1, 3, 8)), rng.choice((1, 2))
        index = CorpusIndex(docs, window)
        for _ in range(10):
            ctx = [rng.randrange(vocab + 2) for _ in range(rng.randrange(1, 10))]
            want, walk = [], list(ctx)
            for _ in range(6):
                e = _brute_next(docs, walk[-window:], window, min_window)
                if e is None:
                    break
                want.append(e[0])
                walk.append(e[0])
            assert index.propose(ctx, 6, min_window) == want, (trial, ctx)


def test_windows_never_cross_a_document_end_and_share_cuts_the_walk():
    index = CorpusIndex([[1, 2, 3], [4, 5]], 4)
    assert index.propose([3], 3) == []  # 3 ends its document: 4 does not follow it
    assert index.propose([2], 3) == [3]
    split = CorpusIndex([[1, 2], [1, 2], [1, 3]], 4)
    assert split.propose([1], 2) == [2]  # 2 of 3 continuations
    assert split.propose([1], 2, min_share=0.7) == []
    assert split.propose([1], 2, min_share=0.6) == [2]


def _req(prompt: list[int], output: list[int] = ()) -> Req:
    req = Req("r", list(prompt), make_sampling_params({}), seed=0)
    req.output_ids.extend(output)
    return req


def test_the_corpus_drafts_only_where_own_tokens_and_the_trie_have_none():
    lookup = NgramLookup(1, 4, 6, 10_000)
    lookup.corpus = CorpusIndex([[70, 71, 72, 73, 74]])
    # a request whose last token (70) neither it nor the trie has seen before
    req = _req([1, 2, 3], [4, 70])
    assert lookup.propose(req, NgramState(6), 3, own=True) == [71, 72, 73]
    # the trie knows 70 (another request's "70 80"): the trie's chain, not the corpus's
    other = _req([9, 70, 80, 81])
    lookup.propose(other, NgramState(6), 0)
    req2 = _req([1, 2, 3], [5, 70])
    assert lookup.propose(req2, NgramState(6), 2, own=True) == [80, 81]
    # the request's own "70 90" comes first of all
    req3 = _req([70, 90, 91], [70])
    assert lookup.propose(req3, NgramState(6), 2, own=True) == [90, 91]
    # before-trie: the corpus ahead of the trie, after the request's own tokens
    lookup.corpus_order = "before-trie"
    assert lookup.propose(_req([1, 2, 3], [6, 70]), NgramState(6), 2, own=True) == [71, 72]
    assert lookup.propose(_req([70, 90, 91], [70]), NgramState(6), 2, own=True) == [90, 91]
