"""JSON schema -> regex, keyword by keyword (checked with re.fullmatch), plus token walks."""

from __future__ import annotations

import json
import os
import re
from decimal import Decimal

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.grammar.base import GrammarError, allocate_token_bitmask, unpack_bitmask
from loom.grammar.json_schema import (
    compile_json_schema,
    json_schema_to_lark,
    json_schema_to_regex,
)
from loom.grammar.json_schema.numbers import int_range, number_range
from loom.grammar.vocab import TokenVocabulary
from tests.conftest_grammar import byte_bpe, encode


def match(schema, value, **kw) -> bool:
    regex = json_schema_to_regex(schema, **kw)
    texts = [json.dumps(value, ensure_ascii=False, separators=(",", ":")), json.dumps(value)]
    results = {re.fullmatch(regex, t) is not None for t in texts}
    assert len(results) == 1, texts  # compact and ", "/": " spacing agree
    return results.pop()


def test_scalars():
    assert match({"type": "null"}, None) and not match({"type": "null"}, 0)
    assert match({"type": "boolean"}, True) and not match({"type": "boolean"}, "true")
    assert match({"type": "integer"}, -12) and not match({"type": "integer"}, 1.5)
    for v in (0, -1.5, 3.25e10, 1e-07):
        assert match({"type": "number"}, v)
    assert match({"type": "string"}, 'a "quoted" \\ \n tab\t é 😀')
    assert not re.fullmatch(json_schema_to_regex({"type": "string"}), '"a"b"')
    assert match({"type": ["string", "null"]}, None) and match({"type": ["string", "null"]}, "x")
    assert match({"type": "string", "nullable": True}, None)


def test_integer_ranges_many_numbers():
    cases = [(0, 10), (-5, 5), (1, 1), (7, 1234), (-1000, -17), (None, 42), (-3, None), (99, 100)]
    for lo, hi in cases:
        regex = int_range(lo, hi)
        for x in range(-2500, 2500):
            want = (lo is None or x >= lo) and (hi is None or x <= hi)
            assert (re.fullmatch(regex, str(x)) is not None) == want, (lo, hi, x)
    s = {"type": "integer", "exclusiveMinimum": 0, "maximum": 100}
    assert match(s, 1) and match(s, 100) and not match(s, 0) and not match(s, 101)
    s4 = {"type": "integer", "minimum": 0, "exclusiveMaximum": True, "maximum": 10}  # draft 4
    assert match(s4, 9) and not match(s4, 10)
    assert not match({"type": "integer", "minimum": 0}, -1)


def test_number_bounds():
    s = {"type": "number", "minimum": -1, "exclusiveMaximum": 2}
    for v, ok in [(-1, True), (-1.5, False), (-0.5, True), (0, True), (1.999, True), (2, False)]:
        assert match(s, v) == ok, v
    cents = {"type": "number", "multipleOf": 0.01}
    assert match(cents, 9.99) and match(cents, 10) and not match(cents, 9.991)
    whole = {"type": "number", "multipleOf": 1.0}
    assert match(whole, 3) and not match(whole, 1.5)
    with pytest.raises(GrammarError, match="multipleOf"):
        json_schema_to_regex({"type": "number", "multipleOf": 0.3})
    lat = {"type": "number", "minimum": -90.5, "exclusiveMaximum": 0.25}
    assert all(match(lat, v) for v in (-90.5, -90.49, -3, -0.001, 0, 0.1, 0.2499))
    assert not any(match(lat, v) for v in (-90.51, -91, 0.25, 0.2501, 1))
    money = {"type": "number", "multipleOf": 0.01, "minimum": 0.5, "maximum": 100}
    assert all(match(money, v) for v in (0.5, 0.51, 99.99, 100, 3))
    assert not any(match(money, v) for v in (0.49, 0.505, 100.01, -1))


