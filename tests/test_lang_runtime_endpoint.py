"""Programs over HTTP against a loom server running the tiny model: the shared language suite
(tests/lang_suite.py, also run in-process) on RuntimeEndpoint (native API), and the OpenAI
backend (/v1)."""

from __future__ import annotations

import pytest

import loom as sgl
from tests.lang_suite import CHECKS


@pytest.fixture(scope="module")
def runtime(tiny_server):
    return tiny_server  # conftest: one tiny-llama server (an sgl.Runtime) shared by readers


@pytest.fixture(scope="module")
def endpoint(runtime):
    return sgl.RuntimeEndpoint(runtime.url)


@pytest.mark.parametrize("check", CHECKS, ids=lambda f: f.__name__.removeprefix("check_"))
def test_language_suite(endpoint, check):
    check(endpoint)


def test_runtime_endpoint_setup_and_control(runtime, endpoint):
    assert endpoint.get_chat_template().stop_str == ("<|im_end|>",)  # from the model folder

    @sgl.function
    def prog(s):
        s += sgl.user("Pick a city.")
        with s.assistant():
            s += "City: " + sgl.select("city", choices=["Paris", "Berlin"])
            s += " because" + sgl.gen("why", max_tokens=4)

    sgl.set_default_backend(runtime)  # a Runtime is wrapped in a RuntimeEndpoint
    try:
        state = prog.run(temperature=0)
    finally:
        sgl.global_config.default_backend = None
    assert state["city"] in ("Paris", "Berlin")
    assert state.messages()[-1]["content"].startswith("City: " + state["city"])
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
