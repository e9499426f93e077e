"""Load: 256 concurrent streaming clients on loopback, a third of them hanging up part-way,
then the KV accounting must balance and the prefix cache must still report sane hits."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import requests

from tests.server_helpers import wait_idle_and_intact

CLIENTS = 256
PREFIXES = [f"Shared system prompt number {k}: answer briefly." for k in range(4)]


@pytest.fixture(scope="module")
def server(tiny_server):
    """conftest's shared tiny-llama server: 4096 KV tokens give 64 running rows (its own server
    set max_running_requests=64 to the same effect), so 256 clients queue behind a full batch."""
    assert tiny_server.get_server_info()["max_running_requests"] == 64
    return tiny_server


def test_256_streaming_clients_with_random_aborts(server):
    rng = random.Random(1234)
    plans = [
        {
            "prefix": rng.choice(PREFIXES),
            "max_new": rng.randint(4, 24),
            "abort_after": rng.randint(1, 3) if rng.random() < 0.33 else None,
        }
        for _ in range(CLIENTS)
    ]

    async def one(client: httpx.AsyncClient, i: int, plan: dict) -> dict:
        body = {
            "text": f"{plan['prefix']} Client {i}.",
            "sampling_params": {"max_new_tokens": plan["max_new"], "ignore_eos": True},
            "stream": True,
        }
        events = 0
        last = None
        async with client.stream("POST", server.url + "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                last = json.loads(line[6:])
                events += 1
                if plan["abort_after"] is not None and events >= plan["abort_after"]:
                    break  # leaving the block closes the connection: the server aborts
        return {"events": events, "last": last}

    async def main() -> list:
        limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(plans)))

    results = asyncio.run(main())
    info = wait_idle_and_intact(server.url, timeout=120)
    assert info["num_running_reqs"] == 0

    finished = 0
    for plan, res in zip(plans, results):
        meta = res["last"]["meta_info"]
        assert 0 <= meta["cached_tokens"] <= meta["prompt_tokens"]
        if plan["abort_after"] is None:
            finished += 1
            assert meta["finish_reason"] == {"type": "length", "length": plan["max_new"]}
            assert meta["completion_tokens"] == plan["max_new"]
    assert finished >= CLIENTS // 2

    # the prefix cache survived the aborts: a shared prefix is served from it now
    res = requests.post(
        server.url + "/generate",
        json={"text": PREFIXES[0] + " Client late.", "sampling_params": {"max_new_tokens": 1}},
        timeout=60,
    ).json()
    prefix_len = len(
        requests.post(server.url + "/tokenize", json={"prompt": PREFIXES[0]}).json()["tokens"]
    )
    assert res["meta_info"]["cached_tokens"] >= prefix_len - 1, res["meta_info"]
    wait_idle_and_intact(server.url, timeout=120)
