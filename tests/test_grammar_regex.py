"""Regex grammars over a real (trained) byte-level BPE tokenizer and a SentencePiece-style one."""

from __future__ import annotations

import functools
import json
import random
import re

import pytest
import torch

from loom.grammar.base import GrammarError, allocate_token_bitmask, unpack_bitmask
from loom.grammar.choices import choices_to_regex
from loom.grammar.regex_grammar import CompiledRegex, RegexGrammar
from loom.grammar.vocab import TokenVocabulary
from tests.conftest_grammar import byte_bpe, encode, sentencepiece_like

PAD_VOCAB = 1300  # model vocabulary padded beyond the tokenizer's 1200 ids

CORPUS = {
    "email": (r"[a-z0-9._]+@[a-z0-9]+\.(com|org|net)", ["user1@example.com", "a.b_c@x9.org"]),
    "date": (r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", ["2024-01-31", "1999-12-01"]),
    "ipv4": (
        r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
        ["10.0.0.1", "255.255.255.0", "192.168.1.254"],
    ),
    "phone": (r"\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}", ["+1-555-123-4567"]),
    "hex": (r"#[0-9a-fA-F]{6}", ["#a0b1c2", "#FFFFFF"]),
    "unicode": (r"(héllo|wörld|日本語|😀| )+", ["héllo wörld", "日本語😀", "😀 😀"]),
}


@pytest.fixture(scope="module")
def tok():
    return byte_bpe()


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocabulary.from_tokenizer(tok, vocab_size=PAD_VOCAB)


def allowed_ids(g, n: int | None = None) -> set[int]:
    n = n or g.compiled.vocab.vocab_size
    bm = allocate_token_bitmask(1, n)
    g.fill_mask(bm, 0)
    return set(unpack_bitmask(bm, n)[0].nonzero().flatten().tolist())


def walk(g, ids, vocab) -> bool:
    """Accept `ids` one by one; True if all were allowed and EOS may follow."""
    for t in ids:
        if t not in allowed_ids(g, vocab.vocab_size):
            return False
        g.accept_token(t)
    return bool(allowed_ids(g, vocab.vocab_size) & vocab.eos_token_ids)


def test_vocab_bytes_roundtrip(tok, vocab):
    assert vocab.vocab_size == PAD_VOCAB and len(vocab.token_bytes) == PAD_VOCAB
    assert all(b is None for b in vocab.token_bytes[len(tok) :])
    assert vocab.eos_token_ids == {tok.eos_token_id}
    assert vocab.token_bytes[tok.eos_token_id] is None
    for text in ['{"a": [1, 2]}', "héllo 日本語 😀", " leading  spaces\t"]:
        ids = encode(tok, text)
        assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode()
    assert TokenVocabulary.from_tokenizer(tok, vocab_size=PAD_VOCAB) is vocab  # cached


def test_sentencepiece_vocab():
    sp = sentencepiece_like()
    v = TokenVocabulary.from_tokenizer(sp)
    ids = encode(sp, "ab é日")
    assert b"".join(v.token_bytes[i] for i in ids) == " ab é日".encode()
    assert v.token_bytes[sp.convert_tokens_to_ids("<0xE6>")] == b"\xe6"
    assert v.token_bytes[sp.convert_tokens_to_ids("▁ab")] == b" ab"
    assert v.token_bytes[sp.bos_token_id] is None and v.eos_token_ids == {sp.eos_token_id}
    g = RegexGrammar(CompiledRegex(" ab é日", v))
    assert walk(g, ids, v)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_accepts_and_masks_are_sound(name, tok, vocab):
    pattern, samples = CORPUS[name]
    compiled = CompiledRegex(pattern, vocab)
    rng = random.Random(name)
    for text in samples:
        ids = encode(tok, text)
        g = RegexGrammar(compiled)
        prefix = b""
        for t in ids:
            allowed = allowed_ids(g)
            assert t in allowed
            # soundness: every allowed token keeps the text a prefix of some match
            for a in rng.sample(sorted(allowed), min(25, len(allowed))):
                if a in vocab.eos_token_ids:
                    assert re.fullmatch(pattern, prefix.decode("utf-8", "ignore"))
                    continue
                cand = (prefix + vocab.token_bytes[a]).decode("utf-8", "ignore")
                assert _is_prefix_of_match(pattern, cand), (cand, pattern)
            # EOS exactly where the text so far is a complete match
            done = re.fullmatch(pattern, prefix.decode("utf-8", "ignore")) is not None
            assert bool(allowed & vocab.eos_token_ids) == (done and _utf8_complete(prefix))
            g.accept_token(t)
            prefix += vocab.token_bytes[t]
        assert vocab.eos_token_ids <= allowed_ids(g)
        assert not allowed_ids(g) & set(range(len(tok), PAD_VOCAB))  # padded ids never allowed


def _utf8_complete(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@functools.cache
def _fsm(pattern: str):
    import interegular

    return interegular.parse_pattern(pattern).to_fsm()


def _is_prefix_of_match(pattern: str, text: str) -> bool:
    fsm = _fsm(pattern)
    state = fsm.initial
    for ch in text:
        state = fsm.map.get(state, {}).get(fsm.alphabet[ch])
        if state is None:
            return False
    return fsm.islive(state)


def test_rejects_text_outside_language(tok, vocab):
    compiled = CompiledRegex(CORPUS["date"][0], vocab)
    for bad in ["2024-13-01", "2024-1-01", "20240101", "2024-01-32"]:
        assert not walk(RegexGrammar(compiled), encode(tok, bad), vocab), bad
    g = RegexGrammar(compiled)
    with pytest.raises(GrammarError):
        g.accept_token(encode(tok, "x")[0])
    assert g._states == [compiled.initial_state]  # state unchanged after a refused token


def test_multibyte_utf8_split_across_tokens(vocab):
    g = RegexGrammar(CompiledRegex("日本", vocab))
    byte_ids = {b: i for i, b in enumerate(vocab.token_bytes) if b is not None and len(b) == 1}
    for b in "日本".encode():
        assert byte_ids[bytes([b])] in allowed_ids(g)
        assert not allowed_ids(g) & vocab.eos_token_ids
        g.accept_token(byte_ids[bytes([b])])
    assert allowed_ids(g) == vocab.eos_token_ids and g.is_terminated()


def test_only_eos_after_complete(tok, vocab):
    compiled = CompiledRegex("yes", vocab)
    g = RegexGrammar(compiled)
    assert not g.is_terminated()
    assert g.jump_forward() == "yes"
    for t in encode(tok, "yes"):
        g.accept_token(t)
    assert g.is_terminated() and allowed_ids(g) == vocab.eos_token_ids
    g.accept_token(next(iter(vocab.eos_token_ids)))  # EOS at the end is recorded
    assert g.is_terminated()


def test_eos_refused_mid_grammar(vocab):
    g = RegexGrammar(CompiledRegex("[0-9]+x", vocab))
    with pytest.raises(GrammarError):
        g.accept_token(next(iter(vocab.eos_token_ids)))


def test_rollback_copy_and_fill_mask_rows(tok, vocab):
    compiled = CompiledRegex(CORPUS["email"][0], vocab)
    g = RegexGrammar(compiled)
    ids = encode(tok, "user1@example.com")
    masks = []
    for t in ids:
        masks.append(allowed_ids(g))
        g.accept_token(t)
    for k in range(1, len(ids) + 1):
        h = g.copy()
        h.rollback(k)
        assert allowed_ids(h) == masks[len(ids) - k]
    assert allowed_ids(g) & vocab.eos_token_ids  # the copies did not move the original
    with pytest.raises(GrammarError):
        g.rollback(len(ids) + 1)
    bm = torch.zeros(3, (PAD_VOCAB + 31) // 32, dtype=torch.int32)
    g.fill_mask(bm, 2)
    assert bm[0].eq(0).all() and bm[2].ne(0).any()


def test_jump_forward(tok, vocab):
    compiled = CompiledRegex(r'\{"name": "[a-z]+", "age": [0-9]+\}', vocab)
    g = RegexGrammar(compiled)
    assert g.jump_forward() == '{"name": "'
    for t in encode(tok, '{"name": "bob'):
        g.accept_token(t)
    assert g.jump_forward() is None  # another letter or the closing quote
    for t in encode(tok, '"'):
        g.accept_token(t)
    assert g.jump_forward() == ', "age": '
    g.rollback(1)
    assert g.jump_forward() is None
    # inside a multi-byte character: nothing is forced at the char level yet
    u = RegexGrammar(CompiledRegex("é(x|y)", vocab))
    assert u.jump_forward() == "é"


def test_jump_forward_reads_the_index(vocab):
    """Forced text comes from the token Index itself (no second automaton): the longest
    common prefix of the allowed tokens, state after state, stopping where the regex may end
    or branch, and before an unfinished character."""
    c = CompiledRegex("(abc|abd)x|zzz", vocab)
    assert RegexGrammar(c).jump_forward() is None  # "a" or "z"
    g = RegexGrammar(CompiledRegex("(abc|abd)x", vocab))
    assert g.jump_forward() == "ab"
    assert RegexGrammar(CompiledRegex("ab(c)?", vocab)).jump_forward() == "ab"
    assert RegexGrammar(CompiledRegex("xyz", vocab)).jump_forward() == "xyz"
    # forced bytes that end inside a character are held back: "中" then a choice of two
    cjk = RegexGrammar(CompiledRegex("中(文|国)", vocab))
    assert cjk.jump_forward() == "中"
    # no background work: a fresh grammar answers at once, and many distinct ones start no
    # thread (the old interegular char DFA built on a thread held the GIL for seconds)
    import threading

    before = threading.active_count()
    grammars = [RegexGrammar(CompiledRegex(f"item{i}(a|b)", vocab)) for i in range(20)]
    assert [x.jump_forward() for x in grammars] == [f"item{i}" for i in range(20)]
    assert threading.active_count() == before


def test_choices(tok, vocab):
    regex = choices_to_regex(["a+b", "yes", "no", "yes"])
    g = RegexGrammar(CompiledRegex(regex, vocab))
    assert walk(g, encode(tok, "a+b"), vocab)
    assert not walk(RegexGrammar(CompiledRegex(regex, vocab)), encode(tok, "aab"), vocab)
    with pytest.raises(GrammarError):
        choices_to_regex([])


def test_bad_regex_is_grammar_error(vocab):
    with pytest.raises(GrammarError, match="cannot compile regex"):
        CompiledRegex("(unclosed", vocab)


def test_backend_kinds_cache_and_async(tok):
    from loom.grammar.backend import GrammarBackend

    backend = GrammarBackend(tok, vocab_size=PAD_VOCAB)
    assert backend.vocab.vocab_size == PAD_VOCAB
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g1 = backend.compile("json_schema", schema)
    g2 = backend.compile("json_schema", json.dumps(schema))  # same normalized spec: cached
    assert g1 is not g2 and len(backend._cache) == 1  # one compile, two copies
    for t in encode(tok, '{"a": 1}'):
        g1.accept_token(t)
    assert g1.is_terminated() and not g2.is_terminated()  # copies do not share positions
    fut = backend.compile_async("regex", "[0-9]{3}")
    assert walk(fut.result(timeout=60), encode(tok, "123"), backend.vocab)
    assert walk(backend.compile("choices", ["yes", "no"]), encode(tok, "no"), backend.vocab)
    g = backend.compile("ebnf", 'root ::= "a" [0-9]')
    assert walk(g, encode(tok, "a7"), backend.vocab)
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        backend.compile("yaml", "x")
    with pytest.raises(GrammarError, match="json_schema is not valid JSON"):
        backend.compile("json_schema", "{not json")
    with pytest.raises(GrammarError):
        backend.compile_async("regex", "(").result(timeout=60)
    backend.shutdown()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_random_strings_of_the_language_are_accepted(name, tok, vocab):
    """Random members of each corpus language (hypothesis), tokenized, walk to the end."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pattern = CORPUS[name][0]
    compiled = CompiledRegex(pattern, vocab)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(pattern, fullmatch=True))
    def check(text):
        if "\n" in text:
            return  # python's `$` lets from_regex append a newline
        assert walk(RegexGrammar(compiled), encode(tok, text), vocab), text

    check()


def test_tokens_running_past_a_possible_end():
    """outlines-core alone drops "ab" for choices ["a", "abc"] (it passes the end of "a")."""
    pieces = [None, b"a", b"b", b"c", b"ab", b"bc", b"abc", b"\xf4", b"\x8f\xbf\xbf"]
    v = TokenVocabulary(token_bytes=pieces, eos_token_ids={0}, vocab_size=len(pieces))
    g = RegexGrammar(CompiledRegex(choices_to_regex(["a", "abc"]), v))
    assert allowed_ids(g) == {1, 4, 6}  # a, ab, abc
    g.accept_token(4)
    assert allowed_ids(g) == {3}
    g.rollback(1)
    g.accept_token(1)
    assert allowed_ids(g) == {0, 2, 5}  # EOS, b, bc; never the sentinel's first bytes
