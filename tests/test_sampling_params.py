"""Every sampling parameter is validated; the error names the field and the allowed range."""

from __future__ import annotations

import pytest

from loom.runtime.sampling_params import SamplingParams, make_sampling_params

BAD = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens"),
    ({"n": 0}, "n"),
    ({"stop": [""]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": [10_000]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"temperature": float("nan")}, "temperature"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"regex": "a", "json_schema": "{}"}, "regex, json_schema"),
    ({"bogus": 1}, "bogus"),
]


@pytest.mark.parametrize("raw,field", BAD)
def test_invalid_values_name_the_field(raw, field):
    with pytest.raises(ValueError) as err:
        make_sampling_params(raw, vocab_size=1000)
    assert field in str(err.value)
    assert str(err.value).startswith(field.split(",")[0]) or "unknown field" in str(err.value)


def test_defaults_match_sglang():
    p = make_sampling_params({})
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.n == 1 and not p.ignore_eos and p.skip_special_tokens and not p.no_stop_trim


def test_normalisation():
    p = make_sampling_params(
        {"stop": "###", "logit_bias": {"5": 2}, "json_schema": {"type": "object"}}
    )
    assert p.stop == ["###"] and p.logit_bias == {5: 2.0}
    assert p.grammar_spec == ("json_schema", '{"type":"object"}')
    assert make_sampling_params({"temperature": 0}).is_greedy
    assert make_sampling_params({"top_k": 1, "temperature": 0.7}).is_greedy
    assert isinstance(make_sampling_params(SamplingParams(top_k=3)), SamplingParams)