@given(
    lo=st.one_of(st.none(), st.decimals(-50, 50, places=3)),
    hi=st.one_of(st.none(), st.decimals(-50, 50, places=3)),
    lo_ex=st.booleans(),
    hi_ex=st.booleans(),
    places=st.one_of(st.none(), st.integers(0, 3)),
    x=st.decimals(-60, 60, places=4),
    near=st.sampled_from([None, "lo", "hi"]),
    nudge=st.sampled_from(["-0.001", "-0.0001", "0", "0.0001", "0.01"]),
)
@settings(max_examples=600, deadline=None)
def test_number_range_matches_decimal_comparison(lo, hi, lo_ex, hi_ex, places, x, near, nudge):
    """Any decimal bounds, inclusive or exclusive, with or without multipleOf 10**-k: the regex
    accepts a number's text exactly when the number is in range (x is often a bound itself,
    or next to one)."""
    bound = {"lo": lo, "hi": hi}.get(near)
    if bound is not None:
        x = bound + Decimal(nudge)
    s = {}
    if lo is not None:
        s["exclusiveMinimum" if lo_ex else "minimum"] = float(lo)
    if hi is not None:
        s["exclusiveMaximum" if hi_ex else "maximum"] = float(hi)
    r = number_range(s, places)
    text = format(x, "f")
    truth = (
        (lo is None or (x > lo if lo_ex else x >= lo))
        and (hi is None or (x < hi if hi_ex else x <= hi))
        and (places is None or x == x.quantize(Decimal(1).scaleb(-places)))
    )
    if x == 0 and text.startswith("-"):
        text = text[1:]  # "-0.0" is not written
    assert bool(r and re.fullmatch(r, text)) == truth, (s, places, text, r)


