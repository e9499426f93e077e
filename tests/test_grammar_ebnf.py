"""CFG engine (grammar/ebnf): Lark and GBNF grammars -> token masks.

Each test grammar is written twice, in Lark and in GBNF, for the *same* language, so a lark
LALR parser of the Lark text is the reference for both, and the two engines' masks must agree
token for token. The vocabulary is a byte-level BPE trained here on grammar-like text.
"""

from __future__ import annotations

import json
import random
import time
import zlib
from collections import deque

import lark
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from loom.grammar.base import GrammarError, allocate_token_bitmask, unpack_bitmask
from loom.grammar.ebnf import compile_gbnf, compile_lark, gbnf_to_lark, json_lark_grammar

ARITH_LARK = r"""
start: expr
expr: term (ADDOP term)*
term: factor (MULOP factor)*
factor: NUMBER | LPAR expr RPAR | NEG factor
NUMBER: /[0-9]+ ?/
ADDOP: /[+-] ?/
MULOP: /[*\/] ?/
LPAR: /\( ?/
RPAR: /\) ?/
NEG: /- ?/
"""
ARITH_GBNF = r"""
# arithmetic, one optional blank after each token
root   ::= expr
expr   ::= term (("+" | "-") ws term)*
term   ::= factor (("*" | "/") ws factor)*
factor ::= [0-9]+ ws | "(" ws expr ")" ws | "-" ws factor
ws     ::= " "?
"""
JSON_GBNF = r"""
root   ::= value
value  ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws? "}" | "{" ws? member (ws? "," ws? member)* ws? "}"
member ::= string ws? ":" ws? value
array  ::= "[" ws? "]" | "[" ws? value (ws? "," ws? value)* ws? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws     ::= [ \t\n]{1,16}
"""
SQL_LARK = r"""
start: "SELECT " cols " FROM " IDENT where? ";"?
cols: "*" | IDENT ("," " "? IDENT)*
where: " WHERE " cond (" AND " cond)*
cond: IDENT " "? OP " "? value
OP: "=" | "!=" | "<" | ">" | "<=" | ">="
value: NUMBER | STRING | IDENT
IDENT: /[a-z_][a-z0-9_]*/
NUMBER: /[0-9]+/
STRING: /'[a-z ]*'/
"""
SQL_GBNF = r"""
root  ::= "SELECT " cols " FROM " ident where? ";"?
cols  ::= "*" | ident ("," " "? ident)*
where ::= " WHERE " cond (" AND " cond)*
cond  ::= ident " "? op " "? value
op    ::= "=" | "!=" | "<" | ">" | "<=" | ">="
value ::= [0-9]+ | "'" [a-z ]* "'" | ident
ident ::= [a-z_] [a-z0-9_]*
"""
GRAMMARS = {
    "arith": (ARITH_LARK, ARITH_GBNF),
    "json": (json_lark_grammar(), JSON_GBNF),
    "sql": (SQL_LARK, SQL_GBNF),
}
VALID = {
    "arith": ["1+2", "(3 * 4) - -5", "12/ (7+8)*9", "-(1)"],
    "json": ['{"a": [1, 2.5e-3, true], "b": {"c": null}}', "[ ]", '"h\\u00e9llo \\n"', "-0.5"],
    "sql": [
        "SELECT a, b FROM t WHERE x <= 1 AND y='ab c';",
        "SELECT * FROM users",
        "SELECT id FROM t WHERE n!=m",
    ],
}
INVALID = {
    "arith": ["1++2", "(1", "1 2", "+"],
    "json": ['{"a" 1}', "[1,]", "01", '{"a":1', "tru"],
    "sql": ["SELECT FROM t", "SELECT a FROM", "select a from t", "SELECT a FROM t WHERE x"],
}


