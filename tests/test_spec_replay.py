"""bench_spec_replay: the n-gram speculator replayed over fixed answers accounts for every
token, and reads a verify's accepted run as the scheduler's verify step does."""

from __future__ import annotations

import pytest

from loom.runtime.server_args import ServerArgs
from loom.runtime.spec import DraftTree
from loom.runtime.spec.speculator import NgramSpeculator
from tests.file_modules import benchmark_module


@pytest.fixture(scope="module")
def replay():
    with benchmark_module("bench_spec_replay") as mod:  # it imports bench_specbench by name
        yield mod


def test_accepted_runs_of_chains_and_trees(replay):
    answer = [5, 6, 7, 8]
    assert replay.accepted([6, 7, 9], answer, 1) == (3, 2)
    assert replay.accepted([6, 7, 8, 9], answer, 1) == (4, 3)  # the answer ends
    assert replay.accepted([1], answer, 0) == (1, 0)
    # a tree: 9 and 6 at depth 0, 7 under 6, 1 under 9: the path 6 7 is accepted
    tree = DraftTree([9, 6, 1, 7], [-1, -1, 0, 1])
    assert replay.accepted(tree, answer, 1) == (2, 2)


def test_every_token_is_a_step_or_an_accepted_draft(replay):
    body = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3
    rows = [
        {"cat": "warmup", "prompt": [1, 2, 3], "output": [4, 5, 6, 7, 8]},
        {"cat": "qa", "prompt": [1, 2, 9], "output": body},
        {"cat": "rag", "prompt": [1, 2, 10], "output": body},  # the trie has seen it all
    ]
    spec = NgramSpeculator(ServerArgs(speculative_algorithm="NGRAM"), None, 100, [0])
    per = replay.replay(rows, spec, [0.0] * 8)
    for cat in ("warmup", "qa", "rag"):
        c = per[cat]
        decoded = c["verify_tokens"] + c["no_verify"] + c["prefill_accepted"]
        assert decoded == c["tokens"], cat
        assert c["steps"] == c["verifies"] + c["no_verify"]
    # a repeated answer drafts most of itself: far fewer steps than tokens
    assert per["rag"]["steps"] < per["rag"]["tokens"] / 3
    assert per["rag"]["steps"] < per["qa"]["steps"]
