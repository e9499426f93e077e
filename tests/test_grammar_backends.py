"""One soundness suite for every grammar engine, at the toy vocabulary and at Llama 3's 128k.

For each engine (`GrammarBackend(engine=...)`) and each vocabulary:
- valid instances (checked with jsonschema / re.fullmatch / lark here, so the lists cannot be
  wrong) are accepted token by token and end with EOS allowed; invalid ones are not;
- random walks over the masks (seeded) end in text that validates: what the engine lets
  through is in the language;
- masks never allow ids without bytes (special tokens, vocabulary padding) except EOS at the
  end; a rejected token leaves the state unchanged; rollback and copy restore positions;
  jump-forward text is what the grammar forces.
And the compile bounds: a pathological spec is stopped at the timeout with a clear error while
ordinary specs compile meanwhile, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import random
import re
import time

import jsonschema
import lark
import pytest

from loom.grammar.backend import GrammarBackend
from loom.grammar.base import GrammarError, allocate_token_bitmask, unpack_bitmask
from loom.grammar.engines import ENGINES
from tests.conftest_grammar import ARITH_GBNF, ARITH_LARK, byte_bpe

SCHEMAS = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
        },
        [{"name": "Bob", "age": 42}, {"name": "héllo 😀 日本", "age": 0}],
        [
            {"name": "x", "age": -1},
            {"name": "x"},
            {"name": "x", "age": 1.5},
            {"name": "a" * 13, "age": 1},
        ],
    ),
    ({"enum": ["red", "green", 1, None]}, ["red", 1, None], ["blue", 2, "Red"]),
    (
        {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{1,3}$"},
        ["ab-12", "abcd-123"],
        ["ab-", "abcde-1", "ab-1234", "AB-1"],
    ),
    (
        {"type": "number", "exclusiveMinimum": 0.5, "maximum": 10},
        [0.6, 10, 3, 9.99],
        [0.5, 10.01, -1, "3"],
    ),
    (
        {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        [[True], [False, True, True]],
        [[], [True] * 4, [1]],
    ),
    (
        {"oneOf": [{"type": "integer"}, {"type": "string", "format": "date"}]},
        [3, -17, "2024-01-31"],
        [3.5, "hello", "2024-13-01", None],
    ),
    (
        {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
            "required": ["v"],
            "additionalProperties": False,
        },
        [{"v": 1}, {"v": 1, "next": {"v": 2, "next": {"v": 3}}}],
        [{"next": {"v": 1}}, {"v": "a"}, {"v": 1, "next": {"w": 2}}],
    ),
    (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "format": "uuid"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "meta": {},
            },
            "required": ["id"],
        },
        [
            {"id": "123e4567-e89b-12d3-a456-426614174000"},
            {"id": "123e4567-e89b-12d3-a456-426614174000", "tags": ["a", ""], "meta": [1, {}]},
        ],
        [
            {"id": "123e4567"},
            {"tags": []},
            {"id": "123e4567-e89b-12d3-a456-426614174000", "tags": [1]},
        ],
    ),
]

REGEXES = [
    (
        r"[a-z]{3,8}@[a-z]{3,6}\.(com|org)",
        ["abc@defg.com", "abcdefgh@xyz.org"],
        ["ab@cd.com", "abc@def.net"],
    ),
    (r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])", ["1999-01", "2024-12"], ["2024-13", "1899-01", "2024-1"]),
    (
        r"(héllo|你好|😀)( (héllo|你好|😀)){0,2}",
        ["héllo", "你好 😀 héllo"],
        ["hello", "你好  😀", "😀 😀 😀 😀"],
    ),
    (r"-?\d+(\.\d+)?", ["0", "-12.50"], ["1.", "--1", ".5"]),
    # \d \w \s are ASCII classes (as in xgrammar): Unicode digits, letters and spaces are out
    (
        r"[A-Z]{2}-\d{2}\s\w+[^\W_]\S",
        ["AB-12 x_9!", "ZZ-00\tab."],
        ["AB-\u06f1\u06f2 ab!", "AB-12\u00a0ab!", "AB-12 \u00e9a!", "AB-12 a_!", "AB-12 ab "],
    ),
]
CHOICES = (["yes", "no", "maybe", "y"], ["y", "yes", "maybe"], ["ye", "yess", "No"])
ARITH_VALID, ARITH_INVALID = ["1+2*(3-4)", "7", "(((1)))/2"], ["1+", "(1", "1234", "1 + 2"]
ARITH_PARSER = lark.Lark(ARITH_LARK, parser="earley")

VOCABS = ["toy", "llama3"]
_BACKENDS: dict = {}


def _tokenizer(name: str):
    if name == "toy":
        return byte_bpe()
    from tests.real_tokenizers import llama3_tokenizer

    return llama3_tokenizer()


@pytest.fixture(params=[(e, v) for v in VOCABS for e in ENGINES], ids=lambda p: f"{p[0]}-{p[1]}")
def setup(request):
    return _backend(*request.param)


def _backend(engine: str, vocab: str):
    if (engine, vocab) not in _BACKENDS:
        tok = _tokenizer(vocab)
        pad = 64 if vocab == "toy" else 0  # the toy model's vocabulary is padded past the tokenizer
        _BACKENDS[(engine, vocab)] = (
            GrammarBackend(tok, len(tok) + pad, {tok.eos_token_id}, engine=engine),
            tok,
        )
    return _BACKENDS[(engine, vocab)]


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _allowed(g, n: int):
    bm = allocate_token_bitmask(1, n)
    g.fill_mask(bm, 0)
    return unpack_bitmask(bm, n)[0]


def _accepts(backend, tok, g, text: str) -> bool:
    g, n, eos = g.copy(), backend.vocab_size, tok.eos_token_id
    for t in _encode(tok, text):
        if not _allowed(g, n)[t]:
            return False
        g.accept_token(t)
    return bool(_allowed(g, n)[eos])


def _walk(backend, tok, g, rng: random.Random, max_steps: int = 200) -> bytes | None:
    """Random tokens from the mask (half the time a one-byte token, to reach the end) until
    EOS; the bytes, or None when the walk ran out of steps."""
    g, n, eos = g.copy(), backend.vocab_size, tok.eos_token_id
    bytes_of, out = backend.vocab.token_bytes, []
    no_bytes, one_byte = _vocab_masks(backend)
    for _ in range(max_steps):
        allowed = _allowed(g, n)
        special = (allowed & no_bytes).nonzero()[:, 0].tolist()
        assert set(special) <= {eos}, f"ids without bytes allowed: {special[:5]}"
        allowed[eos] = False
        ids = allowed.nonzero()[:, 0]
        if special and (not len(ids) or rng.random() < 0.5):
            return b"".join(out)
        assert len(ids), "a dead end: nothing allowed, not even EOS"
        short = (allowed & one_byte).nonzero()[:, 0]
        pool = short if len(short) and rng.random() < 0.5 else ids
        t = int(pool[rng.randrange(len(pool))])
        g.accept_token(t)
        out.append(bytes_of[t])
    return None


def _vocab_masks(backend):
    """(ids without bytes, ids of one byte) as bool tensors, once per backend."""
    if not hasattr(backend, "_test_masks"):
        import torch

        tb = backend.vocab.token_bytes
        backend._test_masks = (
            torch.tensor([b is None for b in tb]),
            torch.tensor([b is not None and len(b) == 1 for b in tb]),
        )
    return backend._test_masks


def _check_walks(backend, tok, g, valid, seeds=range(4)) -> None:
    finished = 0
    for seed in seeds:
        out = _walk(backend, tok, g, random.Random(seed))
        if out is not None:
            finished += 1
            assert valid(out.decode("utf-8")), out
    assert finished, "no random walk reached the end"


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_json_schema_sound_and_complete(setup, i):
    backend, tok = setup
    schema, good, bad = SCHEMAS[i]
    g = backend.compile("json_schema", schema)
    for value in good:
        jsonschema.validate(value, schema)
        for text in (
            json.dumps(value, ensure_ascii=False),
            json.dumps(value, separators=(",", ":")),
        ):
            assert _accepts(backend, tok, g, text), text
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
        assert not _accepts(backend, tok, g, json.dumps(value, ensure_ascii=False)), value

    def valid(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        return True

    _check_walks(backend, tok, g, valid)


@pytest.mark.parametrize("i", range(len(REGEXES)))
def test_regex_sound_and_complete(setup, i):
    backend, tok = setup
    pattern, good, bad = REGEXES[i]
    g = backend.compile("regex", pattern)
    for text in good:
        assert re.fullmatch(pattern, text, re.A) and _accepts(backend, tok, g, text), text
    for text in bad:
        assert not re.fullmatch(pattern, text, re.A) and not _accepts(backend, tok, g, text), text
    _check_walks(backend, tok, g, lambda text: re.fullmatch(pattern, text, re.A) is not None)


def test_choices(setup):
    backend, tok = setup
    choices, good, bad = CHOICES
    g = backend.compile("choices", choices)
    assert all(_accepts(backend, tok, g, t) for t in good)
    assert not any(_accepts(backend, tok, g, t) for t in bad)
    _check_walks(backend, tok, g, lambda text: text in choices)


@pytest.mark.parametrize("kind,spec", [("ebnf", ARITH_GBNF), ("lark", ARITH_LARK)])
def test_cfg(setup, kind, spec):
    backend, tok = setup
    g = backend.compile(kind, spec)

    def parses(text: str) -> bool:
        try:
            ARITH_PARSER.parse(text)
            return True
        except lark.exceptions.LarkError:
            return False

    for text in ARITH_VALID:
        assert parses(text) and _accepts(backend, tok, g, text), text
    for text in ARITH_INVALID:
        assert not parses(text) and not _accepts(backend, tok, g, text), text
    _check_walks(backend, tok, g, parses)


def test_contract_reject_rollback_copy_jump_forward(setup):
    backend, tok = setup
    schema = SCHEMAS[0][0]
    g = backend.compile("json_schema", schema)
    n, eos = backend.vocab_size, tok.eos_token_id
    assert g.jump_forward() == '{"name":'
    start = _allowed(g, n).clone()
    assert not start[eos] and not start[len(tok) :].any()
    with pytest.raises(GrammarError):
        g.accept_token(eos)  # EOS before the end
    bad = _encode(tok, "}")[0]
    with pytest.raises(GrammarError):
        g.accept_token(bad)
    assert (_allowed(g, n) == start).all()  # the refused tokens changed nothing
    ids = _encode(tok, '{"name": "Al", "age": 7}')
    for t in ids[:4]:
        g.accept_token(t)
    mid = _allowed(g, n).clone()
    fork = g.copy()
    for t in ids[4:]:
        g.accept_token(t)
    assert g.is_terminated() and _allowed(g, n)[eos] and g.jump_forward() is None
    assert (_allowed(fork, n) == mid).all()  # the copy kept its own position
    g.rollback(len(ids) - 4)
    assert (_allowed(g, n) == mid).all() and not g.is_terminated()
    g.rollback(4)
    assert (_allowed(g, n) == start).all()
    with pytest.raises(GrammarError):
        g.rollback(1)


def test_compile_errors_name_the_problem(setup):
    backend, _ = setup
    with pytest.raises(GrammarError, match="uniqueItems"):
        backend.compile("json_schema", {"type": "array", "uniqueItems": True})
    with pytest.raises(GrammarError):
        backend.compile("regex", "(unclosed")
    with pytest.raises(GrammarError, match="root"):
        backend.compile("ebnf", 'expr ::= "a"')
    limit, backend.max_spec_chars = backend.max_spec_chars, 10
    try:
        with pytest.raises(GrammarError, match="11 characters; the limit is 10"):
            backend.compile("regex", "a" * 11)
    finally:
        backend.max_spec_chars = limit


PATHOLOGICAL = [
    {"oneOf": [{"type": "string", "pattern": f"^(a|b)*{x}(a|b){{25}}$"}, {"type": "string"}]}
    for x in "ab"
]


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def test_pathological_specs_are_stopped_and_do_not_delay_others():
    """Two specs whose translation would run for hours, submitted with 20 ordinary ones: the
    ordinary ones compile while the two run, the two fail at the timeout with a clear error,
    their worker processes are killed and the CPU goes back to idle."""
    tok = byte_bpe()
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, compile_timeout=8.0)
    try:
        slow = [backend.compile_async("json_schema", s) for s in PATHOLOGICAL]
        ordinary = [
            backend.compile_async(
                "json_schema",
                {
                    "type": "object",
                    "properties": {f"k{i}": {"type": "integer"}},
                    "required": [f"k{i}"],
                },
            )
            for i in range(20)
        ]
        grammars = [f.result(timeout=60) for f in ordinary]
        assert not any(f.done() for f in slow)  # the ordinary ones did not wait for them
        for i, g in enumerate(grammars):
            assert g.jump_forward() == f'{{"k{i}":'
        for f in slow:
            with pytest.raises(GrammarError, match="longer than 8 s"):
                f.result(timeout=60)
        # the two killed workers are gone; the ones that served the others wait on a pipe
        assert backend._translators.alive() <= 2
        before = _cpu_seconds()
        time.sleep(1.0)
        assert _cpu_seconds() - before < 0.3  # nothing left burning
        # the timed-out specs fail fast from the cache; the workers serve new specs
        with pytest.raises(GrammarError, match="longer than"):
            backend.compile("json_schema", PATHOLOGICAL[0])
        assert backend.compile_async("regex", "[0-9]+").result(timeout=30) is not None
    finally:
        backend.shutdown()


def test_grammar_backend_flag_names_the_engines():
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.server_args_choices import GRAMMAR_BACKENDS

    assert set(GRAMMAR_BACKENDS) == set(ENGINES)
    assert ServerArgs(model_path="x").grammar_backend == "llguidance"
    with pytest.raises(ValueError, match="grammar_backend.*'loom'"):
        ServerArgs(model_path="x", grammar_backend="loom")
    tok = byte_bpe()
    with pytest.raises(ValueError, match="unknown grammar engine 'lark'"):
        GrammarBackend(tok, engine="lark")


def test_llguidance_from_a_raw_tokenizers_tokenizer():
    """A `tokenizers.Tokenizer` (no transformers wrapper) reaches llguidance through loom's
    own byte table (the path for any tokenizer llguidance cannot read itself)."""
    tok = byte_bpe()
    backend = GrammarBackend(tok.backend_tokenizer, len(tok) + 64, {tok.eos_token_id})
    schema, good, bad = SCHEMAS[0]
    g = backend.compile("json_schema", schema)
    assert all(_accepts(backend, tok, g, json.dumps(v, ensure_ascii=False)) for v in good)
    assert not any(_accepts(backend, tok, g, json.dumps(v, ensure_ascii=False)) for v in bad)
    _check_walks(
        backend, tok, g, lambda text: jsonschema.validate(json.loads(text), schema) or True
    )
    assert g.jump_forward() == '{"name":'


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar"])
def test_schema_whose_regex_nests_too_deep_compiles_as_lark(engine):
    """60 optional members nest the schema's regex past the engine's regex parser limit; the
    backend then compiles the same schema as Lark rules."""
    tok = byte_bpe()
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, engine=engine)
    props = {f"k{i}": {"type": "string", "maxLength": 40} for i in range(60)}
    schema = {"type": "object", "properties": props}
    g = backend.compile("json_schema", schema)
    assert _accepts(backend, tok, g, json.dumps({"k3": "x", "k59": "yz"}))
    assert not _accepts(backend, tok, g, json.dumps({"k3": "x" * 41}))
    _check_walks(
        backend, tok, g, lambda text: jsonschema.validate(json.loads(text), schema) or True
    )


def _long_regex_schema() -> dict:
    item = {
        "type": "object",
        "properties": {f"f{i}": {"type": ["string", "integer"]} for i in range(9)},
    }
    return {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1},
            "items": {"type": "array", "items": item, "maxItems": 4},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
            "owner": item,
            "peer": {"type": "object", "properties": {"a": item, "b": item}},
        },
        "required": ["id"],
    }


@pytest.mark.parametrize("vocab", VOCABS)
def test_schema_past_the_regex_limit_compiles_as_rules(vocab):
    """llguidance takes a schema whose regex passes its json_regex_limit as Lark rules (one
    JSON token per terminal), and that form is as sound and complete as the regex."""
    from loom.grammar.forms import translate

    backend, tok = _backend("llguidance", vocab)
    schema = _long_regex_schema()
    limit = backend.engine.json_regex_limit
    assert len(translate("json_schema", schema, backend.json_options, "regex").text) > limit
    form = translate("json_schema", schema, backend.json_options, "regex", limit)
    assert form.syntax == "lark"
    g = backend.compile("json_schema", schema)
    good = [
        {"id": 1},
        {"id": 7, "items": [{"f0": "x", "f8": 3}, {}], "tags": ["a", "c"], "owner": {"f4": -2}},
        {"id": 2, "tags": [], "peer": {"a": {"f1": "y"}, "b": {}}},
    ]
    bad = [{}, {"id": 0}, {"id": 1, "items": [{}] * 5}, {"id": 1, "tags": ["d"]},
           {"id": 1, "owner": {"f9": 1}}, {"id": 1, "peer": {"a": {"f0": 1.5}}}]  # fmt: skip
    for value in good:
        jsonschema.validate(value, schema)
        assert _accepts(backend, tok, g, json.dumps(value)), value
        assert _accepts(backend, tok, g, json.dumps(value, separators=(",", ":"))), value
    for value in bad:
        if value.get("owner") is None:  # unlisted keys are valid JSON Schema, refused strictly
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(value, schema)
        assert not _accepts(backend, tok, g, json.dumps(value)), value

    def valid(text: str) -> bool:
        jsonschema.validate(json.loads(text), schema)
        return True

    _check_walks(backend, tok, g, valid)


def test_dropped_backend_and_closed_scheduler_leave_no_worker_processes():
    """A backend garbage-collected without shutdown() kills its translation workers (each a
    fork of the caller's memory); Scheduler.close() shuts its grammar backend down."""
    import gc
    import multiprocessing as mp

    from loom.runtime.scheduler.grammar_queue import GrammarQueue

    def workers() -> set[int]:
        return {p.pid for p in mp.active_children() if p.name == "loom-translate"}

    before = workers()
    tok = byte_bpe()
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, compile_timeout=30.0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    backend.compile("json_schema", schema)
    assert workers() - before  # a worker served the translation
    del backend
    gc.collect()
    assert workers() <= before

    queue = GrammarQueue(tok, len(tok), {tok.eos_token_id}, timeout=30.0)
    queue.backend.compile("json_schema", schema)
    assert workers() - before
    queue.close()
    assert workers() <= before


def test_is_forced_covers_jump_forward_and_a_cut_character(setup):
    """`is_forced` (the lazy greedy rows mask such states): true wherever jump_forward has
    text, false where the continuations differ; llguidance also counts forced bytes that only
    start a character (jump_forward cuts them and returns None there)."""
    backend, tok = setup
    g = backend.compile("json_schema", SCHEMAS[0][0])
    assert g.jump_forward() is not None and g.is_forced()
    g = backend.compile("regex", "(é|è)x")
    if g.jump_forward() is not None:
        assert g.is_forced()
    if backend.engine_name == "llguidance":  # both start with the byte 0xC3
        assert g.jump_forward() is None and g.is_forced()
    g = backend.compile("regex", "(a|b)x")
    assert g.jump_forward() is None and not g.is_forced()


def test_forced_token_is_one_the_mask_allows(setup):
    """`forced_token` (the lazy greedy rows accept a draft token equal to it at a forced state
    without computing the mask): wherever an engine names one, its mask allows it. Checked at
    every state of every schema's valid documents and of random walks through them."""
    backend, tok = setup
    n = backend.vocab_size
    if backend.engine_name != "llguidance":  # the others name none: the mask always decides
        assert backend.compile("json_schema", SCHEMAS[0][0]).forced_token() is None
        return
    named = 0
    for i, (schema, good, _) in enumerate(SCHEMAS):
        g = backend.compile("json_schema", schema)
        paths = [_encode(tok, json.dumps(v, ensure_ascii=False)) for v in good]
        rng = random.Random(i)
        for _ in range(3):  # random walks, steered like _walk's
            w, path = g.copy(), []
            for _ in range(120):
                allowed = _allowed(w, n)
                allowed[tok.eos_token_id] = False
                ids = allowed.nonzero()[:, 0]
                if not len(ids):
                    break
                t = int(ids[rng.randrange(len(ids))])
                w.accept_token(t)
                path.append(t)
            paths.append(path)
        for path in paths:
            w = g.copy()
            for t in path:
                forced = w.forced_token()
                if forced is not None:
                    assert w.is_forced()
                    assert _allowed(w, n)[forced], (schema, forced)
                    named += 1
                if not _allowed(w, n)[t]:
                    break
                w.accept_token(t)
    assert named > 20  # the schemas' keys and punctuation are forced text
