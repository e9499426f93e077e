"""Limits and hardening of the HTTP edge: request fan-out, body size, context and logprob
bounds, rid checks before anything is sent, tokenization off the event loop, the API key."""

from __future__ import annotations

import asyncio
import json
import threading
import types

import psutil
import pytest
import requests

from loom.runtime.io_struct import AbortReq, GenerateReqInput, TokenizedGenerateReq, decoder
from loom.runtime.server.runtime_client import Runtime
from loom.runtime.server_args import ServerArgs
from loom.runtime.tokenizer_manager import TokenizerManager

CONTEXT = 64
MAX_BATCH = 8
MAX_BODY = 8192


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Runtime(
        tiny_model_dir("llama"),
        max_total_tokens=4096,
        context_length=CONTEXT,
        max_batch_request=MAX_BATCH,
        max_request_body_bytes=MAX_BODY,
        # eager: test_a_running_rid_refuses_the_whole_batch needs its 58-token stream still
        # running while two more requests arrive; the compiled forward decodes it in ~60 ms
        cpu_forward="eager",
    ) as rt:
        yield rt


def post(server, body, **kw):
    return requests.post(server.url + "/generate", json=body, timeout=120, **kw)


def error(res) -> str:
    return res.json()["error"]["message"]


def gen(max_new: int = 4, **extra) -> dict:
    return {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **extra}


# --------------------------------------------------------------------------- rids
def test_duplicate_rid_in_a_batch_sends_nothing(server):
    res = post(server, {"input_ids": [[1, 2, 3], [4, 5, 6]], "rid": ["a", "a"]})
    assert res.status_code == 400 and "rid" in error(res), res.text
    # nothing stayed registered: "a" is free for the next request
    res = post(server, {"input_ids": [1, 2, 3], "rid": "a", "sampling_params": gen()})
    assert res.status_code == 200, res.text
    assert res.json()["meta_info"]["id"] == "a"


def test_a_running_rid_refuses_the_whole_batch(server):
    body = {"input_ids": [7, 8, 9], "rid": "long", "sampling_params": gen(58), "stream": True}
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        lines = r.iter_lines()
        assert next(x for x in lines if x).startswith(b"data: ")
        res = post(server, {"input_ids": [[1, 2], [3, 4]], "rid": ["fresh", "long"]})
        assert res.status_code == 400 and "'long'" in error(res), res.text
        # "fresh" was not sent with it: it can run now, while "long" still runs
        res = post(server, {"input_ids": [1, 2], "rid": "fresh", "sampling_params": gen()})
        assert res.status_code == 200, res.text
        list(lines)


def _manager(send_fails_at: int | None = None, tokenizer=None) -> tuple[TokenizerManager, list]:
    """A TokenizerManager with a fake socket that records what is sent (and can fail)."""
    args = ServerArgs(max_batch_request=MAX_BATCH)
    tm = TokenizerManager(args, None, tokenizer, context_len=CONTEXT, vocab_size=100)
    sent: list = []
    dec = decoder(TokenizedGenerateReq | AbortReq)

    def send(data: bytes) -> None:
        msg = dec.decode(data)
        if isinstance(msg, TokenizedGenerateReq) and len(sent) == send_fails_at:
            raise OSError("socket closed")
        sent.append(msg)

    tm.send_sock = types.SimpleNamespace(send=send)
    return tm, sent


def test_a_failure_part_way_through_sending_aborts_what_was_sent():
    tm, sent = _manager(send_fails_at=1)

    async def run():
        await tm.generate(GenerateReqInput(input_ids=[[1, 2], [3, 4]], rid=["x", "y"]))

    with pytest.raises(OSError):
        asyncio.run(run())
    assert [type(m).__name__ for m in sent] == ["TokenizedGenerateReq", "AbortReq"]
    assert sent[1].rid == "x" and tm.rid_to_state == {}


def test_tokenization_runs_off_the_event_loop():
    threads: list[str] = []

    class Tokenizer:
        def encode(self, text):
            threads.append(threading.current_thread().name)
            return [1, 2, 3]

    tm, _ = _manager(tokenizer=Tokenizer())

    async def run():
        states, _ = await tm.normalize(GenerateReqInput(text=["a", "b"]))
        return states, threading.current_thread().name

    states, loop_thread = asyncio.run(run())
    assert len(states) == 2 and threads and all(t.startswith("loom-tokenize") for t in threads)
    assert loop_thread not in threads


# --------------------------------------------------------------------------- fan-out, size
def test_max_batch_request_counts_prompts_times_n(server):
    body = {"input_ids": [[1, 2]] * 3, "sampling_params": gen(1, n=3)}
    res = post(server, body)  # 9 generations > 8
    assert res.status_code == 400 and "max-batch-request" in error(res), res.text
    body["sampling_params"]["n"] = 2
    res = post(server, body)
    assert res.status_code == 200 and len(res.json()) == 6


def test_body_size_limit(server):
    big = {"text": "x" * MAX_BODY, "sampling_params": gen(1)}
    res = post(server, big)
    assert res.status_code == 413 and "max-request-body-bytes" in error(res)
    # a chunked upload (no Content-Length) is cut off as it streams in
    data = json.dumps(big).encode()
    chunks = (data[i : i + 1000] for i in range(0, len(data), 1000))
    res = requests.post(server.url + "/generate", data=chunks, timeout=60)
    assert res.status_code == 413, res.text
    assert post(server, {"text": "hi", "sampling_params": gen(1)}).status_code == 200