def _corpus(seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    words = "select from where and id name age price users orders total value key data".split()
    out = []
    for _ in range(1500):
        obj = {rnd.choice(words): rnd.choice([rnd.randint(-99, 999), rnd.choice(words), [1, 2.5]])}
        out.append(json.dumps(obj, indent=rnd.choice([None, 2])))
        out.append(
            f"SELECT {', '.join(rnd.sample(words, 2))} FROM {rnd.choice(words)} WHERE "
            f"{rnd.choice(words)} >= {rnd.randint(0, 99)};"
        )
        out.append(
            " ".join(
                f"{rnd.randint(0, 99)}{rnd.choice(['+', ' * ', '-(', ')/'])}" for _ in range(3)
            )
        )
        out.append("Ünïcödé 😀 日本語 " + " ".join(rnd.sample(words, 4)))
    return out


class FakeVocab:
    """The three attributes the engine reads (duck-typed TokenVocabulary)."""

    def __init__(self, token_bytes, eos_token_ids, vocab_size):
        self.token_bytes, self.eos_token_ids, self.vocab_size = (
            token_bytes,
            eos_token_ids,
            vocab_size,
        )


def _unicode_to_bytes() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def bpe():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1200,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    table = _unicode_to_bytes()
    size = tok.get_vocab_size() + 5  # a padded model vocabulary: the extra ids are never allowed
    token_bytes = [None] * size
    for piece, tid in tok.get_vocab().items():
        if piece != "<eos>":
            token_bytes[tid] = bytes(table[c] for c in piece)
    return tok, FakeVocab(token_bytes, {tok.token_to_id("<eos>")}, size)


@pytest.fixture(scope="module")
def vocab(bpe):
    return bpe[1]


def _compile(syntax: str, name: str, vocab):
    lark_text, gbnf_text = GRAMMARS[name]
    return compile_lark(lark_text, vocab) if syntax == "lark" else compile_gbnf(gbnf_text, vocab)


def _reference(name: str) -> lark.Lark:
    return lark.Lark(GRAMMARS[name][0], parser="lalr")


def _parses(ref: lark.Lark, text: str) -> bool:
    try:
        ref.parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


def _pick(rnd: random.Random, vocab, ids: list[int]) -> int:
    """A random allowed non-EOS token, uniform over first bytes (else digits dominate)."""
    groups: dict[bytes, list[int]] = {}
    for tid in ids:
        if tid not in vocab.eos_token_ids:
            groups.setdefault(vocab.token_bytes[tid][:1], []).append(tid)
    return rnd.choice(groups[rnd.choice(sorted(groups))])


def _shortest_completion(grammar) -> bytes | None:
    """Bytes that finish the sentence, found by breadth-first search on the engine's states
    (the reference parser then checks the result, so the engine does not vouch for itself)."""
    compiled, start = grammar.compiled, grammar._state
    seen, queue = {start}, deque([(start, b"")])
    while queue:
        state, path = queue.popleft()
        if compiled.can_end(state, at_start=False):
            return path
        if len(path) > 40:
            return None
        options = compiled.next_bytes(state)
        ascii_only = [b for b in options if b < 0x80]
        for byte in ascii_only or options:  # never start a multi-byte character
            nxt = compiled.step(state, byte)
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, path + bytes((byte,))))
    return None


# --- (1) random walks --------------------------------------------------------------------
@pytest.mark.parametrize("syntax", ["lark", "gbnf"])
@pytest.mark.parametrize("name", ["arith", "json", "sql"])
def test_random_walks_parse(name, syntax, vocab):
    ref, rnd, finished = _reference(name), random.Random(zlib.crc32(f"{name}-{syntax}".encode())), 0
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    for _ in range(12):
        g, out = _compile(syntax, name, vocab), b""
        for _ in range(60):
            g.fill_mask(bitmask, 0)
            ids = torch.nonzero(unpack_bitmask(bitmask, vocab.vocab_size)[0]).flatten().tolist()
            assert ids == g.allowed_token_ids()
            assert all(vocab.token_bytes[t] is not None or t in vocab.eos_token_ids for t in ids)
            eos_ok = any(t in vocab.eos_token_ids for t in ids)
            if eos_ok and (rnd.random() < 0.35 or len(ids) == 1):
                text = out.decode("utf-8")
                assert _parses(ref, text), text
                if name == "json":
                    json.loads(text)
                finished += 1
                break
            assert not g.is_terminated()
            tid = _pick(rnd, vocab, ids)
            g.accept_token(tid)
            out += vocab.token_bytes[tid]
        else:  # unfinished: the text must still be completable
            tail = _shortest_completion(g)
            assert tail is not None, out
            assert _parses(ref, (out + tail).decode("utf-8")), out + tail
    assert finished >= 4


@pytest.mark.parametrize("name", ["arith", "json", "sql"])
def test_lark_and_gbnf_masks_agree(name, vocab):
    """The two spellings describe one language, so every mask must be identical."""
    rnd = random.Random(7)
    for _ in range(6):
        a, b = _compile("lark", name, vocab), _compile("gbnf", name, vocab)
        for _ in range(40):
            ids = a.allowed_token_ids()
            assert ids == b.allowed_token_ids()
            if len(ids) <= 1 and a.is_terminated():
                break
            tid = (
                _pick(rnd, vocab, ids)
                if len(ids) > 1 or ids[0] not in vocab.eos_token_ids
                else None
            )
            if tid is None:
                break
            a.accept_token(tid)
            b.accept_token(tid)


