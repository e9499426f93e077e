"""Several tokens per request per step: a verify step through the runner seam.

A TEST-ONLY drafter replays the continuation a plain run produced (optionally with wrong
tokens mixed in), so each decode step verifies a draft and a request gains k >= 1 tokens at
once. Whatever the drafts, the tokens, logprobs, stop handling, streaming and KV accounting
must be exactly those of one-token-per-step decoding when greedy; a seeded sampled request
is reproducible (its noise depends only on seed and position; the distribution it samples
is checked in tests/test_spec_sampling.py).
"""

from __future__ import annotations

import random
import re

import pytest

from loom.runtime.spec import Drafter
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit


class ReplayDrafter(Drafter):
    """Proposes the next `k` tokens of a known continuation (by rid); `wrong_at` replaces the
    draft token at that index with a different one, so verification must reject from there."""

    def __init__(
        self, continuations: dict[str, list[int]], k: int = 4, wrong_at: int | None = None
    ):
        self.continuations = continuations
        self.k = k
        self.wrong_at = wrong_at
        self.proposed = 0
        self.accepted = 0

    def on_verified(self, req, drafted: int, accepted: int) -> None:
        self.accepted += accepted

    def draft(self, req, max_len: int, free_drafts: bool = True) -> list[int]:
        ref = self.continuations.get(req.rid, [])
        draft = list(ref[len(req.output_ids) : len(req.output_ids) + min(self.k, max_len)])
        if self.wrong_at is not None and len(draft) > self.wrong_at:
            draft[self.wrong_at] = (draft[self.wrong_at] + 1) % 300 + 3
        self.proposed += len(draft)
        return draft


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(5, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _run(model, prompts, params, drafter=None, **submit_kw):
    sched = make_scheduler(model, page_size=4)
    sched.set_drafter(drafter)
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, params, seed=100 + i, **submit_kw)
    res = run_all(sched)
    return res, sched


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
def test_verified_drafts_give_the_plain_tokens(model, wrong_at):
    prompts = _prompts(6)
    plain, plain_sched = _run(model, prompts, greedy(24))
    cont = {rid: r.ids for rid, r in plain.items()}
    drafter = ReplayDrafter(cont, k=4, wrong_at=wrong_at)
    drafted, sched = _run(model, prompts, greedy(24), drafter)
    assert {rid: r.ids for rid, r in drafted.items()} == cont
    assert all(len(r.ids) == 24 for r in drafted.values())  # max_new_tokens lands mid-chunk
    assert drafter.proposed > 0
    if wrong_at is None:  # every draft accepted: about 5 tokens a step
        assert sched.stats["decode_steps"] * 3 < plain_sched.stats["decode_steps"]
    elif wrong_at == 0:  # every draft rejected: one token a step, like plain decoding
        assert sched.stats["decode_steps"] == plain_sched.stats["decode_steps"]


def test_seeded_sampling_with_drafts_is_reproducible(model):
    params = {"max_new_tokens": 24, "temperature": 0.1, "top_p": 0.9, "ignore_eos": True}
    prompts = _prompts(3)
    plain, _ = _run(model, prompts, params)
    cont = {rid: r.ids for rid, r in plain.items()}
    drafter = ReplayDrafter(cont, k=4)
    first, _ = _run(model, prompts, params, drafter)
    again, _ = _run(model, prompts, params, ReplayDrafter(cont, k=4))
    assert {r: x.ids for r, x in first.items()} == {r: x.ids for r, x in again.items()}
    assert all(len(r.ids) == 24 for r in first.values())
    # drafts of the plain continuation are accepted with probability p(x)
    print("accepted", drafter.accepted, "of", drafter.proposed)
    assert drafter.accepted > 0


@pytest.mark.parametrize(
    "extra",
    [
        {"repetition_penalty": 1.5},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"min_new_tokens": 20, "ignore_eos": False, "stop_token_ids": [7, 8, 9]},
        {"logit_bias": {"7": 3.0, "9": -2.0}},
    ],
    ids=["repetition", "frequency-presence", "min-new-tokens", "logit-bias"],
)
def test_each_draft_row_sees_the_tokens_accepted_before_it(model, extra):
    """Penalties count the draft tokens before a row as output, min_new_tokens bans stops
    until the row's own position: with drafts of the plain continuation, the greedy output is
    the plain one (a row that ignored the run before it would pick another token)."""
    prompts = _prompts(4, seed=3)
    plain, _ = _run(model, prompts, greedy(24, **extra))
    drafter = ReplayDrafter({rid: r.ids for rid, r in plain.items()}, k=6)
    drafted, _ = _run(model, prompts, greedy(24, **extra), drafter)
    assert {r: x.ids for r, x in drafted.items()} == {r: x.ids for r, x in plain.items()}
    assert drafter.accepted > len(prompts) * 10


