"""Multi-turn output reuse through the Engine (real scheduler and detokenizer processes).

Each client sends a prompt, waits for the answer (finished by length), then sends prompt +
output (+ a new user turn) as its next turn. Every turn must find the previous prompt AND
output in the prefix cache, whatever the load: the finished request's KV reaches the cache
before the scheduler goes idle and before any later request's prefix match. A single
sequential client is the case that used to lose the race (cached == previous prompt only).
"""

from __future__ import annotations

import asyncio
import random

import pytest

import loom

TURNS = 3
NEW_TOKENS = 20


def _aligned(n: int, page: int) -> int:
    return n // page * page


async def _ids_client(engine, c: int, page: int) -> list[tuple[int, int]]:
    rng = random.Random(c)
    ids = [rng.randrange(3, 300) for _ in range(24 + c)]
    previous = None
    seen = []
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    for _ in range(TURNS):
        out = await engine.async_generate(input_ids=ids, sampling_params=params)
        cached = out["meta_info"]["cached_tokens"]
        if previous is not None:
            seen.append((cached, _aligned(previous - 1, page)))
        previous = len(ids) + len(out["output_ids"])
        ids = ids + out["output_ids"] + [rng.randrange(3, 300) for _ in range(5)]
    return seen


@pytest.fixture(scope="module")
def ids_engine(tiny_model_dir):
    eng = loom.Engine(tiny_model_dir("llama"), max_total_tokens=16384, dtype="float32", page_size=4)
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("clients", [1, 4, 16])
def test_ids_turns_reuse_prompt_and_output(ids_engine, clients):
    async def main():
        return await asyncio.gather(*(_ids_client(ids_engine, c, 4) for c in range(clients)))

    for seen in asyncio.run(main()):
        for turn, (cached, expect) in enumerate(seen, start=1):
            assert cached >= expect, f"turn {turn}: cached {cached} < prompt + output - 1 {expect}"


@pytest.fixture(scope="module")
def text_engine():
    eng = loom.Engine(max_total_tokens=16384)  # the bundled model: its outputs are real text
    yield eng
    eng.shutdown()


async def _text_client(engine, c: int) -> tuple[list[tuple[int, int]], int]:
    """Turns whose text re-tokenizes to prompt ids + output ids (canonical) must reuse it all."""
    tok = engine.tokenizer
    text = f"Story {c}: Once upon a time there was a little fox who"
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    checked, previous_ids = [], None
    skipped = 0
    for _ in range(TURNS):
        out = await engine.async_generate(text, params)
        cached = out["meta_info"]["cached_tokens"]
        if previous_ids is not None:
            prompt_ids = tok.encode(text)
            if prompt_ids[: len(previous_ids)] == previous_ids:
                checked.append((cached, len(previous_ids) - 1))
            else:
                skipped += 1
        previous_ids = tok.encode(text) + out["output_ids"]
        text = text + out["text"] + " And then"
    return checked, skipped


@pytest.mark.parametrize("clients", [1, 4, 16])
def test_text_turns_reuse_prompt_and_output(text_engine, clients):
    async def main():
        return await asyncio.gather(*(_text_client(text_engine, c) for c in range(clients)))

    results = asyncio.run(main())
    checked = [pair for seen, _ in results for pair in seen]
    assert len(checked) >= clients, "too few turns re-tokenize canonically to test anything"
    for cached, expect in checked:
        assert cached >= expect, f"cached {cached} < prompt + output - 1 {expect}"


def test_http_sequential_client_reuses_prompt_and_output(tiny_server):
    """The same through /generate: one client, each turn sent when the last one answered (on
    conftest's shared tiny-llama server: no other module sends these seeded random ids, so the
    reuse counted is this conversation's own)."""
    import requests

    rng = random.Random(7)
    ids = [rng.randrange(3, 300) for _ in range(30)]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    rt = tiny_server
    previous = None
    for turn in range(TURNS + 1):
        r = requests.post(
            rt.url + "/generate",
            json={"input_ids": ids, "sampling_params": params},
            timeout=60,
        )
        r.raise_for_status()
        out = r.json()
        if previous is not None:
            cached = out["meta_info"]["cached_tokens"]
            assert cached >= previous - 1, f"turn {turn}: cached {cached} < {previous - 1}"
        previous = len(ids) + len(out["output_ids"])
        ids = ids + out["output_ids"] + [rng.randrange(3, 300) for _ in range(5)]