@pytest.mark.parametrize("syntax", ["lark", "gbnf"])
@pytest.mark.parametrize("name", ["json", "sql"])
def test_mask_equals_per_token_check(name, syntax, vocab):
    """The vectorised trie walk allows exactly the tokens whose bytes the matcher can take."""
    rnd = random.Random(3)
    g = _compile(syntax, name, vocab)
    for _ in range(12):
        c, state = g.compiled, g._state
        allowed = set(g.allowed_token_ids()) - vocab.eos_token_ids
        brute = {
            t for t, data in enumerate(vocab.token_bytes) if data and c.step_bytes(state, data)
        }
        assert allowed == brute
        if not allowed:
            break
        g.accept_token(_pick(rnd, vocab, sorted(allowed)))


# --- (2) allowed tokens are viable, disallowed ones are not --------------------------------
@pytest.mark.parametrize("syntax", ["lark", "gbnf"])
@pytest.mark.parametrize("name", ["arith", "sql"])
def test_mask_is_exact_on_spot_checks(name, syntax, vocab):
    ref, rnd = _reference(name), random.Random(11)
    alphabet = {"arith": "1) +", "sql": "a1 ='F"}[name]
    suffixes = [""] + [a + b for a in alphabet for b in [""] + list(alphabet)]
    g, text = _compile(syntax, name, vocab), b""
    for _ in range(6):
        allowed = set(g.allowed_token_ids())
        for tid in rnd.sample(sorted(allowed - vocab.eos_token_ids), min(6, len(allowed) - 1)):
            h = g.copy()
            h.accept_token(tid)
            tail = _shortest_completion(h)
            full = text + vocab.token_bytes[tid] + (tail or b"")
            assert tail is not None and _parses(ref, full.decode("utf-8")), full
        banned = [t for t, b in enumerate(vocab.token_bytes) if b and t not in allowed]
        for tid in rnd.sample(banned, 6):
            try:
                prefix = (text + vocab.token_bytes[tid]).decode("utf-8")
            except UnicodeDecodeError:
                continue
            assert not any(_parses(ref, prefix + s) for s in suffixes), prefix
        ids = [t for t in allowed if t not in vocab.eos_token_ids]
        tid = _pick(rnd, vocab, ids)
        g.accept_token(tid)
        text += vocab.token_bytes[tid]


# --- (3) known strings ---------------------------------------------------------------------
@pytest.mark.parametrize("syntax", ["lark", "gbnf"])
@pytest.mark.parametrize("name", ["arith", "json", "sql"])
def test_known_strings(name, syntax, bpe):
    tok, vocab = bpe
    ref = _reference(name)
    for text in VALID[name]:
        assert _parses(ref, text), text
        g = _compile(syntax, name, vocab)
        for tid in tok.encode(text).ids:
            assert tid in g.allowed_token_ids(), (text, tid)
            g.accept_token(tid)
        assert set(g.allowed_token_ids()) & vocab.eos_token_ids, text
    for text in INVALID[name]:
        assert not _parses(ref, text), text
        g = _compile(syntax, name, vocab)
        try:
            for tid in tok.encode(text).ids:
                g.accept_token(tid)
        except GrammarError:
            continue
        assert not set(g.allowed_token_ids()) & vocab.eos_token_ids, text
        with pytest.raises(GrammarError):
            g.accept_token(next(iter(vocab.eos_token_ids)))


def test_hand_written_vocab_with_duplicates_and_gaps():
    tokens = [b"a", b"ab", b"a", None, b"", b"b", b"abc", None]  # ids 3, 7: special; 4: empty
    vocab = FakeVocab(tokens, {7}, vocab_size=40)  # a model vocab wider than the tokenizer's
    g = compile_gbnf('root ::= "a" "b"*', vocab)
    assert g.allowed_token_ids() == [0, 1, 2]
    bitmask = allocate_token_bitmask(2, 40)
    g.fill_mask(bitmask, 1)
    assert torch.all(bitmask[0] == -1)  # other rows untouched
    assert torch.nonzero(unpack_bitmask(bitmask, 40)[1]).flatten().tolist() == [0, 1, 2]
    g.accept_token(2)
    assert g.allowed_token_ids() == [5, 7]
    assert not g.is_terminated()


