"""The n-gram drafter's own-tokens-first chains (`ngram_own.OwnIndex`, `NgramLookup.propose`
with `own`): the longest earlier window of the request's own tokens, against a brute-force
search, and its place before the trie."""

from __future__ import annotations

import random
from types import SimpleNamespace

from loom.runtime.req import Req
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.spec.ngram import NgramLookup, NgramState
from loom.runtime.spec.ngram_own import OwnIndex


def _brute(seq: list[int], window: int, max_len: int, min_window: int = 1) -> list[int]:
    """The continuation after the latest earlier end of the longest suffix (<= window)."""
    n = len(seq)
    for w in range(min(window, n - 1), min_window - 1, -1):
        suffix = seq[n - w :]
        for j in range(n - 2, w - 2, -1):  # an end with a token after it, latest first
            if seq[j - w + 1 : j + 1] == suffix:
                return seq[j + 1 : j + 1 + max_len]
    return []


def test_own_index_matches_a_brute_force_search_token_by_token():
    rng = random.Random(0)
    for trial in range(40):
        vocab = rng.choice((3, 5, 12))
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        window, max_len = rng.choice((1, 3, 6)), rng.choice((1, 4, 8))
        index = OwnIndex(window)
        for i in range(len(seq)):  # grown as a request's tokens arrive, one call or many
            index.extend(seq[i : i + 1])
            assert index.propose(max_len) == _brute(seq[: i + 1], window, max_len), (trial, i)
        assert index.seen == len(seq)
        assert OwnIndex(window).propose(max_len) == []


def test_longest_window_wins_then_the_latest_occurrence():
    index = OwnIndex(4)
    # "1 2" was followed by 7 (in "3 1 2 7") and later by 8; "3 1 2" only by 7
    index.extend([3, 1, 2, 7, 5, 1, 2, 8, 6, 3, 1, 2])
    assert index.propose(3) == [7, 5, 1]
    index2 = OwnIndex(4)
    index2.extend([9, 1, 2, 7, 5, 1, 2, 8, 6, 3, 1, 2])
    assert index2.propose(2) == [8, 6]  # "3 1 2" never before: "1 2" most recently -> 8
    assert index2.propose(2, min_window=3) == []


def _req(prompt: list[int], output: list[int] = ()) -> Req:
    req = Req("r", list(prompt), make_sampling_params({}), seed=0)
    req.output_ids.extend(output)
    return req


def test_own_tokens_come_before_a_deeper_match_in_another_request():
    lookup = NgramLookup(1, 4, 6, 10_000)
    # another request: "1 2 3 4" then 50 51
    lookup.observe(_req([1, 2, 3, 4, 50, 51]), NgramState(6))
    # this request wrote "4 60 61" itself, and now ends in "1 2 3 4"
    mine = _req([4, 60, 61, 1, 2, 3], [4])
    assert lookup.propose(mine, NgramState(6), 2) == [50, 51]  # the trie: the deeper match
    assert lookup.propose(mine, NgramState(6), 2, own=True) == [60, 61]
    # forced text after the sequence: the trie's path whatever `own` says
    assert lookup.propose(mine, NgramState(6), 1, after=[50], own=True) == [51]
    # no own match (the last token is new to this request): the trie answers
    other = _req([7, 8, 1, 2, 3], [4])
    assert lookup.propose(other, NgramState(6), 2, own=True) == [50, 51]


def test_the_own_index_follows_the_request_and_restarts_after_a_rewrite():
    lookup = NgramLookup(1, 4, 6, 10_000)
    req = _req([5, 6, 7, 5], [6])
    state = NgramState(6)
    assert lookup.propose(req, state, 2, own=True) == [7, 5]
    req.output_ids.extend([9, 5, 6])
    assert lookup.propose(req, state, 2, own=True) == [9, 5]  # "5 6" latest before: 9 after
    assert state.own.seen == req.seq_len
    del req.output_ids[-2:]  # the tail rewritten (jump-forward re-tokenising): built afresh
    assert lookup.propose(req, state, 2, own=True) == [5, 6]  # "9" not seen before: the trie
    assert state.own.seen == req.seq_len


def test_the_speculator_uses_own_tokens_for_free_decode_steps_only():
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.spec.speculator import NgramSpeculator

    spec = NgramSpeculator(ServerArgs(speculative_algorithm="NGRAM"), None, 100, [0])
    assert spec._own_first(SimpleNamespace(grammar=None, output_ids=[3]))
    assert not spec._own_first(SimpleNamespace(grammar=None, output_ids=[]))  # the prefill's
    assert not spec._own_first(SimpleNamespace(grammar=object(), output_ids=[3]))
