"""Grammar-constrained generation through the scheduler, at temperature 1.0 on a random
model (the worst case: the model wants garbage, the mask must hold it to the language)."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest

from tests.conftest_grammar import ARITH_GBNF, ARITH_LARK
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

REGEXES = [
    r"[a-z]{3,8}@[a-z]{3,6}\.(com|org|net)",
    r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    r"\+1 [0-9]{3}-[0-9]{3}-[0-9]{4}",
    r"#[0-9a-fA-F]{6}",
    r"(héllo|wörld|你好|😀)( (héllo|wörld|你好|😀)){0,3}",
]


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {"type": "string", "enum": ["red", "green", "blue"]},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "ok": {"type": "boolean"},
            "score": {"type": "number"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 99}, {"type": "null"}]},
]


@pytest.fixture(scope="module")
def sched(tiny_model_dir):
    return make_scheduler(tiny_model_dir("llama"))


def _run(sched, params, n=6, **kw):
    for i in range(n):
        submit(sched, f"g{i}", [5, 6, 7, 8, 9], {"temperature": 1.0, **params}, seed=i, **kw)
    res = run_all(sched)
    return [res[f"g{i}"] for i in range(n)]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(sched, pattern):
    for r in _run(sched, {"regex": pattern, "max_new_tokens": 64}):
        assert r.finish_reason["type"] == "stop", r
        assert re.fullmatch(pattern, r.text), r.text


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "colours", "uuid-record", "anyof"])
def test_json_schema_outputs_validate(sched, schema):
    for r in _run(sched, {"json_schema": json.dumps(schema), "max_new_tokens": 200}):
        assert r.finish_reason["type"] == "stop", r
        jsonschema.validate(json.loads(r.text), schema)


def test_ebnf_outputs_parse(sched):
    parser = lark.Lark(ARITH_LARK, parser="lalr")
    for r in _run(sched, {"ebnf": ARITH_GBNF, "max_new_tokens": 48}):
        if r.finish_reason["type"] == "stop":
            parser.parse(r.text)


def test_invalid_specs_fail_alone(sched):
    submit(sched, "bad-regex", [5, 6], {"regex": "(unclosed"})
    submit(sched, "bad-json", [5, 6], {"json_schema": "{not json"})
    submit(sched, "bad-ebnf", [5, 6], {"ebnf": "root ::= ("})
    submit(
        sched,
        "unsupported",
        [5, 6],
        {"json_schema": json.dumps({"type": "array", "uniqueItems": True})},
    )
    submit(sched, "fine", [5, 6], {"max_new_tokens": 3, "ignore_eos": True})  # 3 whatever is drawn
    res = run_all(sched)
    for rid in ("bad-regex", "bad-json", "bad-ebnf", "unsupported"):
        fr = res[rid].finish_reason
        assert fr["type"] == "abort" and fr["status_code"] == 400 and fr["message"], fr
    assert len(res["fine"].ids) == 3


def test_jump_forward_saves_steps_and_keeps_outputs_valid(tiny_model_dir):
    schema = {
        "type": "object",
        "properties": {
            "first_name": {"type": "string", "maxLength": 6},
            "last_name": {"type": "string", "maxLength": 6},
            "country": {"enum": ["France", "Japan"]},
        },
        "required": ["first_name", "last_name", "country"],
        "additionalProperties": False,
    }
    steps = {}
    for jf in (True, False):
        s = make_scheduler(tiny_model_dir("llama"), disable_jump_forward=not jf)
        for i in range(4):
            submit(
                s,
                f"j{i}",
                [5, 6, 7],
                {"temperature": 1.0, "json_schema": json.dumps(schema), "max_new_tokens": 120},
                seed=i,
                stream=(i % 2 == 0),
            )
        res = run_all(s)
        for r in res.values():
            jsonschema.validate(json.loads(r.text), schema)
            assert "".join(r.chunks) == r.text
        steps[jf] = s.stats["generated_tokens"]
    assert steps[True] < steps[False]


def test_a_grammar_error_after_sampling_fails_that_request_not_the_scheduler(sched, monkeypatch):
    """The mask makes a refused sampled token impossible; if an engine's mask and its
    accept_token ever disagree, that request ends with an error and the others go on."""
    from loom.grammar.engines.llguidance_engine import LLGuidanceGrammar

    real = LLGuidanceGrammar.accept_token

    def refuse_fourth(self, token_id):
        if self._n == 3:
            raise RuntimeError(f"token {token_id} is not allowed here")
        real(self, token_id)

    monkeypatch.setattr(LLGuidanceGrammar, "accept_token", refuse_fourth)
    submit(sched, "refused", [5, 6], greedy(12, regex="[a-z]{10,12}"))
    submit(sched, "plain", [5, 6, 7], greedy(6))
    res = run_all(sched)
    fr = res["refused"].finish_reason
    assert fr["type"] == "abort" and fr["status_code"] == 500, fr
    assert "grammar refused sampled token" in fr["message"]
    assert len(res["plain"].ids) == 6
    monkeypatch.setattr(LLGuidanceGrammar, "accept_token", real)
    submit(sched, "after", [5, 6], greedy(12, regex="[a-z]{10,12}"))
    assert re.fullmatch("[a-z]{10,12}", run_all(sched)["after"].text)
