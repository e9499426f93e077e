"""Budget-closed constrained decoding (grammar/closing.py): a constrained output that always
completes within max_new_tokens.

Engine level (no model): random walks that pick any token the mask allows, under budgets from
the shortest completion up, end in a schema-valid document on every engine. Server level (the
bundled model, the official openai client, temperature 1): tool calls with max_tokens 24 and
json_schema replies with max_tokens 16 are 50/50 valid, and with `close_within_budget` off the
old behaviour (some cut) comes back; the same with n-gram and EAGLE speculation, greedy rows
(the sampler's lazy grammar path), streaming and the native API's meta_info."""

from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import requests
import torch
from transformers import AutoTokenizer

from loom.grammar.backend import GrammarBackend
from loom.grammar.base import GrammarError, allocate_token_bitmask, unpack_bitmask
from loom.grammar.closing import ClosingGrammar
from loom.runtime.server.runtime_client import Runtime
from loom.runtime.server_args import BUNDLED_MODEL_PATH
from loom.runtime.step_grammar import fill_draft_rows

MODEL = "loom-bundled"
FORMATS = jsonschema.FormatChecker()
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
    },
    "required": ["name", "email"],  # the shortest document: 15 tokens
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
ASK = [{"role": "user", "content": "What's the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BUNDLED_MODEL_PATH)


@pytest.fixture(scope="module")
def backends(tokenizer):
    out = {}
    for engine in ("llguidance", "xgrammar", "outlines"):
        out[engine] = GrammarBackend(tokenizer, 4032, {tokenizer.eos_token_id}, engine=engine)
    yield out
    for b in out.values():
        b.shutdown()


def allowed(grammar, vocab: int = 4032) -> list[int]:
    mask = allocate_token_bitmask(1, vocab)
    grammar.fill_mask(mask, 0)
    return torch.nonzero(unpack_bitmask(mask, vocab)[0]).flatten().tolist()


def random_walk(grammar, budget: int, eos: int, rng: random.Random) -> list[int]:
    """Any allowed token but EOS (a walker that never wants to stop), within the budget."""
    out = []
    for _ in range(budget):
        ids = [t for t in allowed(grammar) if t != eos]
        if not ids:
            break
        t = rng.choice(ids)
        grammar.accept_token(t)
        out.append(t)
        if grammar.is_terminated():
            break
    return out


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar", "outlines"])
def test_random_walks_close_within_budget_on_every_engine(backends, tokenizer, engine):
    backend = backends[engine]
    closer = backend.closer_async("json_schema", PERSON).result()
    need = int(closer.need[closer.initial])
    assert 0 < need <= closer.max_need
    rng = random.Random(engine)
    plain_cut = 0
    for trial in range(24):
        budget = need + trial % 8
        g = ClosingGrammar(backend.compile("json_schema", PERSON), closer, budget)
        out = random_walk(g, budget, tokenizer.eos_token_id, rng)
        assert len(out) <= budget
        doc = json.loads(tokenizer.decode(out))
        jsonschema.validate(doc, PERSON, format_checker=FORMATS)
        if trial % 8 == 0:  # no slack: the walk is the shortest completion, to the token
            assert len(out) == budget and g.budget_closed
        plain = backend.compile("json_schema", PERSON)
        text = tokenizer.decode(random_walk(plain, budget, tokenizer.eos_token_id, rng))
        try:
            json.loads(text)
        except ValueError:
            plain_cut += 1
    assert plain_cut > 0  # the same walks without the closer get cut


def test_a_budget_under_the_shortest_completion_is_not_reported_closed(backends, tokenizer):
    """Steering starts at once, but nothing fits: the output is cut, and budget_closed (which
    the OpenAI usage reports) stays false, as it turns true on the budget that fits."""
    backend = backends["llguidance"]
    closer = backend.closer_async("json_schema", PERSON).result()
    need = int(closer.need[closer.initial])
    for budget, closed in ((need - 3, False), (need, True)):
        g = ClosingGrammar(backend.compile("json_schema", PERSON), closer, budget)
        out = random_walk(g, budget, tokenizer.eos_token_id, random.Random(budget))
        assert len(out) == budget and g.steered_at == 0
        assert g.budget_closed is closed
        if not closed:
            with pytest.raises(ValueError):
                json.loads(tokenizer.decode(out))


def test_draft_rows_see_the_budget_left_after_the_draft(backends, tokenizer):
    """A verify step's row j is masked with the budget left after draft[:j] (the speculative
    rows' view), the same masks as stepping token by token; rollback undoes `steered_at`."""
    backend = backends["llguidance"]
    closer = backend.closer_async("json_schema", PERSON).result()
    budget = int(closer.need[closer.initial]) + 2
    g = ClosingGrammar(backend.compile("json_schema", PERSON), closer, budget)
    walk = random_walk(g.copy(), budget, tokenizer.eos_token_id, random.Random(3))
    g2 = g.copy()
    draft = walk[:6]
    rows = allocate_token_bitmask(len(draft) + 1, 4032)
    fill_draft_rows(g2, draft, rows, 0)
    assert g2._n == 0 and g2.steered_at is None
    for j, t in enumerate(draft):
        one = allocate_token_bitmask(1, 4032)
        g.fill_mask(one, 0)
        assert torch.equal(one[0], rows[j]), j
        g.accept_token(t)
    assert g.steered_at is not None  # two tokens of slack: steering starts early
    g.rollback(len(draft))
    assert g.steered_at is None and g._n == 0


def test_fields_without_a_regular_form_are_refused_by_name(backends):
    backend = backends["llguidance"]
    with pytest.raises(GrammarError, match="close_within_budget.*ebnf"):
        backend.closer_async("ebnf", 'root ::= "a"').result()
    recursive = {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                 "$ref": "#/$defs/n"}  # fmt: skip
    with pytest.raises(GrammarError, match="close_within_budget.*recursive"):
        backend.closer_async("json_schema", recursive).result()


# --------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(bundled_server):
    """The session's bundled-model server (conftest.bundled_server): these tests only send it
    requests."""
    assert bundled_server.server_args.served_model_name == MODEL
    return bundled_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def tool_call_ok(choice) -> bool:
    try:
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, WEATHER["function"]["parameters"], format_checker=FORMATS)
    except (TypeError, ValueError, jsonschema.ValidationError):
        return False
    return call.function.name == "get_weather"


def json_ok(text: str | None) -> bool:
    try:
        jsonschema.validate(json.loads(text), PERSON, format_checker=FORMATS)
    except (TypeError, ValueError, jsonschema.ValidationError):
        return False
    return True


def tool_calls(client, n: int, temperature: float = 1, max_tokens: int = 24, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
        temperature=temperature, max_tokens=max_tokens, n=n, **kw,
    )  # fmt: skip


def json_replies(client, n: int, temperature: float = 1, **kw):
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Extract as JSON: Ada, ada@x.org, 36"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        temperature=temperature, max_tokens=16, n=n, **kw,
    )  # fmt: skip


