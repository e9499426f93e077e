"""PD disaggregation end to end: a prefill server and a decode server (tiny model) behind
`loom router --pd-disaggregation`; greedy text identical to a colocated scheduler, native and
OpenAI APIs, streaming, a client leaving mid-stream, and the KV transfer shrinking when the
decode side already caches a shared prefix."""

from __future__ import annotations

import json

import httpx
import pytest
import requests

from loom.runtime.router.process import RouterProcess
from loom.runtime.server.runtime_client import Runtime, free_port
from tests.runtime_helpers import make_scheduler, run_all, submit
from tests.server_helpers import server_info, wait_idle_and_intact

KV = 4096
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Paris is the capital of", 'Berlin {"name": "Alice"']
SHARED = "Thought: I should search. Action: search Observation: ok Final Answer: yes " * 3


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def pd(model):
    common = dict(dtype="float32", max_total_tokens=KV, page_size=4, disaggregation_timeout=20)
    prefill = Runtime(
        model, disaggregation_mode="prefill", disaggregation_bootstrap_port=free_port(), **common
    )
    decode = Runtime(model, disaggregation_mode="decode", **common)
    router = RouterProcess(
        [], "--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url
    )
    yield prefill, decode, router
    router.shutdown()
    decode.shutdown(timeout=60)
    prefill.shutdown(timeout=60)


@pytest.fixture(scope="module")
def reference(model):
    """The colocated answer for each prompt (one in-process scheduler, same model and pages)."""
    sched = make_scheduler(model, max_total_tokens=KV, page_size=4)
    out = {}
    for i, text in enumerate([*PROMPTS, SHARED + "one", SHARED + "two"]):
        submit(sched, f"r{i}", sched.tokenizer.encode(text), GREEDY)
        out[text] = run_all(sched)[f"r{i}"].text
    return out


def _kv_sent(url: str) -> int:
    return server_info(url)["disagg_kv_tokens"]


