"""outlines (its SGLang model over the official openai client) against `loom serve` on the
bundled model: pydantic output types (response_format json_schema), `Literal` choices and
`Regex` (the `regex` extra), its `CFG` type (a Lark grammar sent as SGLang's `ebnf`: loom
takes Lark there) and streaming. Every reply must parse into the requested type."""

from __future__ import annotations

import re
from typing import Literal

import openai
import outlines
import pytest
from pydantic import BaseModel, Field

MODEL = "loom-bundled"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=150)


YES_NO = """
start: answer "."
answer: "yes" | "no" | "maybe"
"""


@pytest.fixture(scope="module")
def model(bundled_server):
    """outlines on the session's bundled-model server (conftest.bundled_server): these tests
    only send it requests."""
    assert bundled_server.server_args.served_model_name == MODEL
    client = openai.OpenAI(
        base_url=bundled_server.url + "/v1", api_key="x", max_retries=0, timeout=120
    )
    return outlines.from_sglang(client, MODEL)


def test_pydantic_literal_and_regex_outputs(model):
    for seed in range(3):
        text = model("Extract as JSON: Ada is 36.", Person, max_tokens=40, seed=seed)
        person = Person.model_validate_json(text)  # closes within max_tokens by default
        assert 0 <= person.age <= 150
    kind = model("Is Paris a city or a country?", Literal["city", "country"], max_tokens=5)
    assert kind in ("city", "country")
    code = model("A code:", outlines.types.Regex(r"[A-Z]{3}-\d{2}"), max_tokens=10)
    assert re.fullmatch(r"[A-Z]{3}-\d{2}", code), code


def test_cfg_sent_as_lark_is_honoured(model):
    for seed in range(3):
        text = model("Answer:", outlines.types.CFG(YES_NO), max_tokens=8, seed=seed)
        assert text in ("yes.", "no.", "maybe."), text


def test_streamed_pydantic_output(model):
    chunks = list(model.stream("Extract as JSON: Bo is 7.", Person, max_tokens=40))
    assert len(chunks) > 1
    Person.model_validate_json("".join(chunks))


def test_malformed_grammar_names_both_dialects(model):
    from outlines.exceptions import BadRequestError

    with pytest.raises(BadRequestError, match="400.*GBNF.*Lark"):
        model("x", outlines.types.CFG("root: = oops"), max_tokens=4)
