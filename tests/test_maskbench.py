"""MaskBench on a fixed subset, at Llama 3's 128k vocabulary, with MaskBench's own walk rules.

The subset is every 40th schema file of the full corpus in sorted name order (all of MaskBench's
subsets are spread through the sorted list), vendored in tests/data (see tests/data/README.md). Each schema is compiled by loom's GrammarBackend (the default
engine) and every test instance walked through benchmarks/maskbench_coverage.py's harness, the
one the full-corpus figures in docs/benchmarks.md come from: `json.dumps` with its default
separators, a valid instance must have every token allowed, an invalid one some token rejected.

Two checks: no invalid instance is accepted outside PINNED (each entry says why the schema
cannot be held exactly by a token mask), and the share of schemas passing stays near the one
measured. A schema that does not compile must fail with a GrammarError that says why.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.file_modules import load_file
from tests.maskbench_data import DATA, subset

# 11,305 files -> 283 schemas, under a minute at 128k tokens on one core
# Invalid instances a token mask accepts and why (MaskBench has no end-of-output check, so an
# instance that is a prefix of a valid one is accepted by every engine).
PINNED: dict[str, str] = {
    "Github_medium---o82710.json": "description maxLength 5000 is above JsonSchemaOptions."
    "max_repeat (512), so it is not enforced (logged); test 3's 7,135-character description",
}
FLOOR = 0.85  # measured 0.873 (247 of 283) at 023768b (llguidance engine)


def _harness():
    return load_file("benchmarks/maskbench_coverage.py", "maskbench_coverage")


def _subset() -> list[str]:
    return subset("maskbench")


@pytest.fixture(scope="module")
def llama3_loom():
    """(harness, tokenizer, loom engine) at Llama 3's vocabulary, shared by this file's tests."""
    pytest.importorskip("llama_models")
    from tests.real_tokenizers import llama3_tokenizer

    mb = _harness()
    tok = llama3_tokenizer()
    return mb, tok, mb.LoomEngine(tok, len(tok), spec_additional=False, engine=None)


def test_maskbench_subset_llama3(llama3_loom):
    mb, tok, engine = llama3_loom
    status: Counter = Counter()
    accepted_invalid, wrong_valid = [], []
    for name in _subset():
        doc = json.loads((DATA / name).read_text())
        rec = mb.check_schema(engine, doc, tok)
        status[rec["status"]] += 1
        if rec["status"] == "compile_error":
            assert rec["reason"].startswith("GrammarError: ") and len(rec["reason"]) > 14, rec
        if rec["invalid_accepted"] and name not in PINNED:
            accepted_invalid.append((name, rec["reason"]))
        if rec["valid_rejected"]:
            wrong_valid.append((name, rec["reason"]))
        assert rec["status"] != "crash", (name, rec["reason"])
    n = sum(status.values())
    share = status["pass"] / n
    print(f"maskbench subset (Llama 3): {dict(status)} of {n}; pass share {share:.3f}")
    assert not accepted_invalid, accepted_invalid
    assert share >= FLOOR, (dict(status), wrong_valid[:10])


# Valid documents that llguidance refused when these schemas reached it as one regex (15-95k
# characters), each refused at a token such as ' [{"' after a key: past the engine's
# json_regex_limit the schema comes as Lark rules, which accept every valid instance.
LONG_REGEX = [
    "Github_medium---o13402.json",
    "Github_medium---o14475.json",
    "Github_medium---o4850.json",
]


def test_schemas_with_long_regexes_compile_as_rules(llama3_loom):
    from loom.grammar.forms import translate

    mb, tok, engine = llama3_loom
    backend = engine.backend
    limit = backend.engine.json_regex_limit
    for name in LONG_REGEX:
        doc = json.loads((DATA / name).read_text())
        regex = translate("json_schema", doc["schema"], backend.json_options, "regex")
        assert regex.syntax == "regex" and len(regex.text) > limit, name
        form = translate("json_schema", doc["schema"], backend.json_options, "regex", limit)
        assert form.syntax == "lark", name
        rec = mb.check_schema(engine, doc, tok)
        assert rec["status"] == "pass", (name, rec["reason"])


class _Chars:
    """A tokenizer whose tokens are characters (id = code point)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


class _PrefixEngine:
    """An engine over a finite language: a token is allowed while the text stays a prefix of
    one of the schema's `accept` strings; EOS once the text is one of them."""

    def compile(self, schema):
        if "accept" not in schema:
            raise ValueError("no language")
        return schema["accept"]

    def matcher(self, accept):
        return _PrefixMatcher(accept)


class _PrefixMatcher:
    def __init__(self, accept):
        self.accept, self.text = accept, ""

    def step(self, t):
        if not any(a.startswith(self.text + chr(t)) for a in self.accept):
            return False
        self.text += chr(t)
        return True

    def eos_allowed(self):
        return self.text in self.accept


def _check(accept, tests):
    mb = _harness()
    doc = {"schema": {} if accept is None else {"accept": accept}}
    doc["tests"] = [{"data": d, "valid": v} for d, v in tests]
    return mb.check_schema(_PrefixEngine(), doc, _Chars())


def test_harness_follows_maskbench_rules():
    # json.dumps default separators: ", " and ": "
    rec = _check(['{"a": 1, "b": [1, 2]}'], [({"a": 1, "b": [1, 2]}, True)])
    assert rec["status"] == "pass" and rec["walks"] == [(0, True, 21)]
    assert _check(['{"a":1}'], [({"a": 1}, True)])["status"] == "wrong_valid"
    # an invalid instance passes when some token is rejected ...
    assert _check(["10"], [(10, True), (11, False)])["status"] == "pass"
    # ... and no end-of-output check rescues one that is a prefix of a valid document
    rec = _check(["10"], [(10, True), (1, False)])
    assert rec["status"] == "wrong_invalid" and rec["invalid_accepted"] == 1
    # a valid walk that ends where EOS is not allowed still counts, and is recorded
    rec = _check(["100"], [(10, True)])
    assert rec["status"] == "pass" and rec["valid_no_eos"] == 1
    # accepted-invalid is reported before rejected-valid; every instance is walked
    rec = _check(["12"], [(3, True), (1, False), (12, True)])
    assert rec["status"] == "wrong_invalid" and rec["valid_rejected"] == 1
    assert [w[0] for w in rec["walks"]] == [0, 1, 2]
    # any exception while compiling is a compile error, with its reason
    rec = _check(None, [(1, True)])
    assert rec["status"] == "compile_error" and rec["reason"] == "ValueError: no language"
    # bench_grammar's timing set: the first valid instances only
    mb = _harness()
    doc = {"schema": {"accept": ["1", "2"]}, "tests": [
        {"data": 3, "valid": False}, {"data": 1, "valid": True}, {"data": 2, "valid": True}]}  # fmt: skip
    rec = mb.check_schema(_PrefixEngine(), doc, _Chars(), max_valid=1)
    assert rec["walks"] == [(1, True, 1)]
