"""`--dp-size 2` and `loom router` on real loom servers (tiny model). One DP server is started
for the module; its two replicas (plain dp_size=1 loom servers) are also the workers of the
standalone routers, so the module costs three server processes, not five. Order matters: the
last tests kill replica b, then stop the DP server."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import psutil
import pytest
import requests

from loom.runtime.router.process import RouterProcess
from loom.runtime.server.runtime_client import Runtime, free_port
from loom.runtime.server_args import ServerArgs
from tests.server_helpers import server_info, wait_idle_and_intact
from tests.test_server import sse_events

GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [
    "The quick brown fox",
    "Paris is the capital of",
    'Berlin {"name": "Alice"',
    "def add(a, b): return",
    "héllo wörld ünïcode",
    "Thought: I should search.",
]


KV = 4096


@dataclass
class Worker:
    url: str
    pid: int
    served_model_name: str


@pytest.fixture(scope="module")
def dp(tiny_model_dir):
    rt = Runtime(
        tiny_model_dir("llama"),
        dp_size=2,
        load_balance_method="cache_aware",
        max_total_tokens=KV,
        enable_metrics=True,
    )
    yield rt
    rt.shutdown(timeout=90)


@pytest.fixture(scope="module")
def workers(dp):
    """The DP server's replicas, each a dp_size=1 loom server with the same arguments."""
    children = psutil.Process(dp.pid).children()
    out = []
    for w in dp.get_server_info()["workers"]:
        port = w["url"].rsplit(":", 1)[1]
        pid = next(c.pid for c in children if port in c.cmdline())
        out.append(Worker(w["url"], pid, dp.server_args.served_model_name))
    assert len(out) == 2
    return tuple(out)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_dp_router_loop_yields_to_the_replicas(dp, workers):
    """The DP router's event loop (woken per streamed token) runs SCHED_BATCH; each replica
    server does too, while its scheduler process stays SCHED_NORMAL."""
    policy = lambda pid: os.sched_getscheduler(pid) & ~os.SCHED_RESET_ON_FORK  # noqa: E731
    assert policy(dp.pid) == os.SCHED_BATCH
    for w in workers:
        assert policy(w.pid) == os.SCHED_BATCH
        kids = [policy(c.pid) for c in psutil.Process(w.pid).children(recursive=True)]
        assert os.SCHED_OTHER in kids and kids.count(os.SCHED_BATCH) == 1, kids  # detokenizer


def test_dp_greedy_identical_to_one_replica_and_both_used(dp, workers):
    a, _ = workers
    prompts = [f"Tenant {i}: The quick brown fox " * 3 for i in range(4)]
    for prompt in prompts * 2:
        body = {"text": prompt, "sampling_params": GREEDY}
        got = requests.post(dp.url + "/generate", json=body, timeout=120).json()
        want = direct(a, "/generate", body).json()
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    info = wait_idle_and_intact(dp.url)
    assert info["max_total_tokens"] == 2 * KV  # summed over the replicas
    assert all(w["requests"] >= 1 for w in info["workers"]), info["workers"]
    for w in info["workers"]:  # each replica's load and hit rate
        assert w["num_running_reqs"] == 0 and w["num_waiting_reqs"] == 0
        assert 0.0 <= w["cache_hit_rate"] <= 1.0 and w["max_total_tokens"] == KV
    # cache_aware sent every repeat of a prompt to the replica holding it: hits on the repeats
    assert info["router"]["decisions"]["prefix_match"] >= 4
    assert info["cached_tokens"] > 0 and info["cache_hit_rate"] > 0
    stream = {"text": prompts[0], "sampling_params": GREEDY, "stream": True}
    with requests.post(dp.url + "/generate", json=stream, stream=True, timeout=120) as res:
        events = sse_events(res.iter_lines())
    want = direct(a, "/generate", {**stream, "stream": False}).json()
    assert events[-1] == "[DONE]" and events[-2]["text"] == want["text"]
    # /metrics: the router's series per replica and each replica's own series, labelled
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(dp.url + "/metrics", timeout=30).text
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    for w in workers:
        assert any(s.name.startswith("loom:") and s.labels.get("worker") == w.url for s in samples)
        assert any(
            s.name == "loom_router_requests_total" and s.labels["worker"] == w.url and s.value > 0
            for s in samples
        )


def test_dp_flags_are_checked_by_name(tiny_model_dir):
    import loom

    with pytest.raises(ValueError, match="^load_balance_method: needs --dp-size"):
        ServerArgs(load_balance_method="cache_aware")
    with pytest.raises(ValueError, match="^load_balance_method: must be one of"):
        ServerArgs(dp_size=2, load_balance_method="minimum_tokens")
    with pytest.raises(ValueError, match="^dp_size: must be >= 1"):
        ServerArgs(dp_size=0)
    with pytest.raises(ValueError, match="^load_balance_method: must be one of"):
        loom.Engine(tiny_model_dir("llama"), dp_size=2, load_balance_method="minimum_tokens")


