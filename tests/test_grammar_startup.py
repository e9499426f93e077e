"""The grammar backend (the mask engine's tokenizer tables: seconds at Llama 3's 128k
vocabulary, ~240 MB resident at Gemma 3's 262k) is built on a thread by the first constrained
request; with --grammar-backend-eager it is built at start-up and the server reports healthy only
once it is ready, so the first constrained request pays only its own compile
(runtime/scheduler/grammar_queue.py). benchmarks/bench_grammar_first_request.py measures the
first request's extra TTFT (--lazy: with the build)."""

from __future__ import annotations

import json

import pytest
import requests

from loom.runtime.scheduler.grammar_queue import GrammarQueue
from loom.runtime.server.runtime_client import Runtime
from tests.server_helpers import server_info

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def llama3_vocab_model(tmp_path_factory) -> str:
    pytest.importorskip("llama_models")
    from tests.tiny_models import build_llama3_vocab_model

    return build_llama3_vocab_model(tmp_path_factory.mktemp("llama3_vocab"))


def test_the_tables_are_built_before_the_server_is_healthy(llama3_vocab_model):
    """The first answer after /health already finds the backend built (at 128k the build
    takes seconds, so a server that reported healthy first would be caught here)."""
    with Runtime(llama3_vocab_model, max_total_tokens=2048, cpu_threads=1,
                 grammar_backend_eager=True) as rt:  # fmt: skip
        info = server_info(rt.url)
        assert info["grammar_engine_ready"] is True
        assert info["vocab_size"] == 128_256
        body = {
            "text": "Name and age as JSON:",
            "sampling_params": {
                "json_schema": json.dumps(SCHEMA),
                "max_new_tokens": 48,
                "temperature": 0,
            },
        }
        res = requests.post(rt.url + "/generate", json=body, timeout=300)
        assert res.status_code == 200, res.text


def test_the_queue_builds_once_and_waits_for_the_started_build(tiny_model_dir):
    from loom.runtime.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_model_dir("llama"))
    queue = GrammarQueue(tok, 384, {2}, timeout=30.0)
    assert not queue.ready
    queue.start()
    queue.wait_ready()
    assert queue.ready
    built = queue._building.result()
    assert queue.backend is built  # the started build is the one used, not a second one
    queue.close()
    assert GrammarQueue(None, 384, {2}, timeout=30.0).ready is False  # no tokenizer: no grammar
    none = GrammarQueue(None, 384, {2}, timeout=30.0)
    none.start()
    none.wait_ready()
    assert none._building is None


def test_the_backend_is_built_by_the_first_constrained_request(tiny_model_dir):
    """By default a scheduler holds no grammar backend until a constrained request comes; that
    request then builds it and is answered right (its output matches its regex), and a plain
    request beside it is served; the eager flag builds it at start-up."""
    import re

    from tests.runtime_helpers import make_scheduler, run_all, submit

    path = tiny_model_dir("llama")
    sched = make_scheduler(path, max_total_tokens=2048, grammar_backend_eager=False)
    try:
        assert sched.grammar_queue._building is None and sched.grammar_queue._backend is None
        assert sched.get_state()["grammar_engine_ready"] is False
        plain = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
        submit(sched, "plain", [5, 6, 7, 8], plain)
        submit(sched, "re", [5, 6, 7, 8], {"max_new_tokens": 12, "temperature": 0,
                                           "regex": "[0-9]{3}-[0-9]{2}"})  # fmt: skip
        results = run_all(sched)
        assert re.fullmatch("[0-9]{3}-[0-9]{2}", results["re"].text), results["re"].text
        assert len(results["plain"].ids) == 6
        assert sched.get_state()["grammar_engine_ready"] is True
    finally:
        sched.close()
    eager = make_scheduler(path, max_total_tokens=2048, grammar_backend_eager=True)
    try:
        assert eager.grammar_queue._building is not None  # started with the scheduler
        eager.grammar_queue.wait_ready()
        assert eager.get_state()["grammar_engine_ready"] is True
    finally:
        eager.close()
