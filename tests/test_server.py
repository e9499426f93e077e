"""The native HTTP API (SGLang's /generate and friends) against one tiny-model server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import requests

from tests.server_helpers import wait_idle_and_intact


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # conftest: one tiny-llama server shared by the modules that only read


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def sse_events(lines) -> list:
    """Parse `data: ...` lines; the final `[DONE]` is kept as the string."""
    out = []
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode()
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


def test_generate_single_is_deterministic(server):
    a = post(server, "/generate", {"text": "The quick brown", "sampling_params": GREEDY}).json()
    b = post(server, "/generate", {"text": "The quick brown", "sampling_params": GREEDY}).json()
    assert a["text"] == b["text"] and a["output_ids"] == b["output_ids"]
    meta = a["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == 6 and len(a["output_ids"]) == 6
    assert meta["prompt_tokens"] > 0 and "e2e_latency" in meta and meta["id"]
    assert b["meta_info"]["cached_tokens"] > 0


def test_generate_batch_text_and_input_ids(server):
    texts = ["Paris is", "Berlin is the"]
    res = post(server, "/generate", {"text": texts, "sampling_params": GREEDY}).json()
    assert isinstance(res, list) and len(res) == 2
    ids = requests.post(server.url + "/tokenize", json={"prompt": texts}).json()["tokens"]
    res_ids = post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert [r["output_ids"] for r in res_ids] == [r["output_ids"] for r in res]
    single = post(server, "/generate", {"input_ids": ids[0], "sampling_params": GREEDY}).json()
    assert single["output_ids"] == res[0]["output_ids"]


def test_generate_n(server):
    sp = {"max_new_tokens": 4, "n": 3, "temperature": 1.0, "ignore_eos": True}
    res = post(server, "/generate", {"text": "Hello", "sampling_params": sp}).json()
    assert len(res) == 3 and all(r["meta_info"]["completion_tokens"] == 4 for r in res)


def test_generate_stream_cumulative(server):
    body = {"text": "The quick brown", "sampling_params": GREEDY, "stream": True}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["text"] for c in chunks]
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    plain = post(server, "/generate", {"text": "The quick brown", "sampling_params": GREEDY})
    assert chunks[-1]["text"] == plain.json()["text"]
    assert chunks[-1]["output_ids"] == plain.json()["output_ids"]


def test_generate_stream_batch_has_index(server):
    body = {"text": ["a", "b"], "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    finals = {e["index"]: e for e in events[:-1] if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]


def test_generate_logprobs_positions(server):
    body = {
        "text": "The quick brown fox",
        "sampling_params": {**GREEDY, "max_new_tokens": 3},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = post(server, "/generate", body).json()["meta_info"]
    n_prompt = meta["prompt_tokens"]
    inp, out = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == n_prompt and inp[0][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in inp[1:])
    assert len(out) == 3 and all(len(t) == 3 and isinstance(t[2], str) for t in out)
    assert len(meta["output_top_logprobs"]) == 3
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    # greedy: the chosen token is the most likely one
    assert all(abs(t[0] - top[0][0]) < 1e-4 for t, top in zip(out, meta["output_top_logprobs"]))


def test_max_new_tokens_zero_prefill_only(server):
    body = {
        "text": "Paris is the capital",
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    res = post(server, "/generate", body).json()
    assert res["text"] == "" and res["output_ids"] == []
    meta = res["meta_info"]
    assert meta["completion_tokens"] == 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]


def test_health_and_info(server):
    assert requests.get(server.url + "/health").status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = requests.get(server.url + path).json()
        assert info["model_path"] == server.server_args.model_path
        assert info["tokenizer_path"] and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = requests.get(server.url + path).json()
        assert info["max_total_tokens"] == 4096 and "version" in info
        assert "api_key" not in info and info["num_running_reqs"] >= 0


def test_tokenize_detokenize_roundtrip(server):
    tok = requests.post(server.url + "/tokenize", json={"prompt": "Paris is nice"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    text = requests.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["text"] == "Paris is nice"
    bad = requests.post(server.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and "tokens" in bad.json()["error"]["message"]


def test_flush_cache_and_abort(server):
    assert requests.post(server.url + "/flush_cache").status_code == 200
    body = {
        "text": "Long one",
        "rid": "long-abort-me",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
        "stream": True,
    }
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith(b"data: ")
        busy = requests.post(server.url + "/flush_cache")
        assert busy.status_code == 400 and "flush_cache" in busy.json()["error"]["message"]
        ok = requests.post(server.url + "/abort_request", json={"rid": "long-abort-me"})
        assert ok.status_code == 200
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle_and_intact(server.url)
    assert requests.post(server.url + "/flush_cache").status_code == 200


def test_abort_non_streaming_request(server):
    body = {
        "text": "x",
        "rid": "abort-blocking",
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True},
    }
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, "/generate", body)))
    t.start()
    deadline = time.monotonic() + 30
    while requests.get(server.url + "/server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    requests.post(server.url + "/abort_request", json={"rid": "abort-blocking"})
    t.join(30)
    assert result["r"].status_code == 200
    assert result["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


# --------------------------------------------------------------------------- disconnects
LONG = {"max_new_tokens": 900, "ignore_eos": True}  # 900 tokens unless aborted
# A request that was aborted generated fewer than its 900 tokens. How many fewer depends on
# how fast the server decodes against how soon the disconnect is noticed (a speed, which
# load changes), so that is not asserted; a leaving client must not cost the whole decode.


def wait_running(url: str) -> None:
    deadline = time.monotonic() + 30
    while requests.get(url + "/server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)


def test_stream_disconnect_aborts_the_request(server):
    before = wait_idle_and_intact(server.url)["generated_tokens"]
    body = {"text": "bye", "sampling_params": LONG, "stream": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/generate", json=body) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(3))
    info = wait_idle_and_intact(server.url)  # the scheduler dropped it and freed its KV
    assert info["generated_tokens"] - before < LONG["max_new_tokens"]


def test_openai_stream_disconnect_aborts_the_request(server):
    before = wait_idle_and_intact(server.url)["generated_tokens"]
    body = {
        "model": server.server_args.served_model_name,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            next(r.iter_lines())
    info = wait_idle_and_intact(server.url)
    assert info["generated_tokens"] - before < LONG["max_new_tokens"]


def test_non_streaming_disconnect_aborts_the_request(server):
    import socket
    from urllib.parse import urlparse

    before = wait_idle_and_intact(server.url)["generated_tokens"]
    payload = json.dumps({"text": "wait", "sampling_params": LONG}).encode()
    url = urlparse(server.url)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    wait_running(server.url)
    sock.close()
    info = wait_idle_and_intact(server.url)
    assert info["generated_tokens"] - before < LONG["max_new_tokens"]


def test_metrics(server):
    post(server, "/generate", {"text": "metrics", "sampling_params": GREEDY})
    text = requests.get(server.url + "/metrics").text
    for name in (
        "loom:num_requests_total",
        "loom:prompt_tokens_total",
        "loom:generation_tokens_total",
        "loom:num_running_reqs",
        "loom:num_queue_reqs",
        "loom:cache_hit_rate",
        "loom:time_to_first_token_seconds_bucket",
        "loom:inter_token_latency_seconds_bucket",
        "loom:e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#") and "{" in line
    }
    assert values["loom:num_requests_total"] >= 1
    assert values["loom:generation_tokens_total"] >= 6


def test_native_errors_name_the_field(server):
    cases = [
        ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "a", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"text": "a", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": ""}, "prompt is empty"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({"text": 5}, "text"),
        ({"text": "a", "sampling_params": {"regex": "(a+"}}, "regex"),
        ({"text": "a", "sampling_params": {"unknown_field": 1}}, "sampling_params.unknown_field"),
        ({"text": "a", "lora_path": "/some/adapter"}, "lora_path"),
    ]
    for body, needle in cases:
        r = post(server, "/generate", body)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], (body, r.text)
        r = post(server, "/generate", {**body, "stream": True})
        assert r.status_code == 400, (body, r.text)
    wait_idle_and_intact(server.url)


def test_cli_help_documents_flags():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "from loom.cli import main; main()", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for flag in ("--model-path", "--port", "--api-key", "--enable-metrics", "--chat-template"):
        assert flag in out.stdout
    assert "KV cache size in tokens" in out.stdout