def test_pd_native_identical_to_colocated_and_cached_prefix_not_resent(pd, reference):
    prefill, decode, router = pd
    for text in PROMPTS:
        res = router.post("/generate", {"text": text, "sampling_params": GREEDY})
        assert res.status_code == 200, res.text
        assert res.json()["text"] == reference[text]
    sent = []
    for text in (SHARED + "one", SHARED + "two"):
        before = _kv_sent(prefill.url)
        res = router.post("/generate", {"text": text, "sampling_params": GREEDY})
        assert res.status_code == 200, res.text
        assert res.json()["text"] == reference[text]
        sent.append(_kv_sent(prefill.url) - before)
        prompt_len = res.json()["meta_info"]["prompt_tokens"]
    # the second shares the first's long prefix, which the decode side now caches
    assert sent[1] < sent[0] // 2, sent
    assert sent[1] + res.json()["meta_info"]["cached_tokens"] == prompt_len
    info = router.get("/get_server_info").json()
    assert {w["url"] for w in info["workers"]} == {prefill.url, decode.url}
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_pd_streaming_and_openai_through_the_router(pd, reference, model):
    prefill, decode, router = pd
    text = PROMPTS[1]
    body = {"text": text, "sampling_params": GREEDY, "stream": True}
    with requests.post(router.url + "/generate", json=body, stream=True, timeout=120) as res:
        assert res.status_code == 200
        events = [
            json.loads(line[6:])
            for line in res.iter_lines(decode_unicode=True)
            if line.startswith("data: {")
        ]
    assert events[-1]["text"] == reference[text]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    res = router.post(
        "/v1/completions",
        {"model": model, "prompt": text, "max_tokens": 10, "temperature": 0, "ignore_eos": True},
    )
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["text"] == reference[text]
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,  # sampled at the default temperature: EOS must not end it early
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with requests.post(router.url + "/v1/chat/completions", json=chat, stream=True) as res:
        assert res.status_code == 200, res.text
        lines = [line for line in res.iter_lines(decode_unicode=True) if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 4
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_pd_prompt_logprobs_once_batches_and_n_through_the_router(pd, reference):
    """loom router merges prompt logprobs as sglang-router does (the prefill answer's in front
    of the decode answer's empty list; streams and batches carry the decode server's copy):
    once, as long as the prompt, streamed or not; batches and n > 1 pair each generation with
    its own bootstrap room."""
    prefill, decode, router = pd
    lp = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    text = PROMPTS[0]
    res = router.post("/generate", {"text": text, "sampling_params": GREEDY, **lp})
    assert res.status_code == 200, res.text
    meta = res.json()["meta_info"]
    n = meta["prompt_tokens"]
    assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"]) == n
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has none
    assert len(meta["output_token_logprobs"]) == GREEDY["max_new_tokens"]
    body = {"text": text, "sampling_params": GREEDY, "stream": True, **lp}
    with requests.post(router.url + "/generate", json=body, stream=True, timeout=120) as res:
        events = [json.loads(x[6:]) for x in res.iter_lines() if x.startswith(b"data: {")]
    assert events and all(len(e["meta_info"]["input_token_logprobs"]) == n for e in events)
    assert events[-1]["text"] == reference[text]
    batch = {"text": PROMPTS, "sampling_params": {**GREEDY, "n": 2}, **lp}
    res = router.post("/generate", batch)
    assert res.status_code == 200, res.text
    outs = res.json()
    assert [o["text"] for o in outs] == [reference[t] for t in PROMPTS for _ in range(2)]
    for o in outs:
        meta = o["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_pd_client_leaving_and_refusals_free_kv_on_both(pd):
    prefill, decode, router = pd
    body = {
        "text": SHARED * 2,
        "sampling_params": {**GREEDY, "max_new_tokens": 2000},
        "stream": True,
    }
    with httpx.stream("POST", router.url + "/generate", json=body, timeout=60) as res:
        assert res.status_code == 200
        for _ in res.iter_lines():
            break  # leave after the first event
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)
    # a PD server refuses requests that do not come through the PD router, by field name
    res = requests.post(decode.url + "/generate", json={"text": "a", "sampling_params": GREEDY})
    assert res.status_code == 400
    assert res.json()["error"]["message"].startswith("bootstrap_host: required")
    # bootstrap fields: a value or a list of one per prompt / per generation, else a 400
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
    for room, why in (([1, 2, 3], "a list of 3 for 2 prompt(s)"), ([-1, 2], "an integer")):
        res = requests.post(
            decode.url + "/generate",
            json={"text": ["a", "b"], "sampling_params": GREEDY, **fields, "bootstrap_room": room},
        )
        assert res.status_code == 400, res.text
        assert res.json()["error"]["message"].startswith(f"bootstrap_room: {why}"), res.text
    # a bad request fails on both halves with the worker's 400, nothing leaks
    bad = {"text": "a", "sampling_params": {**GREEDY, "temperature": -1}}
    res = router.post("/generate", bad)
    assert res.status_code == 400 and "temperature" in res.text
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_pd_dead_prefill_worker_is_a_clear_error_and_decode_frees_kv(pd):
    _, decode, _ = pd
    dead = f"http://127.0.0.1:{free_port()}"
    flags = ["--pd-disaggregation", "--prefill", dead, str(free_port()), "--decode", decode.url]
    with RouterProcess([], *flags, "--health-check-interval", "600") as router:
        res = router.post("/generate", {"text": "hello", "sampling_params": GREEDY})
        assert res.status_code == 502
        assert res.json()["error"]["message"].startswith(f"prefill worker {dead} failed")
        body = {"text": "hello", "sampling_params": GREEDY, "stream": True}
        res = router.post("/generate", body)
        if res.status_code == 200:  # the decode stream started first: an error event ends it
            assert f"prefill worker {dead} failed" in res.text and "data: [DONE]" in res.text
        else:
            assert res.status_code == 502 and f"prefill worker {dead} failed" in res.text
    wait_idle_and_intact(decode.url)
