"""Programs on a real Engine (tiny random model, ChatML template): the shared language suite
(tests/lang_suite.py, also run over HTTP) plus what only the in-process engine shows — select
scores against the engine's own prompt logprobs, cache reuse by forks, concurrency."""

from __future__ import annotations

import pytest

import loom as sgl
from tests.lang_suite import CHECKS


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # Pages of 4 tokens: cache hits are whole pages, which the fork test accounts for.
    eng = sgl.Engine(tiny_model_dir("llama"), max_total_tokens=4096, page_size=4)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def backend(engine):
    from loom.backends.engine import as_backend

    return as_backend(engine)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_language_suite(backend, check):
    check(backend)


def test_template_from_tokenizer(backend):
    t = backend.get_chat_template()
    assert t.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.stop_str == ("<|im_end|>",)


def test_select_scores_are_the_runtimes_logprobs(engine, backend):
    prompt = "The capital of France is "
    choices = ["Paris", "Berlin", "the lazy dog"]

    @sgl.function
    def pick(s):
        s += prompt + sgl.select("city", choices=choices)

    state = pick.run(backend=engine)
    assert state["city"] in choices
    meta = state.get_meta_info("city")
    split = meta["select_prefix_tokens"]
    for choice, got in zip(choices, meta["input_token_logprobs"]):
        ids = backend.tokenize([prompt + choice])[0]
        assert [t[1] for t in got] == ids[split:]
        ref = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=split,
        )["meta_info"]["input_token_logprobs"]
        assert [t[0] for t in got] == pytest.approx([t[0] for t in ref], abs=1e-4)


def test_fork8_branches_hit_the_shared_prefix(engine, backend):
    prefix = "Paris is the capital of France. Berlin is the capital of Germany. " * 3

    @sgl.function
    def tree(s):
        s += prefix
        forks = s.fork(8)
        forks += lambda i: f"Idea {i}:" + sgl.gen("idea", max_tokens=3)
        forks.join()

    state = tree.run(backend=engine, temperature=0.7)
    shared = len(backend.tokenize([prefix])[0])
    page = engine.server_args.page_size
    assert len(state["idea"]) == 8
    for meta in state.get_meta_info("idea"):
        assert meta["cached_tokens"] >= shared // page * page


def test_control_functions(engine):
    assert "page_size" in sgl.get_server_info(engine)
    assert sgl.flush_cache(engine) is True


@pytest.fixture(scope="module")
def bundled_engine():
    eng = sgl.Engine()  # the bundled model
    yield eng
    eng.shutdown()


def test_fork8_generations_share_decode_batches(bundled_engine):
    from loom.backends.engine import as_backend
    from tests.lang_concurrency import check_fork8_runs_batched

    check_fork8_runs_batched(bundled_engine, as_backend(bundled_engine).tokenize)
