"""Programs on a real Engine (tiny random model, ChatML template): what the runtime makes
checkable without a trained model — shapes, selection mechanics, cache reuse, concurrency."""

from __future__ import annotations

import asyncio

import pytest

import loom as sgl


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


def test_template_from_tokenizer(backend):
    t = backend.get_chat_template()
    assert t.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.stop_str == ("<|im_end|>",)


def test_multi_turn_roles_and_stop(engine):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        for q in ("Hi?", "Bye?"):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen("a", max_tokens=6, stop=["\n"]))

    state = chat.run(backend=engine, temperature=0)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[-1]["content"] == state["a"].lstrip()
    assert "\n" not in state["a"] and "<|im_end|>" not in state["a"]
    assert state.text().startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    meta = state.get_meta_info("a")
    assert meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 10


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
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert state["city"] == choices[best]
    for method in (sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        st = sgl.function(
            lambda s, m=method: s.__iadd__(prompt + sgl.select("c", choices, choices_method=m))
        ).run(backend=engine)
        assert st["c"] in choices


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


def test_run_batch_stream_and_async(engine):
    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=4)

    questions = [f"What is {i} + {i}?" for i in range(6)]
    states = qa.run_batch([{"question": q} for q in questions], backend=engine, temperature=0)
    for q, st in zip(questions, states):
        assert st.text() == f"Q: {q}\nA:" + st["answer"]

    state = qa.run(question="Stream?", backend=engine, stream=True, max_new_tokens=8, temperature=0)
    chunks = list(state.text_iter("answer"))
    assert "".join(chunks) == state["answer"]

    async def main():
        sts = await asyncio.gather(
            *(qa.run_async(question=q, backend=engine, temperature=0) for q in questions[:3])
        )
        st = await qa.run_async(question="Async?", backend=engine, stream=True)
        text = "".join([c async for c in st.text_async_iter()])
        return sts, st, text

    sts, st, text = asyncio.run(main())
    # greedy decoding is batch-invariant: async answers equal the threaded ones
    assert [s["answer"] for s in sts] == [s["answer"] for s in states[:3]]
    assert text == st.text()


def test_runtime_error_surfaces(engine):
    @sgl.function
    def bad(s):
        s += "x" + sgl.gen("v", top_p=5.0)

    with pytest.raises(ValueError, match="top_p"):
        bad.run(backend=engine)


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
