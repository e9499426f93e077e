"""`--dp-size 2`: two replicas behind the in-process router, in one launch (runtime/router/dp.py)."""

from __future__ import annotations

import time

import psutil
import pytest
import requests

from loom.runtime.server.runtime_client import Runtime
from loom.runtime.server_args import ServerArgs
from tests.server_helpers import wait_idle_and_intact

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
KV = 2048


@pytest.fixture(scope="module")
def dp(tiny_model_dir):
    rt = Runtime(
        tiny_model_dir("llama"), dp_size=2, load_balance_method="cache_aware", max_total_tokens=KV
    )
    yield rt
    rt.shutdown()


def replica_urls(dp) -> list[str]:
    return [w["url"] for w in dp.get_server_info()["workers"]]


def test_greedy_identical_to_one_replica_and_both_used(dp):
    urls = replica_urls(dp)
    assert len(urls) == 2
    prompts = [f"Tenant {i}: The quick brown fox " * 3 for i in range(4)]
    for prompt in prompts * 2:
        body = {"text": prompt, "sampling_params": GREEDY}
        got = requests.post(dp.url + "/generate", json=body, timeout=120).json()
        # each replica is a plain dp_size=1 loom server with the same arguments
        want = requests.post(urls[0] + "/generate", json=body, timeout=120).json()
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    info = wait_idle_and_intact(dp.url)
    assert info["max_total_tokens"] == 2 * KV  # summed over the replicas
    workers = info["workers"]
    assert all(w["requests"] >= 1 for w in workers), workers
    for w in workers:  # each replica's load and hit rate
        assert w["num_running_reqs"] == 0 and w["num_waiting_reqs"] == 0
        assert 0.0 <= w["cache_hit_rate"] <= 1.0 and w["max_total_tokens"] == KV
    # cache_aware sent every repeat of a prompt to the replica holding it: hits on the repeats
    assert info["router"]["decisions"]["prefix_match"] >= 4
    assert info["cached_tokens"] > 0 and info["cache_hit_rate"] > 0
    stream = {"text": prompts[0], "sampling_params": GREEDY, "stream": True}
    with requests.post(dp.url + "/generate", json=stream, stream=True, timeout=120) as res:
        lines = [ln for ln in res.iter_lines() if ln.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]" and len(lines) > 2


def test_dp_flags_are_checked_by_name(tiny_model_dir):
    import loom

    with pytest.raises(ValueError, match="^load_balance_method: needs --dp-size"):
        ServerArgs(load_balance_method="cache_aware")
    with pytest.raises(ValueError, match="^load_balance_method: must be one of"):
        ServerArgs(dp_size=2, load_balance_method="minimum_tokens")
    with pytest.raises(ValueError, match="^dp_size: must be >= 1"):
        ServerArgs(dp_size=0)
    with pytest.raises(ValueError, match="^dp_size: an Engine runs one replica"):
        loom.Engine(tiny_model_dir("llama"), dp_size=2)


def test_shutdown_stops_the_replicas(dp):
    """Keep last: stops the module's server."""
    children = psutil.Process(dp.pid).children(recursive=True)
    assert len(children) >= 2 * 3, children  # two replicas, each with scheduler + detokenizer
    assert dp.shutdown(timeout=90) == 0  # a clean stop, not SIGKILL
    deadline = time.monotonic() + 30
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, [c for c in children if c.is_running()]
        time.sleep(0.2)
