"""sglang-router (SGLang's Rust router, from its wheel) in PD mode over a loom prefill worker
and a loom decode worker (bundled model), compared with a colocated loom worker.

Single, batched (input_ids lists: sglang-router 0.3.2 refuses text lists on /generate) and
n > 1 requests, native and OpenAI, with logprobs: greedy outputs and logprobs equal the
colocated worker's, with the same lengths (the router prepends the prefill worker's prompt
logprobs to the decode worker's empty list, or the decode worker keeps its copy where the
router does not merge: batches and streams); the KV bytes each request moved are counted on
both sides; an abort on either side frees the KV on both."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

pytest.importorskip("sglang_router")

from loom.runtime.router.process import RouterProcess  # noqa: E402
from loom.runtime.server.runtime_client import Runtime, free_port  # noqa: E402
from tests.server_helpers import server_info, wait_idle_and_intact  # noqa: E402

GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
LOGPROBS = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
ATOL = 1e-4  # the same model and kernels on another server: only summation order may differ


@pytest.fixture(scope="module")
def pd():
    common = dict(max_total_tokens=4096, disaggregation_timeout=20)
    bootstrap = free_port()
    prefill = Runtime(
        None, disaggregation_mode="prefill", disaggregation_bootstrap_port=bootstrap, **common
    )
    decode = Runtime(None, disaggregation_mode="decode", **common)
    colocated = Runtime(None, max_total_tokens=4096)
    router = RouterProcess(
        [],
        "--pd-disaggregation",
        "--prefill",
        prefill.url,
        str(bootstrap),
        "--decode",
        decode.url,
        "--policy",
        "round_robin",
        kind="sglang",
    )
    yield prefill, decode, colocated, router, bootstrap
    router.shutdown()
    for server in (decode, prefill, colocated):
        server.shutdown(timeout=60)


def _post(url: str, path: str, body: dict):
    res = requests.post(url + path, json=body, timeout=120)
    assert res.status_code == 200, res.text
    return res.json()


def _values(triples) -> list:
    return [lp for lp, _, _ in triples]


def _same_answer(got: dict, want: dict) -> None:
    assert (got["text"], got["output_ids"]) == (want["text"], want["output_ids"])
    g, w = got["meta_info"], want["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert len(g[key]) == len(w[key]), key
        assert [t for _, t, _ in g[key]] == [t for _, t, _ in w[key]], key
        first = 1 if key == "input_token_logprobs" else 0  # the first prompt token has none
        assert _values(g[key])[first:] == pytest.approx(_values(w[key])[first:], abs=ATOL)
    for key in ("input_top_logprobs", "output_top_logprobs"):
        assert len(g[key]) == len(w[key]), key


def _kv(url: str) -> tuple[int, int, int]:
    info = server_info(url)
    return info["disagg_transfers"], info["disagg_kv_tokens"], info["disagg_kv_bytes"]


def test_native_single_batched_and_n_identical_to_colocated(pd):
    prefill, decode, colocated, router, _ = pd
    before = _kv(decode.url), _kv(prefill.url)
    single = {"text": "The capital of France is", "sampling_params": GREEDY, **LOGPROBS}
    got = _post(router.url, "/generate", single)
    want = _post(colocated.url, "/generate", single)
    _same_answer(got, want)
    after = _kv(decode.url), _kv(prefill.url)
    # one transfer of the prompt's tokens the decode side did not cache, counted on both
    # sides: K and V bytes on the decode side, what went on the wire (with the header) on the
    # prefill side
    (dt, dtok, dbytes), (pt, ptok, pbytes) = (
        [a - b for a, b in zip(after[side], before[side])] for side in range(2)
    )
    meta = got["meta_info"]
    assert dt == pt == 1
    assert dtok == ptok == meta["prompt_tokens"] - meta["cached_tokens"] > 0
    assert dbytes > 0 and dbytes % dtok == 0 and pbytes >= dbytes
    print(f"KV moved for a {meta['prompt_tokens']}-token prompt: {dbytes} bytes")
    batch = {"input_ids": [[5, 6, 7, 8, 9], [10, 11, 12]], "sampling_params": GREEDY, **LOGPROBS}
    got = _post(router.url, "/generate", batch)
    want = _post(colocated.url, "/generate", batch)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        _same_answer(g, w)
    n2 = {"text": "Once upon a time", "sampling_params": {**GREEDY, "n": 2}}
    got = _post(router.url, "/generate", n2)
    want = _post(colocated.url, "/generate", n2)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_native_stream_with_logprobs_identical_to_colocated(pd):
    _, _, colocated, router, _ = pd
    body = {"text": "Tell me about the sea.", "sampling_params": GREEDY, **LOGPROBS}
    want = _post(colocated.url, "/generate", body)
    events = []
    with requests.post(
        router.url + "/generate", json={**body, "stream": True}, stream=True, timeout=120
    ) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
    assert events
    _same_answer(events[-1], want)  # cumulative chunks: the last one is the whole answer


def test_openai_identical_to_colocated(pd):
    _, _, colocated, router, _ = pd
    model = requests.get(colocated.url + "/get_model_info", timeout=30).json()["model_path"]
    comp = {
        "model": model,
        "prompt": ["a b c", "The quick brown fox"],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
    }
    got = _post(router.url, "/v1/completions", comp)["choices"]
    want = _post(colocated.url, "/v1/completions", comp)["choices"]
    assert [c["text"] for c in got] == [c["text"] for c in want]
    for g, w in zip(got, want):
        assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
        assert g["logprobs"]["token_logprobs"] == pytest.approx(
            w["logprobs"]["token_logprobs"], abs=ATOL
        )
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
    }
    got = _post(router.url, "/v1/chat/completions", chat)["choices"]
    want = _post(colocated.url, "/v1/chat/completions", chat)["choices"]
    assert [c["message"]["content"] for c in got] == [c["message"]["content"] for c in want]
    for g, w in zip(got, want):
        gl, wl = g["logprobs"]["content"], w["logprobs"]["content"]
        assert [x["token"] for x in gl] == [x["token"] for x in wl]
        assert [x["logprob"] for x in gl] == pytest.approx([x["logprob"] for x in wl], abs=ATOL)


def test_abort_on_the_decode_side_frees_kv_on_both(pd):
    prefill, decode, _, router, _ = pd
    rid = "abort-on-decode"
    body = {
        "text": "Write a very long story.",
        "rid": rid,
        "sampling_params": {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True},
    }
    done = {}
    thread = threading.Thread(
        target=lambda: done.update(
            r=requests.post(router.url + "/generate", json=body, timeout=120)
        )
    )
    thread.start()
    deadline = time.monotonic() + 60
    while server_info(decode.url)["num_running_reqs"] == 0:
        assert time.monotonic() < deadline and thread.is_alive(), done
        time.sleep(0.05)
    assert requests.post(decode.url + "/abort_request", json={"rid": rid}, timeout=30).ok
    thread.join(60)
    meta = done["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < 3000
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_abort_on_the_prefill_side_frees_kv_on_both(pd):
    """The prefill half is sent (and held, its KV computed) before the decode half exists;
    aborting it there frees its KV, and the decode half that asks for it later is failed
    (its KV slots freed) instead of waiting."""
    prefill, decode, _, _, bootstrap = pd
    room = 123456789
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
    body = {"text": "An aborted prompt " * 8, "rid": "abort-on-prefill", "sampling_params": GREEDY}
    done = {}
    thread = threading.Thread(
        target=lambda: done.update(
            r=requests.post(prefill.url + "/generate", json={**body, **fields}, timeout=120)
        )
    )
    thread.start()
    deadline = time.monotonic() + 60
    while "held" not in done:
        info = server_info(prefill.url)
        if info["kv_available_tokens"] + info["cache_size_tokens"] < info["max_total_tokens"]:
            done["held"] = True  # computed and holding its KV for the decode side
        assert time.monotonic() < deadline, info
        time.sleep(0.05)
    assert requests.post(
        prefill.url + "/abort_request", json={"rid": "abort-on-prefill"}, timeout=30
    ).ok
    thread.join(60)
    assert done["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_idle_and_intact(prefill.url)
    late = requests.post(decode.url + "/generate", json={**body, **fields}, timeout=60)
    reason = late.json()["meta_info"]["finish_reason"]  # failed at once, not after a timeout
    assert reason["type"] == "abort" and reason["status_code"] == 502, reason
    assert "aborted on the prefill server" in reason["message"]
    for server in (prefill, decode):
        wait_idle_and_intact(server.url)


def test_get_load_on_both_sides(pd):
    prefill, decode, _, router, _ = pd
    loads = router.get("/get_loads").json()["workers"]
    assert sorted(x["worker"] for x in loads) == sorted([prefill.url, decode.url])
    assert all(x["load"] >= 0 for x in loads), loads


TASKS = {
    "loom_pd_choice": """
