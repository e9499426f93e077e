"""The radix cache inside the runtime: reuse across requests and turns, never a changed output."""

from __future__ import annotations

import random

import pytest

from tests.runtime_helpers import greedy, make_scheduler, run_all, submit


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.parametrize("page_size", [1, 4])
def test_branching_prompts_share_the_prefix(model, page_size):
    shared = _ids(200, 1)
    prompts = [shared + _ids(10 + i, 10 + i) for i in range(3)]
    sched = make_scheduler(model, page_size=page_size)
    for i, p in enumerate(prompts):  # all three arrive together: in-batch sharing
        submit(sched, f"b{i}", p, greedy(8))
    res = run_all(sched)
    aligned = 200 // page_size * page_size
    assert [res[f"b{i}"].cached_tokens for i in range(3)] == [0, aligned, aligned]
    off = make_scheduler(model, page_size=page_size, disable_radix_cache=True)
    for i, p in enumerate(prompts):
        submit(off, f"b{i}", p, greedy(8))
    res_off = run_all(off)
    assert all(res_off[f"b{i}"].cached_tokens == 0 for i in range(3))
    assert [res[f"b{i}"].ids for i in range(3)] == [res_off[f"b{i}"].ids for i in range(3)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_multi_turn_reuses_prompt_and_output(model, page_size):
    sched = make_scheduler(model, page_size=page_size)
    history = {c: _ids(30 + 7 * c, c) for c in range(4)}
    previous = {}
    for turn in range(5):
        for c in range(4):
            submit(sched, f"c{c}t{turn}", history[c], greedy(12))
        res = run_all(sched)
        for c in range(4):
            r = res[f"c{c}t{turn}"]
            if turn > 0:
                # prompt and output of the previous turn, the last sampled token included
                expect = previous[c] // page_size * page_size
                assert r.cached_tokens >= expect, (turn, c, r.cached_tokens, expect)
            previous[c] = len(history[c]) + len(r.ids)
            history[c] = history[c] + r.ids + _ids(9, 100 * turn + c)
    assert sched.get_state()["cache_hit_rate"] > 0.5


def test_eviction_under_a_small_pool_keeps_outputs(model):
    shared = _ids(60, 5)
    prompts = [shared + _ids(40, i) for i in range(12)] + [_ids(90, 50 + i) for i in range(6)]
    small = make_scheduler(model, max_total_tokens=400)
    big = make_scheduler(model, disable_radix_cache=True)
    for s in (small, big):
        for i, p in enumerate(prompts):
            submit(s, f"r{i}", p, greedy(16))
    res_small, res_big = run_all(small), run_all(big)
    assert [res_small[f"r{i}"].ids for i in range(len(prompts))] == [
        res_big[f"r{i}"].ids for i in range(len(prompts))
    ]
    assert small.tree_cache.total_size() <= 400


def test_input_logprobs_cap_the_match(model):
    sched = make_scheduler(model)
    prompt = _ids(50, 9)
    submit(sched, "warm", prompt, greedy(2))
    run_all(sched)
    submit(sched, "lp", prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=20)
    res = run_all(sched)["lp"]
    assert res.cached_tokens <= 19
    assert len(res.input_logprobs) == 30 and [t for _, t in res.input_logprobs] == prompt[20:]
    cold = make_scheduler(model, disable_radix_cache=True)
    submit(cold, "lp", prompt, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=20)
    ref = run_all(cold)["lp"]
    assert all(abs(a[0] - b[0]) < 1e-5 for a, b in zip(res.input_logprobs, ref.input_logprobs))


def test_flush_cache_refused_while_busy(model):
    sched = make_scheduler(model)
    submit(sched, "a", _ids(20, 1), greedy(30))
    sched.step()
    ok, msg = sched.flush_cache()
    assert not ok and "refused" in msg
    run_all(sched)
    assert sched.tree_cache.total_size() > 0
    ok, _ = sched.flush_cache()
    assert ok and sched.tree_cache.total_size() == 0
    sched.check_integrity()


def test_flush_cache_right_after_the_last_answer(model):
    """A finished request rides one more step (finishing) to write its last token's KV; a
    flush sent as soon as its answer is out must not be refused for it."""
    sched = make_scheduler(model)
    submit(sched, "a", _ids(20, 1), greedy(5))
    while not any(o.finished_reason for o in sched.step()):
        pass
    assert sched.decode.finishing and not sched.running  # the KV-completion step
    ok, msg = sched.flush_cache()
    assert ok, msg
    assert sched.is_idle and sched.tree_cache.total_size() == 0
    sched.check_integrity()


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs", "lof", "random"])
def test_every_schedule_policy_gives_the_same_tokens(model, policy):
    shared = _ids(40, 3)
    prompts = [shared + _ids(5 + i, i) for i in range(5)] + [_ids(30, 20 + i) for i in range(3)]
    outs = {}
    for pol in ("fcfs", policy):
        sched = make_scheduler(model, schedule_policy=pol, max_running_requests=3)
        for i, p in enumerate(prompts):
            submit(sched, f"r{i}", p, greedy(6, max_new_tokens=6 + i))
        res = run_all(sched)
        outs[pol] = [res[f"r{i}"].ids for i in range(len(prompts))]
    assert outs[policy] == outs["fcfs"]
