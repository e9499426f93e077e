"""Tool calling, reasoning output and lenient bodies on /v1/chat/completions, driven by the
official `openai` client against tiny random-weight servers (so every guarantee checked here
comes from the grammar, not from a model that knows how to call tools)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import openai
import pytest
import requests

from loom.runtime.server import tools as T
from loom.runtime.server.reasoning import ReasoningParser, think_regex
from loom.runtime.server.runtime_client import Runtime

MODEL = "tiny"
MSGS = [{"role": "user", "content": "What's the weather in Paris and 2+3?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
        },
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -99, "maximum": 99},
                "op": {"enum": ["+", "-", "*"]},
                "b": {"type": "integer", "minimum": -99, "maximum": 99},
            },
            "required": ["a", "op", "b"],
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, CALC]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Runtime(
        tiny_model_dir("qwen3"),
        max_total_tokens=8192,
        served_model_name=MODEL,
        grammar_compile_timeout=6,  # bounds the pathological-schema test's wait
    ) as rt:
        yield rt


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


# --------------------------------------------------------------------------- tool_choice
def test_required_gives_valid_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=200, seed=1
    )
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(valid_calls(c.message.tool_calls)) >= 1


def test_named_function(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MSGS,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "calculator"}},
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
        )
        calls = valid_calls(r.choices[0].message.tool_calls)
        assert [name for name, _ in calls] == ["calculator"]


def test_auto_is_text_or_valid_calls(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=60, n=8, seed=3, temperature=1.0
    )
    for c in r.choices:
        if c.message.tool_calls:
            valid_calls(c.message.tool_calls)
            assert c.finish_reason == "tool_calls"
        else:
            assert "<tool_call>" not in (c.message.content or "")


def _token_ids(client, text: str) -> list[int]:
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    return requests.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_none_never_parses(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="none", max_tokens=8, seed=0
    )
    c = r.choices[0]
    assert c.message.tool_calls is None and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")


def test_parallel_calls(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=400,
        n=12,
        seed=5,
        temperature=1.0,
        parallel_tool_calls=True,
    )
    counts = [
        len(valid_calls(c.message.tool_calls)) for c in r.choices if c.finish_reason != "length"
    ]
    assert counts and max(counts) >= 2, counts  # several calls in one reply
    # not stated: one call per reply (the same request, same seeds)
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=400, n=12,
        seed=5, temperature=1.0,
    )  # fmt: skip
    assert all(len(valid_calls(c.message.tool_calls)) == 1 for c in r.choices)
    single = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        n=6,
        seed=5,
    )
    assert all(len(valid_calls(c.message.tool_calls)) == 1 for c in single.choices)


def test_streamed_deltas_reassemble_to_the_non_streamed_calls(client):
    kw = dict(
        model=MODEL,
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=400,
        seed=5,
        temperature=1.0,
    )
    full = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:  # the first delta of a call: id, type, name
                    assert d.id.startswith("call_") and d.function.name and d.type == "function"
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                else:
                    assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert reasons == [full.finish_reason] == ["tool_calls"]
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in full.message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected


def test_hundred_calls_at_temperature_one_all_valid(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        n=100,
        temperature=1.0,
        seed=11,
    )
    invalid = 0
    for c in r.choices:
        try:
            assert c.finish_reason == "tool_calls" and len(valid_calls(c.message.tool_calls)) == 1
        except (AssertionError, ValueError, jsonschema.ValidationError):
            invalid += 1
    assert invalid == 0


def test_tool_history_round_trip(client):
    first = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice="required", max_tokens=200, seed=2
    )
    msg = first.choices[0].message
    history = MSGS + [
        msg.model_dump(exclude_none=True),
        *[
            {"role": "tool", "tool_call_id": c.id, "content": '{"temp": 21}'}
            for c in msg.tool_calls
        ],
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert r.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools.0.function.name"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "tree",
                            "strict": True,
                            "parameters": {
                                "$defs": {
                                    "n": {
                                        "type": "object",
                                        "properties": {
                                            "kids": {
                                                "type": "array",
                                                "items": {"$ref": "#/$defs/n"},
                                            }
                                        },
                                    }
                                },
                                "$ref": "#/$defs/n",
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
    ],
)
def test_tool_errors_name_the_field(server, body, needle):
    r = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": MSGS, "max_tokens": 2, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.text


def test_lang_tool_loop_on_a_random_model(server):
    """sgl.gen(tools=[...]) over RuntimeEndpoint: grammar-valid calls at temperature 1."""
    import loom as sgl
    from tests.test_lang_tools import check_tool_loop

    check_tool_loop(sgl.RuntimeEndpoint(server.url))


def test_a_schema_that_would_translate_for_hours_is_stopped(server, client):
    """Translated in a killable worker: a 400 at --grammar-compile-timeout, and the server
    goes on serving."""
    slow = {"oneOf": [{"type": "string", "pattern": "^(a|b)*a(a|b){25}$"}, {"type": "string"}]}
    tool = {
        "type": "function",
        "function": {
            "name": "slow",
            "strict": True,
            "parameters": {"type": "object", "properties": {"x": slow}, "required": ["x"]},
        },
    }
    r = requests.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": MSGS, "tools": [tool], "tool_choice": "required"},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "tools[0].function.parameters" in message and "longer than 6 s" in message, message
    ok = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2)
    assert ok.choices[0].message.role == "assistant"


# --------------------------------------------------------------------------- lenient bodies
def test_unknown_fields_are_ignored_with_one_warning(client, server):
    extra = {"service_tier": "auto", "metadata": {"a": "b"}, "store": False, "zz_unknown_field": 1}
    for _ in range(2):
        r = client.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=2, user="u1", extra_body=extra
        )
        assert r.choices[0].message.role == "assistant"
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body=extra)
    assert len(r.choices) == 1
    log = open(server.log_path).read()
    assert log.count("'zz_unknown_field'") == 1, log[-3000:]
    assert "'service_tier'" in log


def test_response_format_modes_and_sampling_fields(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_completion_tokens=40, response_format=rf, n=3, seed=1
    )
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=40,
        response_format={"type": "json_object"},
        seed=1,
        temperature=1.0,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=3, response_format={"type": "text"}
    )
    assert r.usage.completion_tokens <= 3
    (tid,) = _token_ids(client, "Paris")[:1]
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=4,
        temperature=0,
        logit_bias={str(tid): 100},
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    text = r.choices[0].message.content
    piece = text[: len(text) // 4]  # the biased token, picked at every step
    assert piece and text == piece * 4 and "Paris".startswith(piece)
    assert len(r.choices[0].logprobs.content) == 4


# --------------------------------------------------------------------------- units
@pytest.mark.parametrize("fmt", sorted(T.FORMATS))
def test_formats_regex_and_parser_agree(fmt):
    from loom.runtime.server.protocol import Tool

    f = T.FORMATS[fmt]
    tools = [Tool.model_validate(t) for t in TOOLS]
    calls = [
        ("calculator", '{"a": 2, "op": "+", "b": 3}'),
        ("get_weather", '{"city": "Oslo", "unit": "c"}'),
    ]
    text = f.render_calls(calls)
    for mode, parallel in (("required", True), ("auto", True), ("calculator", True)):
        rx = T.tool_regex(f, tools, mode, parallel)
        assert re.fullmatch(rx, text) or mode == "calculator", (mode, text)
        assert re.fullmatch(rx, f.render_calls(calls[:1]))
    assert not re.fullmatch(T.tool_regex(f, tools, "required", False), text)
    assert not re.fullmatch(
        T.tool_regex(f, tools, "required", True), f.render_calls([("calculator", '{"a": 2}')])
    )
    assert re.fullmatch(T.tool_regex(f, tools, "auto", True), "Just text.")
    rng = random.Random(0)
    for _ in range(50):  # chunked feeding never changes the result
        p = T.ToolCallParser(f)
        events, pos = [], 0
        for cut in sorted(rng.sample(range(len(text)), 4)) + [len(text)]:
            events += p.feed(text[pos:cut])
            pos = cut
        content, got = T.assemble(events + p.finish())
        assert not content.strip()
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got] == calls


def test_parser_flag_names_match_the_formats():
    from loom.runtime.server_args_choices import TOOL_CALL_PARSERS

    assert TOOL_CALL_PARSERS == T.PARSER_NAMES
    assert T.get_format(None, "llama").name == "llama3"
    assert T.get_format(None, "qwen3", bundled=True).name == "react"
    assert T.get_format("hermes", "llama").name == "qwen25"
    react = T.FORMATS["react"]  # a ReAct model goes on with "Observation:": allowed, not content
    text = react.render_calls([("add", '{"a": 1}')]) + "\nObservation:"
    p = T.ToolCallParser(react)
    content, calls = T.assemble(p.feed("Thought: x\n" + text) + p.finish())
    assert content == "Thought: x\n" and [c["function"]["arguments"] for c in calls] == ['{"a": 1}']


def test_avoid_regex_is_exact():
    rng = random.Random(1)
    for word in ("<tool_call>", "[TOOL_CALLS]", "</think>"):
        rx = re.compile(T.avoid_regex(word))
        alphabet = sorted(set(word)) + ["x", "\n"]
        for _ in range(3000):
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
            if rng.random() < 0.3:
                i = rng.randint(0, len(s))
                s = s[:i] + word[: rng.randint(0, len(word))] + s[i:]
            assert bool(rx.fullmatch(s)) == (word not in s), (word, s)


def test_reasoning_parser_and_grammar_prefix():
    cases = [
        ("qwen3", "<think>\nhmm</think>\n\n{}", "\nhmm", "{}"),
        ("qwen3", "{}", "", "{}"),
        ("deepseek-r1", "hmm</think>{}", "hmm", "{}"),
        ("deepseek-r1", "<think>cut", "cut", ""),
    ]
    for parser, text, reasoning, content in cases:
        for cut in range(len(text) + 1):
            p = ReasoningParser(parser)
            events = p.feed(text[:cut]) + p.feed(text[cut:]) + p.finish()
            got = {"reasoning": "", "content": ""}
            for kind, value in events:
                got[kind] += value
            assert got == {"reasoning": reasoning, "content": content}, (parser, text, cut)
        rx = think_regex(parser) + r"(?:\{\})"
        assert bool(re.fullmatch(rx, text)) == (
            content == "{}" and (parser == "qwen3" or "</think>" in text)
        )
    assert not re.fullmatch(think_regex("qwen3") + "x", "<think>a</think>b</think>x")


# --------------------------------------------------------------------------- reasoning server
@pytest.fixture(scope="module")
def thinker(tiny_model_dir, tmp_path_factory):
    """A deepseek-r1 style server (the reply is thinking until </think>) on the tiny model with
    <think> and </think> added as single tokens (ids in the model's padded vocabulary rows), so
    a logit bias can make a random model end its thinking soon."""
    import shutil
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("thinker") / "qwen3-think"
    shutil.copytree(tiny_model_dir("qwen3"), folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok.save(str(folder / "tokenizer.json"))
    assert Path(folder, "tokenizer.json").exists()
    with Runtime(
        str(folder),
        max_total_tokens=4096,
        served_model_name=MODEL,
        reasoning_parser="deepseek-r1",
        # llguidance's token view leaves out tokens added past the base vocabulary (its mask
        # never allows them), which this test needs; xgrammar reads them as text
        grammar_backend="xgrammar",
    ) as rt:
        client = openai.OpenAI(base_url=rt.url + "/v1", api_key="x", max_retries=0, timeout=120)
        (close,) = requests.post(
            rt.url + "/tokenize", json={"prompt": "</think>"}, timeout=30
        ).json()["tokens"]
        yield client, close


def test_reasoning_split_streamed_and_not(thinker):
    client, _ = thinker
    kw = dict(
        model=MODEL,
        messages=MSGS,
        max_tokens=60,
        temperature=1.0,
        seed=4,
        extra_body={"regex": "<think>[a-z ]{1,12}</think>\n\n[a-z]{1,8}"},
    )
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert re.fullmatch("[a-z ]{1,12}", msg.reasoning_content) and re.fullmatch(
        "[a-z]{1,8}", msg.content
    )
    chunks = list(client.chat.completions.create(stream=True, **kw))
    thoughts = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (thoughts, content) == (msg.reasoning_content, msg.content)
    # deepseek-r1: a reply that never closes the block is all thinking
    cut = client.chat.completions.create(**{**kw, "extra_body": {"regex": "[a-z]{3}"}})
    assert re.fullmatch("[a-z]{3}", cut.choices[0].message.reasoning_content)
    assert not cut.choices[0].message.content


@pytest.mark.parametrize("kind", ["tools", "response_format"])
def test_constrained_output_starts_after_the_thinking(thinker, kind):
    client, close = thinker
    schema = SCHEMAS["calculator"]
    extra = (
        {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
        if kind == "tools"
        else {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "schema": schema},
            }
        }
    )
    r = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,
        max_tokens=200,
        n=4,
        seed=0,
        temperature=1.0,
        logit_bias={str(close): 6},  # thinking that ends within a few tokens
        **extra,
    )
    thought = 0
    for c in r.choices:
        assert c.finish_reason == ("tool_calls" if kind == "tools" else "stop"), c
        thought += bool(c.message.reasoning_content)
        assert "</think>" not in (c.message.reasoning_content or "")
        if kind == "tools":
            assert c.message.content is None and len(valid_calls(c.message.tool_calls)) == 1
        else:
            jsonschema.validate(json.loads(c.message.content), schema)
    assert thought >= 1  # free text before </think>, then the grammar's part
