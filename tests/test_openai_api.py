"""The OpenAI-compatible API, driven by the official `openai` client (and requests for the
raw wire format), against one tiny-model server that requires an API key."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from loom.runtime.server.runtime_client import Runtime

KEY = "sk-loom-test"
MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Runtime(
        tiny_model_dir("llama"), max_total_tokens=4096, api_key=KEY, served_model_name=MODEL
    ) as rt:
        yield rt


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def raw(server, path, body):
    return requests.post(
        server.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
FIXED = {"ignore_eos": True}


# --------------------------------------------------------------------------- models, auth
def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_auth_required(server):
    for path in ("/v1/models", "/generate", "/server_info"):
        r = (
            requests.get(server.url + path)
            if path != "/generate"
            else requests.post(server.url + path, json={"text": "a"})
        )
        assert r.status_code == 401 and "authorization" in r.json()["error"]["message"]
    assert requests.get(server.url + "/health").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="a", max_tokens=1)
    assert "model" in str(e.value)
    # the model path is accepted as well as the served name
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS, max_tokens=1)


# --------------------------------------------------------------------------- completions
def test_completion_basic_and_usage(client):
    r = client.completions.create(
        model=MODEL, prompt="Paris is", max_tokens=5, temperature=0, extra_body=FIXED
    )
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    again = client.completions.create(
        model=MODEL, prompt="Paris is", max_tokens=5, temperature=0, extra_body=FIXED
    )
    assert again.choices[0].text == r.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_completion_prompt_list_n_and_token_ids(client):
    r = client.completions.create(
        model=MODEL, prompt=["a b", "c d e"], n=2, max_tokens=3, temperature=0, extra_body=FIXED
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy copies of prompt 0
    ids = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0, extra_body=FIXED
    )
    assert ids.choices[0].finish_reason == "length" and ids.usage.prompt_tokens == 3
    batch = client.completions.create(
        model=MODEL, prompt=[[5, 6], [7, 8, 9]], max_tokens=2, extra_body=FIXED
    )
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 5


def test_completion_logprobs_legacy_format(client):
    r = client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=4, logprobs=3, temperature=0, extra_body=FIXED
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(t) <= 3 and len(t) >= 1 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completion_echo_with_logprobs_and_zero_tokens(client):
    prompt = "The quick brown"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == r.usage.prompt_tokens
    assert "".join(choice.logprobs.tokens) == prompt
    r2 = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=0, extra_body=FIXED
    )
    assert r2.choices[0].text.startswith(prompt)
    assert len(r2.choices[0].logprobs.tokens) == r.usage.prompt_tokens + 2


def test_completion_stream_with_usage(client):
    kw = dict(model=MODEL, prompt="Berlin is", max_tokens=6, temperature=0, extra_body=FIXED)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_completion_stream_raw_done(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True, "n": 2}
    with requests.post(
        server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        stream=True,
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


# --------------------------------------------------------------------------- chat
def test_chat_basic(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=5, temperature=0, extra_body=FIXED
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length" and r.usage.completion_tokens == 5
    assert r.object == "chat.completion"


def test_chat_n_and_seed(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=6, temperature=1.0, seed=7, extra_body=FIXED)
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=FIXED,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4 == r.usage.completion_tokens
    joined = "".join(t.token for t in content)
    if "\ufffd" not in joined:  # a random model may split a character across tokens
        assert joined == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4  # greedy picks the top token
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


def test_chat_stream_role_first_and_same_text(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, extra_body=FIXED)
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_chat_stream_logprobs_and_n(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            max_tokens=3,
            n=2,
            stream=True,
            logprobs=True,
            top_logprobs=1,
            extra_body=FIXED,
        )
    )
    per_choice = {0: 0, 1: 0}
    for c in chunks:
        for ch in c.choices:
            if ch.logprobs and ch.logprobs.content:
                per_choice[ch.index] += len(ch.logprobs.content)
    assert per_choice == {0: 3, 1: 3}


def test_chat_stop_and_extra_fields(client):
    base = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=12, temperature=0, extra_body=FIXED
    )
    text = base.choices[0].message.content
    if len(text) >= 3:
        stop = text[1:3]
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=12, temperature=0, stop=[stop], extra_body=FIXED
        )
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=5,
        extra_body={
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "stop_token_ids": [2],
            "ignore_eos": True,
            "min_tokens": 5,
        },
    )
    assert r.usage.completion_tokens == 5


def test_chat_content_parts(client):
    msgs = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        }
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body=FIXED)
    assert r.usage.completion_tokens == 2


def test_grammar_fields_constrain_the_output(client):
    import json
    import re

    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=40,
        temperature=1.0,
        extra_body={"regex": "[a-z]{2,6}-[0-9]{2}"},
    )
    assert re.fullmatch("[a-z]{2,6}-[0-9]{2}", r.choices[0].message.content)
    schema = {
        "type": "object",
        # bounded: an unbounded integer lets a random model at T=1 write digits past max_tokens
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=60,
        temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["n"], int)
    r = client.completions.create(
        model=MODEL,
        prompt="a",
        max_tokens=8,
        temperature=1.0,
        extra_body={"ebnf": 'root ::= "yes" | "no"'},
    )
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"ebnf": "root ::= ("}, "ebnf"),
    ],
)
def test_bad_grammar_specs_are_400(client, extra, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, extra_body=extra)
    assert field in str(e.value)


@pytest.mark.parametrize(
    "path,body,needle",
    [
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "a", "top_k": 0}, "top_k"),
        ("/v1/completions", {"prompt": "a", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        (
            "/v1/completions",
            {"prompt": "a", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": [10**13], "echo": True}, "prompt"),
        ("/v1/completions", {"prompt": [[-1]], "echo": True}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": MSGS, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": MSGS, "stop_token_ids": [10**9]}, "stop_token_ids"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "content",
        ),
    ],
)
def test_openai_errors_name_the_field(server, path, body, needle):
    r = raw(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_chat_template_loading(tmp_path):
    from loom.runtime.server.launch import CHATML_TEMPLATE, load_chat_template

    assert load_chat_template(None) is None
    assert load_chat_template("chatml") == CHATML_TEMPLATE
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    assert load_chat_template(str(j)) == "{{ 1 }}"
    with pytest.raises(ValueError, match="chat_template"):
        load_chat_template("no-such-template")
    # a name from the language's registry becomes Jinja that renders the same prompt
    import jinja2

    from loom.chat_template import get_chat_template

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": 'a "q"\n'}]
    for name in ("llama-3-instruct", "default"):
        rendered = jinja2.Template(load_chat_template(name)).render(
            messages=msgs, add_generation_prompt=True
        )
        roles = get_chat_template(name)
        assert rendered == roles.get_prompt(msgs) + roles.role_prefix_and_suffix["assistant"][0]