def test_with_the_project_token_vocabulary(bpe):
    """The real `TokenVocabulary` (grammar/vocab.py) gives the same bytes as the test's."""
    from loom.grammar.vocab import TokenVocabulary

    tok, fake = bpe
    real = TokenVocabulary.from_tokenizer(tok, vocab_size=fake.vocab_size)
    assert real.eos_token_ids == fake.eos_token_ids
    a, b = compile_lark(SQL_LARK, real), compile_lark(SQL_LARK, fake)
    for tid in tok.encode(VALID["sql"][0]).ids:
        assert a.allowed_token_ids() == b.allowed_token_ids()
        a.accept_token(tid)
        b.accept_token(tid)
    assert a.is_terminated()


def test_lalr_conflicts_are_reported(vocab, caplog):
    with caplog.at_level("WARNING", logger="loom.grammar.ebnf.compiler"):
        g = compile_lark('start: x "b"\nx: "b"?\n', vocab)
    assert g.compiled.conflicts and "not LALR(1)" in caplog.text
    assert not _compile("lark", "json", vocab).compiled.conflicts


def test_rejected_token_leaves_state_unchanged(vocab):
    g = _compile("lark", "arith", vocab)
    before = g.allowed_token_ids()
    bad = vocab.token_bytes.index(b"+")
    with pytest.raises(GrammarError):
        g.accept_token(bad)
    with pytest.raises(GrammarError):
        g.accept_token(vocab.vocab_size - 1)  # padding id: no bytes
    assert g.allowed_token_ids() == before


# --- (4) rollback, copy, jump-forward, termination -------------------------------------------
def test_rollback_and_copy(vocab):
    rnd = random.Random(5)
    g = _compile("gbnf", "json", vocab)
    masks, tokens = [g.allowed_token_ids()], []
    for _ in range(15):
        ids = [t for t in masks[-1] if t not in vocab.eos_token_ids]
        tid = _pick(rnd, vocab, ids)
        g.accept_token(tid)
        tokens.append(tid)
        masks.append(g.allowed_token_ids())
    fork = g.copy()
    g.rollback(5)
    assert g.allowed_token_ids() == masks[-6]
    assert fork.allowed_token_ids() == masks[-1]  # the copy did not move
    for tid in tokens[-5:]:
        g.accept_token(tid)
    assert g.allowed_token_ids() == masks[-1]
    g.rollback(15)
    assert g.allowed_token_ids() == masks[0]
    with pytest.raises(ValueError):
        g.rollback(1)


def test_jump_forward_and_termination(vocab):
    g = compile_gbnf('root ::= "SELECT " col " FROM t;"\ncol ::= "name" | "age"', vocab)
    assert g.jump_forward() == "SELECT "
    assert g.accept_bytes(b"SELECT ")
    assert g.jump_forward() is None  # "name" or "age"
    g.accept_token(vocab.token_bytes.index(b"a"))
    assert g.jump_forward() == "ge FROM t;"
    assert g.accept_bytes(b"ge FROM t;")
    assert g.is_terminated()
    assert set(g.allowed_token_ids()) == vocab.eos_token_ids
    g.accept_token(next(iter(vocab.eos_token_ids)))
    assert g.is_terminated() and g.jump_forward() is None
    g.rollback(1)
    assert g.is_terminated()

    g = compile_lark(SQL_LARK, vocab)
    assert g.jump_forward() == "SELECT "
    g = compile_lark('start: "ab" X\nX: /[0-9]+/', vocab)
    assert g.jump_forward() == "ab"
    g.accept_bytes(b"ab1")
    assert not g.is_terminated()  # may end, but more digits may follow
    assert g.jump_forward() is None


def test_json_whitespace_is_bounded(vocab):
    g = compile_lark(json_lark_grammar(max_whitespace=4), vocab)
    space = vocab.token_bytes.index(b" ")
    g.accept_bytes(b"[")
    for _ in range(4):
        g.accept_token(space)
    assert space not in g.allowed_token_ids()
    assert vocab.token_bytes.index(b"1") in g.allowed_token_ids()


def test_json_rules_compose_into_other_grammars(vocab):
    text = 'start: "{\\"data\\": " value "}"\n' + json_lark_grammar(with_start=False)
    g = compile_lark(text, vocab)
    assert g.jump_forward() == '{"data": '
    assert g.accept_bytes(b'{"data": [1, {"b": null}]}') and g.is_terminated()