def test_a_body_without_a_json_content_type_is_accepted(server):
    body = json.dumps({"input_ids": [1, 2, 3], "sampling_params": gen(2)})
    res = requests.post(server.url + "/generate", data=body, timeout=60)
    assert res.status_code == 200 and res.json()["meta_info"]["completion_tokens"] == 2
    res = requests.post(
        server.url + "/generate", data=body, headers={"Content-Type": "text/plain"}, timeout=60
    )
    assert res.status_code == 200


# --------------------------------------------------------------------------- context, logprobs
def test_max_new_tokens_is_capped_to_the_context(server):
    res = post(server, {"input_ids": [1] * 10, "sampling_params": gen(10**9)})
    assert res.status_code == 200, res.text
    meta = res.json()["meta_info"]
    assert meta["completion_tokens"] <= CONTEXT - 10
    res = post(server, {"input_ids": [1] * 10, "sampling_params": gen(60, min_new_tokens=60)})
    assert res.status_code == 400 and "min_new_tokens" in error(res)


def test_top_logprobs_num_is_bounded(server):
    body = {"input_ids": [1, 2], "return_logprob": True, "sampling_params": gen(1)}
    res = post(server, {**body, "top_logprobs_num": 129})
    assert res.status_code == 400 and "top_logprobs_num" in error(res)
    res = post(server, {**body, "top_logprobs_num": 5})
    assert res.status_code == 200
    assert len(res.json()["meta_info"]["output_top_logprobs"][0]) == 5


def test_logprob_start_len_as_sglang(server):
    ids = [5, 6, 7, 8]
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": gen(3)}

    def meta(start):
        res = post(server, {**body, "logprob_start_len": start})
        assert res.status_code == 200, res.text
        return res.json()["meta_info"]

    assert meta(-1)["input_token_logprobs"] == []  # SGLang: output logprobs only
    assert post(server, body).json()["meta_info"]["input_token_logprobs"] == []
    assert meta(len(ids))["input_token_logprobs"] == []  # allowed, as SGLang
    full = meta(0)
    assert [t for _, t, _ in full["input_token_logprobs"]] == ids
    assert full["input_token_logprobs"][0][0] is None
    assert [t for _, t, _ in meta(2)["input_token_logprobs"]] == ids[2:]
    assert full["output_token_logprobs_length"] == len(full["output_token_logprobs"]) == 3
    for bad in (len(ids) + 1, -2):
        res = post(server, {**body, "logprob_start_len": bad})
        assert res.status_code == 400 and "logprob_start_len" in error(res)


def test_stream_interval_sends_every_k_tokens(server):
    body = {"input_ids": [1, 2, 3], "sampling_params": gen(40, stream_interval=4), "stream": True}
    lengths = []
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                lengths.append(len(json.loads(line[6:])["output_ids"]))
    # A chunk goes out once >= 4 new tokens have arrived. Several steps' outputs can reach the
    # TokenizerManager together (4, 9, 10 and a single 10 were seen for 10 tokens), so a chunk
    # may carry more, never fewer; without the interval, single-token chunks show up.
    assert lengths[-1] == 40, lengths
    grown = [b - a for a, b in zip([0, *lengths[:-1]], lengths[:-1])]
    assert all(g >= 4 for g in grown), lengths


# --------------------------------------------------------------------------- API key, incremental
KEY = "s3cret-key-for-the-test"


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    """One more server for the server-wide flags the module server does not set: an API key
    and --incremental-streaming-output (one launch serves both tests)."""
    with Runtime(
        tiny_model_dir("llama"),
        max_total_tokens=1024,
        api_key=KEY,
        incremental_streaming_output=True,
    ) as rt:
        yield rt


def test_api_key_stays_off_command_lines_and_is_checked(keyed):
    rt = keyed
    tree = [psutil.Process(rt.pid), *psutil.Process(rt.pid).children(recursive=True)]
    assert len(tree) >= 3  # the server, its fork server and children
    for proc in tree:
        assert KEY not in " ".join(proc.cmdline()), proc.cmdline()
    body = {"input_ids": [1, 2], "sampling_params": gen(1)}
    url = rt.url + "/generate"
    assert requests.post(url, json=body, timeout=60).status_code == 401
    for wrong in (KEY[:-1], KEY + "x", ""):
        headers = {"Authorization": f"Bearer {wrong}"}
        assert requests.post(url, json=body, headers=headers, timeout=60).status_code == 401
    headers = {"Authorization": f"Bearer {KEY}"}
    assert requests.post(url, json=body, headers=headers, timeout=60).status_code == 200
    assert rt.generate("hi", gen(1))["meta_info"]["completion_tokens"] == 1


def test_incremental_streaming_output(keyed):
    body = {"input_ids": [1, 2, 3], "sampling_params": gen(40)}
    headers = {"Authorization": f"Bearer {KEY}"}
    url = keyed.url + "/generate"

    def chunks():
        out = []
        stream = {**body, "stream": True}
        with requests.post(url, json=stream, headers=headers, stream=True, timeout=60) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    out.append(json.loads(line[6:]))
        return out

    # the whole (greedy) answer: a non-streamed request returns it all, whatever the flag
    whole = requests.post(url, json=body, headers=headers, timeout=60).json()
    assert len(whole["output_ids"]) == 40
    # Several steps' outputs can reach the TokenizerManager together (6 tokens once came
    # as one chunk on an idle machine), so a stream of one chunk is asked for again.
    runs = [chunks()]
    while len(runs[-1]) == 1 and len(runs) < 4:
        runs.append(chunks())
    for incremental in runs:
        assert "".join(c["text"] for c in incremental) == whole["text"]
        assert sum((c["output_ids"] for c in incremental), []) == whole["output_ids"]
        assert all(c["output_ids"] for c in incremental)
    assert len(runs[-1]) > 1, [len(r) for r in runs]
