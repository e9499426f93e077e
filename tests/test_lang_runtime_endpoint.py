"""Programs over HTTP: RuntimeEndpoint (native API) and the OpenAI backend (/v1) against a
loom server running the tiny model."""

from __future__ import annotations

import asyncio

import pytest

import loom as sgl


@pytest.fixture(scope="module")
def runtime(tiny_model_dir):
    rt = sgl.Runtime(tiny_model_dir("llama"), max_total_tokens=4096)
    yield rt
    rt.shutdown()


def test_runtime_endpoint_programs(runtime):
    endpoint = sgl.RuntimeEndpoint(runtime.url)
    assert endpoint.get_chat_template().stop_str == ("<|im_end|>",)  # from the model folder

    @sgl.function
    def prog(s):
        s += sgl.user("Pick a city.")
        with s.assistant():
            s += "City: " + sgl.select("city", choices=["Paris", "Berlin"])
            s += " because" + sgl.gen("why", max_tokens=4)
        forks = s.fork(3)
        forks += lambda i: f" Option {i}:" + sgl.gen("opt", max_tokens=3)
        forks.join()

    sgl.set_default_backend(runtime)  # a Runtime is wrapped in a RuntimeEndpoint
    try:
        state = prog.run(temperature=0)
    finally:
        sgl.global_config.default_backend = None
    assert state["city"] in ("Paris", "Berlin")
    assert state.messages()[-1]["content"].startswith("City: " + state["city"])
    assert len(state["opt"]) == 3
    meta = state.get_meta_info("city")
    split = meta["select_prefix_tokens"]
    prompt = state.text().split("City: ")[0] + "City: "
    ids = endpoint.tokenize([prompt + state["city"]])[0]
    chosen = meta["input_token_logprobs"][["Paris", "Berlin"].index(state["city"])]
    assert [t[1] for t in chosen] == ids[split:]

    @sgl.function
    def short(s, q):
        s += q + sgl.gen("a", max_tokens=5)

    st = short.run(q="Stream: ", backend=endpoint, stream=True, temperature=0)
    assert "".join(st.text_iter("a")) == st["a"]
    again = asyncio.run(short.run_async(q="Stream: ", backend=endpoint, temperature=0))
    assert again["a"] == st["a"]
    assert isinstance(endpoint.get_server_info(), dict)
    assert endpoint.flush_cache()


def test_openai_backend(runtime):
    pytest.importorskip("openai")
    base = runtime.url + "/v1"
    model = runtime.server_args.served_model_name or runtime.server_args.model_path
    completion = sgl.OpenAI(model, is_chat_model=False, base_url=base)
    chat = sgl.OpenAI(model, is_chat_model=True, base_url=base)

    @sgl.function
    def pick(s):
        s += "The capital of France is " + sgl.select("c", choices=["Paris", "Berlin", "Rome"])
        s += "." + sgl.gen("more", max_tokens=3)

    state = pick.run(backend=completion, temperature=0)
    assert state["c"] in ("Paris", "Berlin", "Rome")
    assert completion.echo_logprobs, "the server echoes prompt logprobs"
    assert len(state.get_meta_info("c")["normalized_prompt_logprobs"]) == 3

    @sgl.function
    def talk(s):
        s += sgl.user("Say hi.")
        s += sgl.assistant(sgl.gen("hi", max_tokens=4))
        s += sgl.user("Yes or no?")
        s += sgl.assistant(sgl.select("yn", choices=["yes", "no"]))

    state = talk.run(backend=chat, temperature=0)  # select falls back to generation
    assert isinstance(state["hi"], str) and state["yn"] in ("yes", "no")
    assert "generated" in state.get_meta_info("yn")
    templated = sgl.OpenAI(model, is_chat_model=True, base_url=base, chat_template="chatml")
    state = talk.run(backend=templated, temperature=0)  # select scores the rendered text
    assert state["yn"] in ("yes", "no")
    assert len(state.get_meta_info("yn")["normalized_prompt_logprobs"]) == 2


def test_fork8_generations_share_decode_batches():
    from tests.lang_concurrency import check_fork8_runs_batched

    rt = sgl.Runtime()  # the bundled model, over HTTP
    try:
        endpoint = sgl.RuntimeEndpoint(rt.url)
        check_fork8_runs_batched(endpoint, endpoint.tokenize)
    finally:
        rt.shutdown()