def test_strings_lengths_pattern_format():
    s = {"type": "string", "minLength": 2, "maxLength": 3}
    assert match(s, "ab") and match(s, "é\n") and not match(s, "a") and not match(s, "abcd")
    p = {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"}
    assert match(p, "ab-12") and not match(p, "ab-1") and not match(p, "xab-12x!")
    unanchored = {"type": "string", "pattern": "[0-9]{3}"}
    assert match(unanchored, "ab123cd") and not match(unanchored, "12")
    assert match({"type": "string", "pattern": '^a"b$'}, 'a"b')
    # anchors on only some alternatives: each alternative is searched as re.search would
    mixed = "^dev|alpha|(rc)|stable$"
    for v in ("dev", "devx", "xalphax", "xrcx", "stable", "xstable", "stablex", "xdev", "beta", ""):
        assert match({"type": "string", "pattern": mixed}, v) == bool(re.search(mixed, v)), v
    fmts = {
        "date": ("2024-02-29", "2024-02-30"),
        "date-time": ("2024-02-29T10:20:30Z", "2024-02-29 10:20:30Z"),
        "time": ("10:20:30+01:00", "25:00:00Z"),
        "uuid": ("123e4567-e89b-12d3-a456-426614174000", "123e4567"),
        "email": ("a.b@example.com", "not an email"),
        "ipv4": ("192.168.0.1", "256.1.1.1"),
        "hostname": ("api.example.com", "-bad-.com"),
        "uri": ("https://example.com/x?y=1", "no scheme"),
    }
    for fmt, (good, bad) in fmts.items():
        s = {"type": "string", "format": fmt}
        assert match(s, good) and not match(s, bad), fmt
    with pytest.raises(GrammarError, match="pattern"):
        json_schema_to_regex({"type": "string", "pattern": "(?=a)b"})


# MaskBench schemas whose invalid instances loom accepted (one regression check each, the
# schema cut down to the keywords at fault, instances from the MaskBench file)
def test_format_regex_admits_only_compilable_regexes():
    # Github_easy---o66309: {"regex": {"type": "string", "format": "regex"}}
    s = {"type": "string", "format": "regex"}
    checker = jsonschema.FormatChecker()
    for v in ("^[a-zA-Z0-9_]{3,16}$", "^[a-zA-Z0-9]+$", r"^\d{3}-\d{4}$", "(?:a|b)*c", "é+", ""):
        assert checker.conforms(v, "regex") and match(s, v), v
    for v in ("*", "\\", "a(b", "[]", "a**", "[z-a]", "a{5,2}", "a|*", "(?x) *"):
        assert not checker.conforms(v, "regex") and not match(s, v), v
    # sound against Python's re.compile on random strings of regex syntax
    import random

    pieces = list("ab()[]{}*+?|^$.-,09\\:=!é ") + ["\\d", "(?:", "[^", "{2,3}", "{3,2}", "(?i)"]
    rng, regex = random.Random(0), json_schema_to_regex(s)
    for _ in range(3000):
        v = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        if re.fullmatch(regex, json.dumps(v)):
            assert checker.conforms(v, "regex"), v


def test_pattern_with_format_keeps_both():
    # Github_medium---o1053: from_date {"format": "date", "pattern": "^([0-9]{4})(-...)?$"}
    s = {"type": "string", "format": "date", "pattern": "^([0-9]{4})(-([0-9]{2}))?(-([0-9]{2}))?$"}
    checker = jsonschema.FormatChecker()
    for v in ("2020-02-28", "2022-12-31", "2020-02-30", "2020", "2020-1-01"):
        want = jsonschema.Draft4Validator(s, format_checker=checker).is_valid(v)
        assert match(s, v) == want, v
    # a pattern narrower than its format is kept whole
    narrow = {"type": "string", "format": "date", "pattern": "^20[0-9]{2}-01-01$"}
    assert match(narrow, "2024-01-01") and not match(narrow, "1999-01-01")
    # neither contains the other: the pattern is kept, the format not enforced (logged)
    loose = {"type": "string", "format": "date", "pattern": "^2[0-9-]*x?$"}
    assert match(loose, "2x") and not match(loose, "1999-01-01")
    # a format with a long bounded repeat is not compared (interegular would take minutes)
    host = {"type": "string", "format": "hostname", "pattern": "^[a-z.]+$"}
    assert match(host, "api.example.com") and not match(host, "API")


def test_pattern_properties_without_type_constrain_an_object():
    # Github_hard---o82151: "deployers": {"patternProperties": {".*": {"$ref": deployer}}}
    s = {
        "type": "object",
        "properties": {"d": {"patternProperties": {".*": {"$ref": "#/definitions/n"}}}},
        "definitions": {"n": {"type": "object", "properties": {"nodes": {"maximum": 12}}}},
    }
    spec = {"additional_properties_default": True}
    for v in ({"d": {"x": {"nodes": 3}}}, {"d": {"x": {"nodes": 13}}}, {"d": {"x": 1}}):
        assert match(s, v, **spec) == jsonschema.Draft4Validator(s).is_valid(v), v


def test_uri_reference_and_uri_template_formats():
    # JsonSchemaStore---bounded-context: "entryPoint": "://" (uri-reference, RFC 3986)
    ref = {"type": "string", "format": "uri-reference"}
    for v in ("#/definitions/a", "../x", "http://x.com/a?b#c", "a/b:c", "Core", "", "?q"):
        assert match(ref, v), v
    for v in ("://", "1:2", "a b"):
        assert not match(ref, v), v
    # MCPspec---CompleteRequest: "uri": "http://example.com/resource/{" (uri-template, RFC 6570)
    tpl = {"type": "string", "format": "uri-template"}
    for v in ("http://example.com/{id}", "/a{?x,y*}{/p:3}", "{+path}/here", "{a.b}", "a%20b"):
        assert match(tpl, v), v
    for v in ("http://example.com/resource/{", "x}", "a{}", "{a..b}", "100%"):
        assert not match(tpl, v), v


def test_enum_const_choices():
    s = {"enum": ["a", 1, None, {"k": [1, 2]}]}
    for v in ("a", 1, None, {"k": [1, 2]}):
        assert match(s, v)
    assert not match(s, "b") and not match(s, 2)
    assert match({"const": "x"}, "x") and not match({"const": "x"}, "y")


def test_objects_required_additional():
    spec = {"additional_properties_default": True}  # the JSON Schema rule, not loom's default
    s = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "null"}},
        "required": ["b"],
    }
    for v in ({"b": "x"}, {"a": 1, "b": "x"}, {"a": 1, "b": "x", "c": None}, {"b": "", "zz": [1]}):
        assert match(s, v, **spec), v
    assert not match(s, {"a": 1}, **spec) and not match(s, {"a": "1", "b": "x"}, **spec)
    assert not match(s, {"b": "x", "a": "not an int"}, **spec)  # listed keys are not extras
    closed = {**s, "additionalProperties": False}
    assert not match(closed, {"b": "x", "zz": 1}, **spec)
    typed = {**s, "additionalProperties": {"type": "integer"}}
    assert match(typed, {"b": "x", "n": 3}) and not match(typed, {"b": "x", "n": "3"})
    assert not match(s, {"b": "x", "zz": 1})  # loom's default: unlisted keys are not generated
    assert match({"type": "object"}, {}) and match({"type": "object"}, {"x": {"y": [1]}})
    assert match({"type": "object", "additionalProperties": True}, {"x": {"y": [1]}})