@pytest.fixture(scope="module")
def router(workers):
    r = RouterProcess(
        [w.url for w in workers], "--policy", "cache_aware", "--cache-threshold", "0.3"
    )
    yield r
    r.shutdown()


def direct(worker, path, body):
    return requests.post(worker.url + path, json=body, timeout=120)


def test_greedy_outputs_identical_to_one_server(workers, router):
    a, _ = workers
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": GREEDY}
        got, want = router.post("/generate", body).json(), direct(a, "/generate", body).json()
        assert (got["text"], got["output_ids"]) == (want["text"], want["output_ids"]), prompt
    batch = {"text": PROMPTS[:3], "sampling_params": GREEDY}
    got = [o["output_ids"] for o in router.post("/generate", batch).json()]
    assert got == [o["output_ids"] for o in direct(a, "/generate", batch).json()]
    chat = {
        "model": a.served_model_name,
        "messages": [{"role": "user", "content": "Paris is"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    got = router.post("/v1/chat/completions", chat).json()["choices"][0]["message"]
    assert got == direct(a, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    completion = {"model": chat["model"], "prompt": "The quick", "max_tokens": 8, "temperature": 0}
    got = router.post("/v1/completions", completion).json()["choices"][0]["text"]
    assert got == direct(a, "/v1/completions", completion).json()["choices"][0]["text"]
    listing = router.get("/list_workers").json()
    assert all(w["requests"] > 0 for w in listing["workers"]), listing  # both were used
    assert router.get("/v1/models").json()["data"][0]["id"] == chat["model"]


def test_streams_pass_through(workers, router):
    a, _ = workers
    # How many chunks a stream has is timing (a server that decodes faster than its stream
    # is read merges steps into one chunk), so it is not asserted: every chunk the worker
    # sent arrives as its own event, cumulative, and the last one is the whole answer.
    params = {**GREEDY, "max_new_tokens": 64}
    body = {"text": "The quick brown fox", "sampling_params": params, "stream": True}
    with router.post("/generate", body, stream=True) as res:
        assert res.headers["content-type"].startswith("text/event-stream")
        events = sse_events(res.iter_lines())
    want = direct(a, "/generate", {**body, "stream": False}).json()
    assert events[-1] == "[DONE]" and len(events) >= 2
    ids = [e["output_ids"] for e in events[:-1]]
    assert all(y[: len(x)] == x for x, y in zip(ids, ids[1:])), ids
    assert events[-2]["text"] == want["text"] and ids[-1] == want["output_ids"]
    chat = {
        "model": a.served_model_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with router.post("/v1/chat/completions", chat, stream=True) as res:
        chunks = sse_events(res.iter_lines())
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    want = direct(a, "/v1/chat/completions", {**chat, "stream": False}).json()
    assert text == want["choices"][0]["message"]["content"]


def test_cache_aware_keeps_a_prefix_on_one_worker(router):
    system = "You are a helpful assistant for tenant seven. " * 4
    router.post("/generate", {"text": system + "Q0", "sampling_params": GREEDY})
    before = {w["url"]: w["requests"] for w in router.get("/list_workers").json()["workers"]}
    for q in range(1, 5):
        router.post("/generate", {"text": f"{system}Q{q}", "sampling_params": GREEDY})
    after = {w["url"]: w["requests"] for w in router.get("/list_workers").json()["workers"]}
    assert sorted(after[u] - before[u] for u in after) == [0, 4], (before, after)
    info = router.get("/get_server_info").json()
    assert info["router"]["decisions"]["prefix_match"] >= 4
    for w in info["workers"]:
        assert w["healthy"] and 0.0 <= w["cache_hit_rate"] <= 1.0 and w["num_running_reqs"] == 0


def test_errors_pass_through_and_admin_routes(workers, router):
    a, b = workers
    res = router.post("/generate", {"text": "x", "sampling_params": {"temperature": -1}})
    assert res.status_code == 400 and "temperature" in res.json()["error"]["message"]
    res = requests.post(router.url + "/generate", data=b"{not json", timeout=30)
    assert res.status_code == 400
    assert router.post("/add_worker?url=nope", {}).status_code == 400
    dead = f"http://127.0.0.1:{free_port()}"
    res = router.post(f"/add_worker?url={dead}", {})
    assert res.status_code == 400 and "not reachable" in res.json()["error"]["message"]
    assert router.post(f"/remove_worker?url={dead}", {}).status_code == 404
    assert router.post(f"/remove_worker?url={b.url}", {}).json()["urls"] == [a.url]
    before = router.get("/list_workers").json()["workers"][0]["requests"]
    for p in PROMPTS[:3]:
        assert router.post("/generate", {"text": p, "sampling_params": GREEDY}).ok
    assert router.get("/list_workers").json()["workers"][0]["requests"] == before + 3
    assert router.post(f"/add_worker?url={b.url}/", {}).json()["urls"] == [a.url, b.url]
    assert router.post("/flush_cache", {}).status_code == 200
    metrics = router.get("/metrics").text
    for w in (a, b):
        assert f'loom_router_requests_total{{worker="{w.url}"}}' in metrics
        assert f'loom_router_worker_healthy{{worker="{w.url}"}} 1' in metrics


def test_client_disconnect_aborts_on_the_worker(workers, router):
    """Leaving a stream or a plain request at the router frees the worker (no wasted decode)."""
    long = {"max_new_tokens": 900, "ignore_eos": True}

    def generated() -> int:
        return sum(wait_idle_and_intact(w.url)["generated_tokens"] for w in workers)

    def running() -> int:
        return sum(server_info(w.url)["num_running_reqs"] for w in workers)

    # each left request generated fewer than its 900 tokens: aborted, not run to the end (how
    # many fewer is decode speed against disconnect latency, which load changes)
    before = generated()
    body = {"text": "bye", "sampling_params": long, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", router.url + "/generate", json=body) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(3))
    after_stream = generated()
    assert after_stream - before < 900
    payload = json.dumps({"text": "wait", "sampling_params": long}).encode()
    sock = socket.create_connection(("127.0.0.1", router.port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    deadline = time.monotonic() + 30
    while running() == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    sock.close()
    assert generated() - after_stream < 900
    assert all(w["in_flight"] == 0 for w in router.get("/list_workers").json()["workers"])


# Kills worker b: keep it the module's last test.
def test_killed_worker_is_removed_and_its_requests_complete_elsewhere(workers):
    a, victim = workers
    router = RouterProcess(
        [a.url, victim.url], "--policy", "round_robin", "--health-check-interval", "0.5"
    )
    try:
        # long enough that the victim is seen running: 96 tokens of the tiny model took the
        # victim's whole share of the first wave in under a poll's time on an idle machine
        long = {**GREEDY, "max_new_tokens": 400}
        bodies = [{"text": f"{p} {i}", "sampling_params": long} for i, p in enumerate(PROMPTS * 2)]
        stream_body = {"text": "The quick", "sampling_params": long, "stream": True}

        def stream() -> list:
            with router.post("/generate", stream_body, stream=True) as res:
                return sse_events(res.iter_lines())

        with ThreadPoolExecutor(len(bodies) + 2) as pool:
            streams = [pool.submit(stream) for _ in range(2)]
            futures = [pool.submit(router.post, "/generate", b) for b in bodies[:8]]
            deadline = time.monotonic() + 60
            while (
                requests.get(victim.url + "/server_info", timeout=30).json()["num_running_reqs"]
                == 0
            ):
                assert time.monotonic() < deadline, "the victim never ran a request"
                time.sleep(0.01)
            os.kill(victim.pid, signal.SIGKILL)
            futures += [pool.submit(router.post, "/generate", b) for b in bodies[8:]]
            results = [f.result(timeout=300) for f in futures]
            stream_events = [s.result(timeout=300) for s in streams]
        for body, res in zip(bodies, results):
            assert res.status_code == 200, res.text
            want = direct(a, "/generate", body).json()
            assert res.json()["output_ids"] == want["output_ids"], body["text"]
        for events in stream_events:  # finished on `a`, or cut with a clear error event
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            if errors:
                assert victim.url in errors[0]["error"]["message"], errors
            else:
                assert events[-1] == "[DONE]" and len(events[-2]["output_ids"]) == 400
        listing = router.get("/list_workers").json()
        assert listing["urls"] == [a.url], listing
        assert listing["removed"][0]["url"] == victim.url, listing
        assert "request failed" in listing["removed"][0]["removed_reason"] or (
            "health" in listing["removed"][0]["removed_reason"]
        )
        metrics = router.get("/metrics").text
        assert f'loom_router_worker_healthy{{worker="{victim.url}"}} 0' in metrics
        retries = next(ln for ln in metrics.splitlines() if ln.startswith("loom_router_retries"))
        assert int(retries.split()[-1]) >= 1, metrics  # requests did move off the victim
        assert json.loads(router.get("/get_server_info").text)["removed"][0]["url"] == victim.url
    finally:
        router.shutdown()


def test_dp_survives_a_dead_replica_and_stops_cleanly(dp, workers):
    """After the test above killed replica b: the DP router drops it and serves from a; then
    a clean stop takes every process with it. Keep last."""
    a, b = workers
    body = {"text": "Paris is", "sampling_params": GREEDY}
    for _ in range(3):
        got = requests.post(dp.url + "/generate", json=body, timeout=120)
        assert got.json()["output_ids"] == direct(a, "/generate", body).json()["output_ids"]
    deadline = time.monotonic() + 30
    while b.url not in [w["url"] for w in dp.get_server_info()["removed"]]:
        assert time.monotonic() < deadline, dp.get_server_info()
        time.sleep(0.5)
    children = psutil.Process(dp.pid).children(recursive=True)
    assert dp.shutdown(timeout=90) == 0  # a clean stop, not SIGKILL
    deadline = time.monotonic() + 30
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, [c for c in children if c.is_running()]
        time.sleep(0.2)