def test_acceptance_tool_calls_and_json_close_within_max_tokens(client):
    r = tool_calls(client, 50)
    assert sum(map(tool_call_ok, r.choices)) == 50
    closed = [c for c in r.choices if c.finish_reason == "length"]
    assert closed and r.usage.model_extra["budget_closed"] == len(closed)
    r = json_replies(client, 50)
    assert sum(json_ok(c.message.content) for c in r.choices) == 50
    # the field off: the old behaviour, outputs cut by max_tokens
    r = tool_calls(client, 50, extra_body={"close_within_budget": False})
    assert sum(map(tool_call_ok, r.choices)) < 50
    assert "budget_closed" not in (r.usage.model_extra or {})
    r = json_replies(client, 50, extra_body={"close_within_budget": False})
    assert sum(json_ok(c.message.content) for c in r.choices) < 50


def test_streamed_and_greedy_calls_close(client):
    """Streaming reassembles to valid calls; greedy rows (the sampler's lazy grammar path,
    which trusts `accept_token` unless a row is marked forced) are steered too."""
    for _ in range(4):
        args = ""
        for chunk in tool_calls(client, 1, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                args += d.function.arguments or ""
        jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    for max_tokens in (21, 22, 23):  # the shortest call: 21 tokens
        r = tool_calls(client, 1, temperature=0, max_tokens=max_tokens)
        assert tool_call_ok(r.choices[0]), (max_tokens, r.choices[0])


def test_native_api_meta_and_field_checks(server):
    body = {
        "text": "Extract as JSON: Ada, ada@x.org, 36\n",
        "sampling_params": {"json_schema": json.dumps(PERSON), "close_within_budget": "auto", "max_new_tokens": 14,
                            "temperature": 1.0},
    }  # fmt: skip
    outs = [requests.post(server.url + "/generate", json=body, timeout=120).json()
            for _ in range(6)]  # fmt: skip
    assert all(json_ok(o["text"]) for o in outs), [o["text"] for o in outs]
    closed = [o for o in outs if o["meta_info"].get("budget_closed")]
    assert closed, [o["meta_info"]["finish_reason"] for o in outs]
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in closed)
    bad = {"text": "x", "sampling_params": {"close_within_budget": True}}
    r = requests.post(server.url + "/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "close_within_budget" in r.text
    bad["sampling_params"]["ebnf"] = 'root ::= "a"'
    r = requests.post(server.url + "/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "close_within_budget" in r.text
    bad["sampling_params"] = {"close_within_budget": "yes", "regex": "a"}
    r = requests.post(server.url + "/generate", json=bad, timeout=60)
    assert r.status_code == 400 and "close_within_budget" in r.text


@pytest.mark.parametrize("algo", ["NGRAM", "EAGLE"])
def test_speculative_rows_close(algo):
    """Batches under the drafting threshold (speculative_disable_by_batch_size 8): the verify
    rows (chains, masked per row when sampled, lazily when greedy) carry the budget."""
    extra = {}
    if algo == "EAGLE":
        extra["speculative_draft_model_path"] = f"{BUNDLED_MODEL_PATH}/eagle"
    with Runtime(
        max_total_tokens=8192, served_model_name=MODEL, speculative_algorithm=algo, **extra
    ) as rt:
        c = openai.OpenAI(base_url=rt.url + "/v1", api_key="x", max_retries=0, timeout=300)
        for temperature in (1, 0):
            r = tool_calls(c, 4, temperature=temperature, max_tokens=22)
            assert all(map(tool_call_ok, r.choices))
            r = json_replies(c, 4, temperature=temperature)
            assert all(json_ok(ch.message.content) for ch in r.choices)
        verified = 0
        for temperature in (1.0, 0.0):
            body = {
                "text": "Extract as JSON: Ada, ada@x.org, 36\n",
                "sampling_params": {"json_schema": json.dumps(PERSON), "close_within_budget": "auto", "max_new_tokens": 15,
                                    "temperature": temperature},
            }  # fmt: skip
            for _ in range(3):
                o = requests.post(rt.url + "/generate", json=body, timeout=120).json()
                assert json_ok(o["text"]), o
                verified += o["meta_info"]["spec_verify_ct"]
        assert verified > 0  # drafts were verified under the closer


def test_a_closer_attached_late_replays_the_output(backends, tokenizer):
    """A request that started before its default closer was built gets it between two steps
    (GrammarQueue.attach_late): the same masks from there as a closer attached at the start."""
    backend = backends["llguidance"]
    closer = backend.closer_async("json_schema", PERSON).result()
    budget = int(closer.need[closer.initial]) + 3
    early = ClosingGrammar(backend.compile("json_schema", PERSON), closer, budget)
    out = random_walk(early.copy(), budget, tokenizer.eos_token_id, random.Random(5))[:7]
    plain = backend.compile("json_schema", PERSON)
    for t in out:
        early.accept_token(t)
        plain.accept_token(t)
    late = ClosingGrammar.attach(plain, closer, budget, out)
    assert late._states == early._states
    assert allowed(late) == allowed(early) != allowed(plain)