def test_type_is_inferred_only_from_keywords_that_constrain():
    # without `type`, `properties` implies an object; empty keywords imply nothing (MaskBench
    # Github_medium---o7200: string items under {"required": [], "properties": {}})
    empty = {"required": [], "properties": {}}
    for v in ("reading", 3, None, [1], {"a": [1]}):  # regex: any value 2 deep
        jsonschema.validate(v, empty)
        assert match(empty, v) and match({"items": True}, v), v
    assert match({"type": "array", "items": empty}, ["a", 1, {}])
    listed = {"properties": {"a": {"type": "integer"}}}
    assert match(listed, {"a": 1}) and not match(listed, "x") and not match(listed, {"a": "1"})
    assert match({"minItems": 1}, [1]) and not match({"minItems": 1}, [])  # 1 == True in Python


def test_min_max_properties():
    props = {k: {"type": "integer"} for k in "abc"}
    at_least_one = {"type": "object", "properties": props, "minProperties": 1}
    assert not match(at_least_one, {}) and match(at_least_one, {"b": 1})
    assert match(at_least_one, {"a": 1, "c": 2})
    at_most_one = {"type": "object", "properties": props, "maxProperties": 1}
    assert match(at_most_one, {}) and match(at_most_one, {"c": 3})
    assert not match(at_most_one, {"a": 1, "b": 2})
    exactly_one = {**at_most_one, "minProperties": 1}
    assert not match(exactly_one, {}) and match(exactly_one, {"a": 1})
    assert not match(exactly_one, {"a": 1, "b": 2})
    one_required = {**at_most_one, "required": ["b"]}
    assert match(one_required, {"b": 1}) and not match(one_required, {"a": 1})
    empty = {"type": "object", "properties": props, "maxProperties": 0}
    assert match(empty, {}) and not match(empty, {"a": 1})
    open_nonempty = {"type": "object", "minProperties": 1}
    assert match(open_nonempty, {"x": [1]}) and not match(open_nonempty, {})
    implied = {"type": "object", "properties": props, "required": ["a", "b"], "minProperties": 2}
    assert match(implied, {"a": 1, "b": 2})
    for bad, kw in (
        ({"type": "object", "properties": props, "minProperties": 2}, "minProperties"),
        ({"type": "object", "properties": props, "maxProperties": 2}, "maxProperties"),
        ({"minProperties": 1}, "minProperties"),
    ):
        with pytest.raises(GrammarError, match=kw):
            json_schema_to_regex(bad)
    with pytest.raises(GrammarError, match="exceeds"):
        json_schema_to_regex({"type": "object", "properties": props, "minProperties": 4})


def test_pattern_properties_and_implied_lengths():
    s = {
        "type": "object",
        "properties": {"id": {"type": "integer"}},
        "patternProperties": {"^x-[a-z]+$": {"type": "string"}},
    }
    assert match(s, {"id": 1, "x-foo": "a", "x-bar": "b"}) and match(s, {"id": 1})
    assert not match(s, {"id": 1, "x-foo": 2}) and not match(s, {"id": 1, "y": "a"})
    implied = {"type": "string", "pattern": "^[a-z]{2,5}$", "maxLength": 10}
    assert match(implied, "abc") and not match(implied, "abcdef")
    both = {"type": "string", "pattern": "^x-[a-z0-9]+$", "minLength": 4, "maxLength": 6}
    assert match(both, "x-ab") and match(both, "x-abcd") and not match(both, "x-a")
    assert not match(both, "x-abcde") and not match(both, "x-ABC")
    with pytest.raises(GrammarError, match="maxLength"):
        json_schema_to_regex({"type": "string", "pattern": "^(ab|c)+$", "maxLength": 3})
    grouped = {"type": "string", "pattern": "(^[a-z.()-]+$)", "maxLength": 4}  # anchors inside
    assert match(grouped, "a.b") and not match(grouped, "abcde") and not match(grouped, "")
    # minLength 1 on a pattern that admits "": the pattern without its empty string
    nonempty = [
        ("^$|^[a-z][a-z0-9A-Z]*$", ["a", "aB3"], ["", "1a"]),
        (
            "^([0-9]+y)?([0-9]+w)?([0-9]+d)?([0-9]+h)?([0-9]+m)?([0-9]+s)?$",
            ["5m", "1y2w"],
            ["", "m"],
        ),
        ("^$|(^(?:\\S+\\s+){0,99}\\S+$)", ["a", "a b c"], ["", " "]),
        ("^(a*)(b*)$", ["a", "b", "aabb"], ["", "ba"]),
        ("^(|x)$", ["x"], ["", "xx"]),
    ]
    for pattern, good, bad in nonempty:
        s = {"type": "string", "pattern": pattern, "minLength": 1}
        assert all(match(s, v) for v in good) and not any(match(s, v) for v in bad), pattern
    assert match({"type": "string", "format": "date", "maxLength": 20}, "2020-01-01")
    huge = {"type": "string", "maxLength": 32767}  # above max_repeat: not counted (logged)
    assert match(huge, "x" * 600)