task: loom_pd_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""",
    "loom_pd_gen": """
task: loom_pd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "seven"], "answer": 0},
    {"question": "The sky is", "choices": ["green", "blue"], "answer": 1},
]


def test_lm_eval_sglang_generate_through_the_pd_router(pd, tmp_path, monkeypatch):
    """lm-eval's `sglang-generate` model (tokenized requests: input_ids batches, prompt
    logprobs for multiple choice) through the PD router gives the colocated worker's
    per-sample answers: same log-likelihoods, same generations."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, _, colocated, router, _ = pd
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({**d, "target": ""}) + "\n" for d in DOCS))
    for name, text in TASKS.items():
        (tmp_path / f"{name}.yaml").write_text(text.format(data=data))
    model = requests.get(colocated.url + "/get_model_info", timeout=30).json()["model_path"]
    # our task files only: lm-eval's ~14.7k bundled task configs, which the default manager
    # indexes first (~10 s of CPU, once per manager), play no part here
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)

    def run(url: str) -> dict:
        out = lm_eval.simple_evaluate(
            model="sglang-generate",
            model_args=f"base_url={url}/generate,tokenizer={model},tokenized_requests=True",
            tasks=list(TASKS),
            task_manager=tasks,
            log_samples=True,
        )
        return {
            task: [(s["doc_id"], s["filtered_resps"]) for s in samples]
            for task, samples in out["samples"].items()
        }

    via_pd, colo = run(router.url), run(colocated.url)
    assert set(via_pd) == set(TASKS)
    gen = "loom_pd_gen"
    assert via_pd[gen] == colo[gen] and all(r != [""] for _, r in via_pd[gen])
    choice = "loom_pd_choice"
    for (i, got), (j, want) in zip(via_pd[choice], colo[choice]):
        assert i == j and len(got) == len(want) == 2
        assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-3)