def test_logprobs_stay_aligned_with_several_tokens_a_step(model):
    prompts = _prompts(3, seed=1)
    kw = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 2}
    plain, _ = _run(model, prompts, greedy(13), **kw)
    drafter = ReplayDrafter({rid: r.ids for rid, r in plain.items()}, k=5, wrong_at=3)
    drafted, _ = _run(model, prompts, greedy(13), drafter, **kw)
    for rid, ref in plain.items():
        got = drafted[rid]
        assert [t for _, t in got.output_logprobs] == got.ids == ref.ids
        assert len(got.output_top) == len(got.ids)
        for (a, _), (b, _) in zip(got.output_logprobs, ref.output_logprobs):
            assert abs(a - b) < 1e-4
        for j, (top_a, top_b) in enumerate(zip(got.output_top, ref.output_top)):
            assert [i for _, i in top_a] == [i for _, i in top_b]
            assert top_a[0][1] == got.ids[j]  # greedy: the top-1 entry is the chosen token
        assert [t for _, t in got.input_logprobs] == [t for _, t in ref.input_logprobs]


def test_drafts_are_cut_to_the_step_token_cap(model):
    """A verify step feeds at most `step_token_cap` tokens (the compiled CPU forward's limit),
    the drafts shared among the batch; the tokens stay the plain ones."""
    prompts = _prompts(6, seed=3)
    plain, _ = _run(model, prompts, greedy(20))
    cont = {rid: r.ids for rid, r in plain.items()}
    sched = make_scheduler(model, page_size=4)
    sched.set_drafter(ReplayDrafter(cont, k=6))
    sched.decode.step_token_cap = 16
    fed = []
    forward = sched.runner.forward

    def spy(inp):
        if any(inp.drafts.tokens):
            fed.append((len(inp.sample_counts), len(inp.input_ids)))
        return forward(inp)

    sched.runner.forward = spy
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, greedy(20), seed=100 + i)
    assert {rid: r.ids for rid, r in run_all(sched).items()} == cont
    assert fed and max(n for _, n in fed) <= 16
    assert any(b >= 4 for b, _ in fed)  # batches where 6-token drafts would not have fitted


def test_stop_token_mid_chunk_ends_there(model):
    prompts = _prompts(4, seed=2)
    plain, _ = _run(model, prompts, greedy(30))
    cont = {rid: r.ids for rid, r in plain.items()}
    # stop on each request's 7th token: with 6-token drafts it lands inside a chunk
    for rid, ids in cont.items():
        stop = ids[6]
        first = ids.index(stop)
        sched = make_scheduler(model, page_size=4)
        sched.set_drafter(ReplayDrafter(cont, k=6))
        i = int(rid[1:])
        submit(sched, rid, prompts[i], greedy(30, stop_token_ids=[stop]), seed=100 + i)
        got = run_all(sched)[rid]
        assert got.ids == ids[: first + 1]
        assert got.finish_reason == {"type": "stop", "matched": stop}


@pytest.fixture(scope="module")
def bundled():
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    return BUNDLED_MODEL_PATH


def _bundled_run(path, prompt_text, params, drafter=None, stream=False):
    sched = make_scheduler(path)
    sched.set_drafter(drafter)
    ids = sched.tokenizer.encode(prompt_text)
    submit(sched, "s", ids, params, stream=stream)
    return run_all(sched)["s"], sched


def test_stop_string_and_stop_regex_mid_chunk_and_streaming(bundled):
    prompt = "Once upon a time there was a little fox who"
    plain, sched = _bundled_run(bundled, prompt, greedy(40))
    half = len(plain.text) // 2
    # a word whose first three letters first appear in the second half of the answer
    stop = next(
        w
        for w in plain.text[half:].split()
        if len(w) >= 5 and w.isalpha() and plain.text.find(w[:3]) > half
    )
    drafter = ReplayDrafter({"s": plain.ids}, k=6)
    for extra in ({"stop": [stop]}, {"stop_regex": [r"\b" + re.escape(stop[:3]) + r"\w+"]}):
        ref, _ = _bundled_run(bundled, prompt, greedy(40, **extra))
        got, _ = _bundled_run(bundled, prompt, greedy(40, **extra), drafter, stream=True)
        assert ref.finish_reason["type"] == "stop"
        assert got.finish_reason == ref.finish_reason
        assert got.ids == ref.ids and got.text == ref.text
        matched = got.finish_reason["matched"]
        if "stop_regex" in extra:  # SGLang: the pattern is reported, the matched text is kept
            assert matched == extra["stop_regex"][0]
            assert re.search(matched, got.text) and len(got.ids) < len(plain.ids)
        else:
            assert matched not in got.text  # trimmed
        assert "".join(got.chunks) == got.text
        assert len([c for c in got.chunks if c]) < len(got.ids)  # several tokens per chunk