def test_arrays():
    s = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}
    assert match(s, [1]) and match(s, [1, 2, 3]) and not match(s, []) and not match(s, [1] * 4)
    assert not match(s, ["a"])
    t = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False}
    assert match(t, ["a", 1]) and match(t, ["a"]) and match(t, []) and not match(t, ["a", 1, 2])
    d4 = {"type": "array", "items": [{"type": "string"}], "additionalItems": {"type": "null"}}
    assert match(d4, ["a", None, None]) and not match(d4, ["a", 1])


def test_any_of_one_of_and_siblings():
    s = {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}
    assert match(s, 5) and match(s, "ab") and not match(s, "abc")
    o = {"oneOf": [{"const": 1}, {"const": 2}]}
    assert match(o, 2) and not match(o, 3)
    sib = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "additionalProperties": False,
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    assert match(sib, {"a": 1}) and match(sib, {"b": 1}) and not match(sib, {})


def test_one_of_only_where_branches_are_exclusive():
    """oneOf is the union of its branches only when no value matches two of them; otherwise
    the keyword is reported (a union would let the model emit a value valid for both)."""
    tagged = {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                "required": ["kind"],
            },
            {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]},
        ]
    }
    assert match(tagged, {"kind": "a", "x": 1}) and match(tagged, {"kind": "b"})
    lengths = {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 5}]}
    assert match(lengths, "abc") and not match(lengths, "abcd")
    assert match({"oneOf": [{"type": "string"}, {"type": "integer"}]}, 3)
    closed = {"type": "object", "additionalProperties": False}
    keys = {
        "oneOf": [
            {**closed, "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {**closed, "properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ]
    }
    assert match(keys, {"a": 1}) and not match(keys, {"a": 1, "b": 2})
    # loom writes no unlisted keys, so objects written for one branch never carry the key the
    # other requires (JSON Schema alone would let {"id", "win", "lose"} match both)
    win_lose = {
        "oneOf": [
            {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id", "win"]},
            {"type": "object", "properties": {"lose": {"type": "object"}}, "required": ["lose"]},
        ]
    }
    assert match(win_lose, {"id": "x", "win": 1}) and match(win_lose, {"lose": {}})
    overlapping = [
        {"oneOf": [{"type": "number"}, {"type": "integer"}]},
        {"oneOf": [{"const": 1}, {"enum": [1.0, 2]}]},  # 1 and 1.0 are the same JSON value
        {"oneOf": [{"const": [1]}, {"const": [1.0]}]},
        {  # {"a": 1} also matches the second branch, whose unlisted keys are allowed
            "oneOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}},
            ]
        },
    ]
    for s in overlapping:
        with pytest.raises(GrammarError, match="oneOf"):
            json_schema_to_regex(s)
        json_schema_to_regex(s, lenient=True)  # a logged warning instead


@pytest.mark.parametrize(
    "deps",
    [
        {"dependencies": {"a": ["b", "c"], "b": ["d"]}},
        {"dependentRequired": {"a": ["b"]}, "dependentSchemas": {"c": {"required": ["d"]}}},
        {"required": ["a"], "dependencies": {"a": ["b"]}},
        {"dependencies": {"a": {"not": {"required": ["b"]}}, "b": {"not": {"required": ["a"]}}}},
        {"dependencies": {"c": {"properties": {"d": {"const": "x"}}, "required": ["d"]}}},
        {"additionalProperties": True, "dependencies": {"a": ["b"]}},
        {"dependencies": {"a": False, "b": True, "c": []}},
        {  # a variant whose nested anyOf is unsatisfiable is dropped, not an error
            "required": ["a"],
            "dependencies": {
                "a": {"anyOf": [{"required": ["b"]}, {"required": ["c"]}]},
                "b": {"not": {"required": ["a"]}},
            },
        },
    ],
)
def test_dependencies_against_jsonschema(deps):
    """Property and schema dependencies (draft 7 `dependencies`, 2019-09 `dependentRequired` /
    `dependentSchemas`): every subset of the keys, checked against jsonschema's validator."""
    import itertools

    import jsonschema

    props = {k: {"type": "integer"} for k in "abc"} | {"d": {"type": "string"}}
    s = {"type": "object", "properties": props, **deps}
    draft = "dependencies" not in deps
    validator = (jsonschema.Draft202012Validator if draft else jsonschema.Draft7Validator)(s)
    regex = json_schema_to_regex(s)
    values = {"a": 1, "b": 2, "c": 3, "d": "x"}
    for n in range(5):
        for keys in itertools.combinations("abcd", n):
            doc = {k: values[k] for k in keys}
            for v in (doc, {**doc, "d": "y"}):
                text = json.dumps(v, separators=(",", ":"))
                assert bool(re.fullmatch(regex, text)) == validator.is_valid(v), (deps, v)


@pytest.mark.parametrize(
    "extra",
    [
        {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {
            "oneOf": [
                {"required": ["a", "b"]},
                {"required": ["c"]},
                {"required": ["b"], "title": "x"},
            ]
        },
        {"required": ["c"], "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
        {"additionalProperties": True, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    ],
)
def test_one_of_required_branches_are_made_exclusive(extra):
    """oneOf branches that only require keys overlap (an object may have both), so each is
    written as itself minus the others: exactly JSON Schema's "exactly one" (jsonschema)."""
    import itertools

    import jsonschema

    s = {"type": "object", "properties": {k: {"type": "integer"} for k in "abc"}, **extra}
    validator, regex = jsonschema.Draft7Validator(s), json_schema_to_regex(s)
    for n in range(4):
        for keys in itertools.combinations("abc", n):
            v = {k: 1 for k in keys}
            text = json.dumps(v, separators=(",", ":"))
            assert bool(re.fullmatch(regex, text)) == validator.is_valid(v), (extra, v)


def test_pattern_properties_that_match_listed_keys_stay_sound():
    """A key both listed and matched by a patternProperties pattern must satisfy both schemas
    (MaskBench Github_medium---o9819: `id` has a 24-hex pattern, and a catch-all key pattern let
    any string through). The pattern's key regex cannot leave the listed names out, so its
    values also obey theirs: stricter than the schema, never looser (checked: nothing invalid
    is accepted)."""
    import jsonschema

    schemas = [
        {
            "type": "object",
            "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}},
            "patternProperties": {"^[a-z]{1,5}$": {"type": ["string", "number"]}},
        },
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "patternProperties": {"^x": {"type": "string"}},
            "additionalProperties": {"type": "integer"},
        },
        {
            "type": "object",
            "properties": {"type": {"enum": ["a", "bb"]}},
            "patternProperties": {"type": {"type": "string", "maxLength": 1}},
        },
    ]
    docs = [{}, {"id": "ab12"}, {"id": "zz"}, {"id": 5}, {"ab": "x"}, {"ab": 1}, {"a": 1}]
    docs += [{"a": "s"}, {"xa": "s"}, {"xa": 1}, {"q": 1}, {"type": "a"}, {"type": "bb"}]
    docs += [{"mytype": "a"}, {"mytype": "bb"}, {"id": "ab12", "ab": 1}]
    for s in schemas:
        regex, validator = json_schema_to_regex(s), jsonschema.Draft7Validator(s)
        for d in docs:
            if re.fullmatch(regex, json.dumps(d, separators=(",", ":"))):
                assert validator.is_valid(d), (s, d)
    assert match(schemas[0], {"id": "ab12"}) and not match(schemas[0], {"id": "zz"})
    assert match(schemas[2], {"type": "a"}) and not match(schemas[2], {"type": "bb"})
    assert match(schemas[1], {"a": 1, "xa": "s"}) and not match(schemas[1], {"xa": 1})


def test_enum_values_must_satisfy_the_other_keywords():
    """const/enum beside other keywords (merged allOf parts often look like this) admit only
    the values those keywords accept; without a `type`, keywords constrain their own type."""
    assert match({"enum": ["a", "bb"], "maxLength": 1}, "a")
    assert not match({"enum": ["a", "bb"], "maxLength": 1}, "bb")
    assert not match({"type": "string", "enum": ["a", 1]}, 1)
    mixed = {"enum": [3, 7, 2.5, "x"], "minimum": 3}
    assert all(match(mixed, v) for v in (3, 7, "x")) and not match(mixed, 2.5)
    objects = {"enum": [{"a": 1}, {"b": 2}], "required": ["a"]}
    assert match(objects, {"a": 1}) and not match(objects, {"b": 2})
    assert match({"enum": ["foo"], "properties": {"a": {}}, "additionalProperties": False}, "foo")
    with pytest.raises(GrammarError, match="no const/enum value"):
        json_schema_to_regex({"const": 3, "minimum": 5})
    with pytest.raises(GrammarError, match="no const/enum value"):
        json_schema_to_regex({"const": 3, "enum": [1, 2]})
    assert match({"const": 2, "enum": [1, 2.0]}, 2)


def test_all_of_is_merged():
    s = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            {"properties": {"a": {"minimum": 0, "maximum": 9}}},
        ],
    }
    assert match(s, {"a": 3, "b": "x"})
    assert not match(s, {"a": 3}) and not match(s, {"b": "x"}) and not match(s, {"a": 10, "b": ""})
    regex = json_schema_to_regex(s)
    assert not re.fullmatch(regex, '{"a":3}{"b":"x"}')  # merged, not concatenated
    with pytest.raises(GrammarError, match="allOf"):
        json_schema_to_regex({"allOf": [{"type": "string"}, {"type": "integer"}]})
    # additionalProperties sees only its own schema's properties: keys the other parts list
    # are additional to it (JSON Schema's rule; jsonschema agrees)
    closed = {
        "allOf": [
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": False,
            },
            {"properties": {"b": {"type": "integer"}}},
        ]
    }
    assert match(closed, {"a": 1}) and not match(closed, {"b": 1})
    typed = {
        "allOf": [
            {"properties": {"a": {}}, "additionalProperties": {"type": "string"}},
            {"properties": {"b": {"type": ["integer", "string"]}}},
        ]
    }
    assert match(typed, {"a": 1, "b": "y"}) and not match(typed, {"b": 1})
    with pytest.raises(GrammarError, match="admits no value"):  # a is required and additional
        json_schema_to_regex({**s, "additionalProperties": False})


