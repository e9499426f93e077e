"""`loom.Engine(dp_size=2)`: two whole replicas behind the Engine (runtime/data_parallel.py),
greedy outputs equal to one replica's, both replicas used, results in the caller's order."""

from __future__ import annotations

import asyncio

import pytest

import loom
from tests.test_router import GREEDY
from tests.test_router import PROMPTS as ROUTER_PROMPTS

PROMPTS = [*ROUTER_PROMPTS, "numbers 0123456789"]


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def _served(engine) -> list[int]:
    """Prompt tokens each replica has prefilled (its scheduler's own counter)."""
    info = engine.get_server_info()
    return [r["prompt_tokens"] for r in info["dp_replicas"]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    path = tiny_model_dir("llama")
    one = loom.Engine(path, max_total_tokens=2048, dtype="float32")
    try:
        want = {
            "batch": _ids(one.generate(PROMPTS, GREEDY)),
            "ids": _ids(one.generate(input_ids=[[5, 6, 7], [9, 10, 11, 12]], sampling_params=GREEDY)),
            "single": one.generate(PROMPTS[0], GREEDY)["output_ids"],
            "lens": [o["meta_info"]["completion_tokens"] for o in one.generate(
                PROMPTS[:3], [{**GREEDY, "max_new_tokens": k} for k in (2, 5, 3)])],
        }  # fmt: skip
    finally:
        one.shutdown()
    two = loom.Engine(path, max_total_tokens=2048, dtype="float32", dp_size=2)
    yield two, want
    two.shutdown()


def test_dp2_greedy_equals_one_replica_and_uses_both(engines):
    two, want = engines
    before = _served(two)
    assert len(before) == 2
    assert _ids(two.generate(PROMPTS, GREEDY)) == want["batch"]  # the caller's order
    after = _served(two)
    assert all(a > b for a, b in zip(after, before)), (before, after)  # both got prompts
    got = two.generate(input_ids=[[5, 6, 7], [9, 10, 11, 12]], sampling_params=GREEDY)
    assert _ids(got) == want["ids"]
    for _ in range(2):  # single prompts: whole requests, each replica in turn
        assert two.generate(PROMPTS[0], GREEDY)["output_ids"] == want["single"]
    # per-prompt values travel with their prompts
    per = [{**GREEDY, "max_new_tokens": k} for k in (2, 5, 3)]
    lens = [o["meta_info"]["completion_tokens"] for o in two.generate(PROMPTS[:3], per)]
    assert lens == want["lens"] == [2, 5, 3]
    rids = [f"r{i}" for i in range(4)]
    outs = two.generate(PROMPTS[:4], GREEDY, rid=rids)
    assert [o["meta_info"]["id"] for o in outs] == rids


def test_dp2_n_copies_stay_with_their_prompt(engines):
    two, want = engines
    outs = two.generate(PROMPTS[:3], {**GREEDY, "n": 2})
    assert len(outs) == 6
    assert _ids(outs) == [ids for ids in want["batch"][:3] for _ in range(2)]


def test_dp2_stream_indexes_the_callers_batch(engines):
    two, want = engines
    final: dict[int, list[int]] = {}
    for chunk in two.generate(PROMPTS, GREEDY, stream=True):
        final[chunk["index"]] = chunk["output_ids"]
    assert [final[i] for i in range(len(PROMPTS))] == want["batch"]

    async def run():
        return await two.async_generate(PROMPTS[:2], GREEDY)

    assert _ids(asyncio.run(run())) == want["batch"][:2]


def test_dp2_bad_batches_are_refused_by_field(engines):
    two, _ = engines
    with pytest.raises(ValueError, match="^rid: a list of 1 for a batch of 2"):
        two.generate(PROMPTS[:2], GREEDY, rid=["only-one"])
    with pytest.raises(ValueError, match="sampling_params: a list of 3 for a batch of 2"):
        two.generate(PROMPTS[:2], [GREEDY] * 3)
    assert two.flush_cache() is True
