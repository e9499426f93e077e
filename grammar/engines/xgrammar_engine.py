r"""xgrammar as loom's mask engine: pushdown automata with an adaptive token-mask cache.

Regular forms go to `Grammar.from_regex`; Lark forms are written as xgrammar EBNF by
`lark_to_ebnf` (lark's own loader expands the EBNF sugar into plain rules, and each terminal's
regex becomes an EBNF expression through xgrammar's regex converter). xgrammar's grammars are
character-level: a Lark terminal matches exactly its regex's strings, with none of a lexer's
longest-match rules, which is the meaning loom's translations are written for. `%ignore` has no
character-level equivalent and is refused.

xgrammar reads a negated class (`[^"\\]`, `.`, `\D`...) as every code point outside it,
UTF-16 surrogates included, whose 3-byte encodings are not UTF-8: the soundness suite caught it
emitting them inside JSON strings. `no_surrogates` adds the surrogate range to every negated
class before a regex reaches xgrammar.

Compiles run on one thread (`max_threads=1`), like every other engine here; the compile is
xgrammar's (eager per-rule token cache), not bounded by step limits the way llguidance's is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..base import Grammar, GrammarError
from ..forms import Form
from . import Engine, MatcherGrammar


class XGrammarEngine(Engine):
    name = "xgrammar"
    json_form = "regex"

    def __init__(self, tokenizer: Any, vocab):
        import xgrammar as xgr

        self.vocab = vocab
        self.eos = sorted(vocab.eos_token_ids)
        # a token without bytes is empty to xgrammar, which never allows it
        encoded = [b if b is not None else b"" for b in vocab.token_bytes]
        info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size, stop_token_ids=self.eos
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def build(self, form: Form) -> Grammar:
        import xgrammar as xgr

        try:
            if form.syntax == "regex":
                grammar = xgr.Grammar.from_regex(no_surrogates(form.text))
            else:
                grammar = xgr.Grammar.from_ebnf(lark_to_ebnf(form.text))
            compiled = self.compiler.compile_grammar(grammar)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError with its message
            raise GrammarError(f"cannot compile {form.syntax}: {str(e).strip()[:500]}") from None
        return XGrammarGrammar(self, xgr.GrammarMatcher(compiled, override_stop_tokens=self.eos))


class XGrammarGrammar(MatcherGrammar):
    def __init__(self, engine: XGrammarEngine, matcher):
        self.engine = engine
        self.matcher = matcher
        self._n = 0

    def fill_mask(self, bitmask, row: int) -> None:
        if isinstance(bitmask, np.ndarray):  # xgrammar fills tensors: the same memory
            bitmask = torch.from_numpy(bitmask)
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            if token_id in self.engine.vocab.eos_token_ids:
                raise GrammarError(f"EOS token {token_id} before the grammar is complete")
            raise GrammarError(f"token {token_id} is not allowed here")
        self._n += 1

    def is_terminated(self) -> bool:
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        # complete: terminated when nothing but a stop token may follow
        row = torch.zeros(1, (self.engine.vocab.vocab_size + 31) // 32, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        for t in self.engine.eos:
            row[0, t // 32] &= ~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF
        return not bool(row.any())

    def jump_forward(self) -> str | None:
        if self.matcher.is_terminated():
            return None
        return self.matcher.find_jump_forward_string() or None

    def copy(self) -> XGrammarGrammar:
        g = XGrammarGrammar(self.engine, self.matcher.fork())
        g._n = self._n
        return g


def lark_to_ebnf(text: str) -> str:
    """A Lark grammar (start rule `start`) as xgrammar EBNF (root rule `root`)."""
    from lark.exceptions import LarkError
    from lark.load_grammar import load_grammar
    from xgrammar.testing import _regex_to_ebnf

    try:
        grammar, _ = load_grammar(text, "<grammar>", [], False)
        terminals, rules, ignore = grammar.compile(["start"], "*")
    except LarkError as e:
        raise GrammarError(f"lark grammar error: {str(e).strip()[:500]}") from None
    if ignore:
        raise GrammarError("the xgrammar engine has no equivalent of Lark's %ignore")
    bodies: dict[str, list[str]] = {}
    for rule in rules:
        seq = " ".join(("t_" if s.is_term else "r_") + s.name for s in rule.expansion)
        bodies.setdefault("r_" + rule.origin.name, []).append(seq or '""')
    lines = ["root ::= r_start"]
    lines += [f"{name} ::= " + " | ".join(f"({b})" for b in alts) for name, alts in bodies.items()]
    for t in terminals:
        p = t.pattern
        if p.type == "str" and not p.flags:
            body = _ebnf_string(p.value)
        else:
            try:
                body = _regex_to_ebnf(no_surrogates(p.to_regexp()), with_rule_name=False)
            except Exception as e:  # noqa: BLE001 - xgrammar's converter names the problem
                raise GrammarError(f"terminal {t.name}: {str(e).strip()[:300]}") from None
        lines.append(f"t_{t.name} ::= {body}")
    return "\n".join(lines) + "\n"


def _ebnf_string(s: str) -> str:
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


_SURROGATES = "\\uD800-\\uDFFF"
_NEGATED_ESCAPES = {"D": "0-9", "W": "a-zA-Z0-9_", "S": " \\t\\n\\r\\f\\v"}


def no_surrogates(regex: str) -> str:
    """`regex` with the UTF-16 surrogates taken out of every negated class, `.` and `\\D \\W
    \\S` outside classes (the strings it matches are unchanged for valid Unicode text)."""
    out, i, n = [], 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            esc = regex[i + 1 : i + 2]
            out.append(f"[^{_NEGATED_ESCAPES[esc]}{_SURROGATES}]" if esc in _NEGATED_ESCAPES
                       else regex[i : i + 2])  # fmt: skip
            i += 2
        elif c == "[":
            j = i + 1
            negated = regex.startswith("^", j)
            j += negated
            j += regex.startswith("]", j)  # a leading "]" is a literal
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            out.append(regex[i:j] + (_SURROGATES if negated else "") + "]")
            i = j + 1
        elif c == ".":
            out.append(f"[^\\n{_SURROGATES}]")
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)