def test_plain_name_refs_resolve_to_their_anchor():
    # draft 4 `id: "#name"` / `$anchor`: MaskBench Github_easy---o35904 was read as `#` (the
    # root), which let an invalid {"d": {"limit": -1}} through as an unlisted key
    cap = {
        "id": "#cap",
        "type": "object",
        "properties": {"limit": {"type": "number", "minimum": 0}},
    }
    s = {"definitions": {"c": cap}, "type": "object", "properties": {"d": {"$ref": "#cap"}}}
    spec = {"additional_properties_default": True}
    assert match(s, {"d": {"limit": 1}}, **spec) and not match(s, {"d": {"limit": -1}}, **spec)
    anchored = {"$defs": {"n": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"}
    assert match(anchored, 3) and not match(anchored, "3")
    with pytest.raises(GrammarError, match="does not resolve"):
        json_schema_to_regex({"$ref": "#nowhere"})


def test_refs_and_recursion():
    s = {
        "$defs": {"pos": {"type": "integer", "minimum": 1}},
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/pos"}, "m": {"$ref": "#/definitions/x"}},
        "definitions": {"x": {"type": "boolean"}},
    }
    assert match(s, {"n": 2, "m": True}) and not match(s, {"n": 0})
    rec = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
                "required": ["v"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    with pytest.raises(GrammarError, match="recursive"):
        json_schema_to_regex(rec)
    import lark

    parser = lark.Lark(json_schema_to_lark(rec), parser="earley")
    parser.parse('{"v":1,"next":{"v":2,"next":{"v":3}}}')
    with pytest.raises(lark.exceptions.LarkError):
        parser.parse('{"v":1,"next":{"next":{"v":3}}}')
    with pytest.raises(GrammarError, match="remote"):
        json_schema_to_regex({"$ref": "https://example.com/s.json"})


def test_not_forms():
    assert match({"not": {"type": "string"}}, 1) and not match({"not": {"type": "string"}}, "a")
    s = {"type": "string", "not": {"enum": ["a", "b"]}}
    assert match(s, "c") and match(s, "ab") and not match(s, "a")
    assert match({"anyOf": [{"not": {}}, {"type": "null"}]}, None)
    assert match({"not": {"not": {"type": "integer"}}}, 1)
    obj = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "not": {"required": ["a"]},
    }
    assert match(obj, {"b": 1}) and not match(obj, {"a": 1})
    with pytest.raises(GrammarError, match="'not'"):
        json_schema_to_regex({"not": {"minimum": 3}})


def test_unsupported_keyword_named_with_path():
    s = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(GrammarError, match=r"#/properties/tags.*uniqueItems"):
        json_schema_to_regex(s)
    json_schema_to_regex(s, lenient=True)  # a logged warning instead
    assert match({"title": "t", "description": "d", "examples": [1], "type": "integer"}, 1)


def test_inputs_string_dict_pydantic():
    pydantic = pytest.importorskip("pydantic")

    class User(pydantic.BaseModel):
        name: str
        age: int

    r1 = json_schema_to_regex(User)
    r2 = json_schema_to_regex(json.dumps(User.model_json_schema()))
    assert r1 == r2 and re.fullmatch(r1, '{"name":"a","age":3}')


def test_whitespace_is_bounded():
    regex = json_schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert re.fullmatch(regex, '{"a": 1}') and not re.fullmatch(regex, '{"a":  1}')
    loose = json_schema_to_regex(
        {"type": "array", "items": {"type": "integer"}}, whitespace_pattern=r"[ \n]{0,2}"
    )
    assert re.fullmatch(loose, "[\n 1 ,\n2 ]")


def test_compiled_grammar_walk():
    tok = byte_bpe()
    vocab = TokenVocabulary.from_tokenizer(tok)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    g = compile_json_schema(schema, vocab)
    assert g.jump_forward() == '{"name":'
    bm = allocate_token_bitmask(1, vocab.vocab_size)
    for t in encode(tok, '{"name": "héllo", "age": 42}'):
        g.fill_mask(bm, 0)
        assert unpack_bitmask(bm, vocab.vocab_size)[0, t]
        g.accept_token(t)
    assert g.is_terminated()


def _accepts(g, tok, vocab, text: str) -> bool:
    g, bm = g.copy(), allocate_token_bitmask(1, vocab.vocab_size)
    for t in encode(tok, text):
        g.fill_mask(bm, 0)
        if not unpack_bitmask(bm, vocab.vocab_size)[0, t]:
            return False
        g.accept_token(t)
    g.fill_mask(bm, 0)
    return bool(unpack_bitmask(bm, vocab.vocab_size)[0, min(vocab.eos_token_ids)])


def test_recursive_schema_lalr_refuses_falls_back_to_bounded_regex(caplog):
    """Both anyOf branches accept {}: an ambiguous grammar the LALR(1) CFG engine refuses.
    The fallback expands the recursion `max_recursion` times: outputs stay valid, and deeper
    documents are refused (and the compile says so in the log)."""
    tok = byte_bpe()
    vocab = TokenVocabulary.from_tokenizer(tok)
    node = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/node"}},
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"b": {"type": "integer"}},
                "additionalProperties": False,
            },
        ]
    }
    schema = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    with caplog.at_level("WARNING"):
        g = compile_json_schema(schema, vocab)
    assert "expanded 3 levels" in caplog.text
    for ok in ("{}", '{"b":1}', '{"a":{"a":{"b":2}}}', '{"a":{"a":{}}}'):
        assert _accepts(g, tok, vocab, ok), ok
    for bad in ('{"a":1}', '{"c":{}}', '{"a":{"a":{"a":{"a":{}}}}}'):
        assert not _accepts(g, tok, vocab, bad), bad


BUNDLED = os.path.join(os.path.dirname(__file__), "..", "runtime", "bundled")


@pytest.mark.skipif(not os.path.exists(os.path.join(BUNDLED, "tokenizer.json")), reason="no model")
def test_bundled_tokenizer_padded_vocab():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUNDLED)
    with open(os.path.join(BUNDLED, "config.json")) as f:
        model_vocab = json.load(f)["vocab_size"]
    vocab = TokenVocabulary.from_tokenizer(tok, vocab_size=model_vocab)
    assert vocab.vocab_size == model_vocab and vocab.token_bytes[-1] is None
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string"}},
        "required": ["capital"],
    }
    g = compile_json_schema(schema, vocab)
    bm = allocate_token_bitmask(1, model_vocab)
    for t in tok.encode('{"capital": "Paris"}', add_special_tokens=False):
        g.fill_mask(bm, 0)
        allowed = unpack_bitmask(bm, model_vocab)[0]
        assert allowed[t] and not allowed[len(tok) :].any()
        g.accept_token(t)
    assert g.is_terminated()
