"""Continuous batching gives the same greedy tokens however requests are batched, chunked,
paged or retracted, and the KV accounting stays exact throughout."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.runtime_helpers import greedy, make_scheduler, run_all, submit


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Each of 16 mixed-length prompts decoded alone."""
    prompts = _prompts(16, 4, 120)
    sched = make_scheduler(model)
    outs = []
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, greedy(24))
        outs.append(run_all(sched)[f"r{i}"].ids)
    return prompts, outs


def _run_batch(model, prompts, **kw):
    sched = make_scheduler(model, **kw)
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, greedy(24))
    res = run_all(sched)
    return [res[f"r{i}"].ids for i in range(len(prompts))], sched


def test_batch_of_16_matches_alone(model, reference):
    prompts, alone = reference
    batched, _ = _run_batch(model, prompts)
    assert batched == alone


@pytest.mark.parametrize(
    "kw",
    [
        {"chunked_prefill_size": 16},
        {"page_size": 4},
        {"page_size": 4, "chunked_prefill_size": 16},
        {"disable_radix_cache": True, "chunked_prefill_size": 16},
        {"max_running_requests": 3},
    ],
    ids=["chunk16", "page4", "page4-chunk16", "nocache-chunk16", "max-running-3"],
)
def test_layouts_give_same_tokens(model, reference, kw):
    prompts, alone = reference
    batched, _ = _run_batch(model, prompts, **kw)
    assert batched == alone


@pytest.mark.parametrize("kw", [{}, {"page_size": 4}, {"disable_radix_cache": True}])
def test_small_pool_forces_retraction_and_outputs_survive(model, reference, kw):
    prompts, alone = reference
    # room for the prompts but not for all of them to decode 24 tokens together
    batched, sched = _run_batch(model, prompts, max_total_tokens=700, **kw)
    assert sched.stats["num_retractions"] > 0
    assert batched == alone


def test_prefix_too_long_for_pool_is_rejected_not_hung(model):
    sched = make_scheduler(model, max_total_tokens=64)
    submit(sched, "big", list(range(3, 200)), greedy(4))
    submit(sched, "ok", list(range(3, 20)), greedy(4))
    res = run_all(sched, max_steps=500)
    assert res["ok"].finish_reason["type"] == "length"
    assert res["big"].finish_reason["type"] == "abort"


def test_abort_releases_kv(model):
    sched = make_scheduler(model)
    submit(sched, "a", list(range(3, 40)), greedy(50))
    submit(sched, "b", list(range(3, 30)), greedy(50))
    for _ in range(5):
        sched.step()
    sched.abort("a")
    res = run_all(sched)
    assert res["a"].finish_reason["type"] == "abort"
    assert len(res["b"].ids) == 50
    sched.check_integrity()


def test_invalid_prompts_finish_with_an_error(model):
    sched = make_scheduler(model, context_length=128)
    submit(sched, "empty", [], greedy(4))
    submit(sched, "long", list(range(3, 3 + 130)), greedy(4))
    submit(sched, "badid", [5, 99999], greedy(4))
    res = run_all(sched)
    for rid, field in (("empty", "empty"), ("long", "context length"), ("badid", "token ids")):
        assert res[rid].finish_reason["type"] == "abort"
        assert field in res[rid].finish_reason["message"]


def test_decode_slots_land_in_the_request_rows(model):
    """The CPU decode allocation (page size 1: numpy writes into req_to_token) gives each
    request a fresh slot at position kv_len of its own row, as the generic path does."""
    sched = make_scheduler(model)
    for i, n in enumerate((5, 9, 3)):
        submit(sched, f"r{i}", list(range(3, 3 + n)), greedy(8))
    sched.step()  # the prefill
    kv, reqs = sched.kv, list(sched.decode.running)
    table = kv.req_to_token_pool.req_to_token
    before, free = table.clone(), kv.available()
    for batch in (reqs[:1], reqs):
        slots = kv.alloc_decode(batch).tolist()
        assert len(set(slots)) == len(batch) and kv.available() == free - len(batch)
        for r, s in zip(batch, slots):
            assert int(table[r.req_pool_idx, r.kv_len]) == s
            before[r.req_pool_idx, r.kv_len] = s
            r.kv_len += 1  # as a forward writing that position would leave it
        free -= len(batch)
    assert torch.equal(table, before)  # nothing else written


def test_decode_input_is_the_general_one(model):
    """A decode step without trees or logprobs builds its ModelInput on a shorter path: every
    field equals the general path's, for a plain decode step (a finishing request that samples
    nothing included) and for a verify step of draft chains (a request without a draft
    among them)."""
    import dataclasses

    from loom.runtime.scheduler.batch import ScheduleBatch

    sched = make_scheduler(model, page_size=4)
    for i, n in enumerate((5, 9, 3)):
        submit(sched, f"r{i}", list(range(3, 3 + n)), greedy(8, temperature=0.5 * i))
    sched.step()  # the prefill
    reqs = list(sched.decode.running)
    v = sched.vocab_size

    def same(batch):
        fast, general = batch._build_decode(v), batch._build_general(v)
        for f in dataclasses.fields(fast):
            a, b = getattr(fast, f.name), getattr(general, f.name)
            if f.name == "sampling":
                for g in dataclasses.fields(a):
                    x, y = getattr(a, g.name), getattr(b, g.name)
                    if isinstance(x, np.ndarray):  # SamplingInfo.from_reqs: numpy arrays
                        assert np.array_equal(x, y), g.name
                    else:
                        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, g.name
            elif isinstance(a, np.ndarray):  # the index arrays
                assert a.dtype == b.dtype and np.array_equal(a, b), f.name
            else:
                assert a == b, f.name
        return fast

    for r, draft in zip(reqs, ([5, 6, 7], [], [4])):
        r.draft_ids, r.extend_len = draft, 1 + len(draft)
    batch = ScheduleBatch(reqs, is_decode=True)
    batch.out_cache_loc = np.arange(7, 14)  # slots are numpy on the host
    verify = same(batch)
    assert verify.sample_counts == [4, 1, 2] and verify.mode.name == "EXTEND"
    assert verify.positions.tolist()[:4] == list(range(reqs[0].kv_len, reqs[0].kv_len + 4))
    assert verify.sampling.draft_tokens.tolist() == [5, 6, 7, -1, -1, 4, -1]
    for r in reqs:
        r.draft_ids, r.extend_len = [], 1
    reqs[1].finished_reason = {"type": "length", "length": 1}  # rides a step, samples nothing
    batch = ScheduleBatch(reqs, is_decode=True)
    batch.out_cache_loc = np.array([7, 8, 9])
    decode = same(batch)
    assert decode.sample_counts == [1, 0, 1] and decode.mode.name == "DECODE"