def test_unicode_and_partial_characters(vocab):
    g = compile_gbnf('root ::= "é" [α-ω]+ "😀"', vocab)
    text = "éαβ😀".encode()
    for i in range(len(text)):  # one byte at a time, splitting every multi-byte character
        assert g.accept_bytes(text[i : i + 1]), i
    assert g.is_terminated()
    g = compile_gbnf('root ::= "é" [α-ω]+ "😀"', vocab)
    assert not g.accept_bytes("ée".encode())
    assert not g.accept_bytes(b"\xc3\xa8")  # è, a different 2-byte character
    assert g.accept_bytes(b"\xc3")  # a prefix of é


def test_lark_imports_and_ignore(vocab):
    text = """
    start: sum
    sum: NUMBER ("+" NUMBER)*
    %import common.NUMBER
    %import common.WS
    %ignore WS
    """
    ref, rnd = lark.Lark(text, parser="lalr"), random.Random(2)
    for _ in range(10):
        g, out = compile_lark(text, vocab), b""
        for _ in range(25):
            ids = g.allowed_token_ids()
            if set(ids) & vocab.eos_token_ids and rnd.random() < 0.3:
                break
            tid = _pick(rnd, vocab, ids)
            g.accept_token(tid)
            out += vocab.token_bytes[tid]
        else:
            continue
        assert _parses(ref, out.decode()), out
    g = compile_lark('start: "x" STR\n%import common.ESCAPED_STRING -> STR', vocab)
    assert g.accept_bytes(b'x"a\\"b"') and g.is_terminated()


LLAMA_CPP_JSON = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws
string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [0-9]{0,15})? ws
# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"""


def test_llama_cpp_json_gbnf(vocab):
    """llama.cpp's json.gbnf: bounded repetitions and optionals must not blow up the table."""
    start = time.process_time()  # CPU time: a blow-up shows, a loaded machine does not
    g = compile_gbnf(LLAMA_CPP_JSON, vocab)
    assert time.process_time() - start < 5
    doc = {"a": [1, -2.5e10, "x\n\u00e9"], "b": {"c": None, "d": 123456789012345}}
    assert g.accept_bytes(json.dumps(doc).encode())
    assert set(g.allowed_token_ids()) & vocab.eos_token_ids
    g = compile_gbnf(LLAMA_CPP_JSON, vocab)
    assert not g.accept_bytes(b'{"d": 12345678901234567}')  # 17 digits > [1-9] [0-9]{0,15}
    g = compile_gbnf('root ::= "a"{,2} "b"', vocab)
    assert g.accept_bytes(b"aab") and g.is_terminated()
    assert not compile_gbnf('root ::= "a"{,2} "b"', vocab).accept_bytes(b"aaa")


# --- (5) errors ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, words",
    [
        ('root ::= "a" | (b', ["line 1", "root", "')'"]),
        ('root ::= x\nx ::= "a" y', ["line 2", "'x'", "undefined rule 'y'"]),
        ('root ::= "a"\n\nroot ::= "b"', ["line 3", "defined twice"]),
        ('item ::= "a"', ["no 'root' rule"]),
        ('root ::= "abc', ["line 1", "unterminated string"]),
        ('root ::= "a"\nx ::= [a-', ["line 2", "unterminated character class"]),
        ('root ::= a | b\na ::= "x"\nb ::= "x"', ["Reduce/Reduce", "r_a"]),
        ('root ::= "a"\nvalue ::= [z-a]', ["line 2", "value", "bad range"]),
        ('root ::= "a"{3,1}', ["bad repetition"]),
        ("root = 'a'", ["line 1", "unexpected character"]),
        ('root ::= "a" )', ["unbalanced"]),
    ],
)
def test_gbnf_errors(text, words, vocab):
    with pytest.raises(GrammarError) as info:
        compile_gbnf(text, vocab)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize(
    "text",
    ['start: "a" b', "start: (", "start: X\nX: /(?<=a)b/", "", 'start: a | b\na: "x"\nb: "x"\n'],
)
def test_lark_errors(text, vocab):
    with pytest.raises(GrammarError):
        compile_lark(text, vocab)


def test_gbnf_translation_shape():
    lark_text, terminals = gbnf_to_lark('root ::= my-rule{2,3} "x"\nmy-rule ::= [^"\\\\] | "\\n"')
    assert lark_text.startswith("start: ")
    assert "r_my_rule" in lark_text
    assert sorted(terminals.values()) == ['[^\\"\\\\]', "\\x0a", "x"]
