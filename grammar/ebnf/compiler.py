"""Grammar text -> CompiledCFG -> EBNFGrammar: the entry points `compile_lark`/`compile_gbnf`.

Lark does the grammar work (parsing the grammar text, `%import`, EBNF expansion, the LALR(1)
table); interegular compiles each terminal's regex to a DFA. GBNF is first translated to a Lark
grammar whose terminals are `%declare`d and whose regexes are passed on the side (gbnf.py).
"""

from __future__ import annotations

import logging
import threading

from lark.common import ParserConf
from lark.exceptions import LarkError
from lark.load_grammar import load_grammar
from lark.parsers.lalr_analysis import LALR_Analyzer

from ..base import GrammarError
from .engine import CompiledCFG
from .fsm import TerminalFSM
from .gbnf import gbnf_to_lark
from .grammar import EBNFGrammar
from .lexer import Lexer
from .parser import END, Parser
from .trie import get_trie

logger = logging.getLogger(__name__)
_CACHE: dict[tuple, tuple[object, CompiledCFG]] = {}
_CACHE_SIZE = 64
_LOCK = threading.Lock()


def compile_lark(text: str, vocab) -> EBNFGrammar:
    """A grammar object for a Lark grammar (`start` rule, LALR(1)-compatible)."""
    return EBNFGrammar(_compiled("lark", text, vocab))


def compile_gbnf(text: str, vocab) -> EBNFGrammar:
    """A grammar object for a GBNF grammar (llama.cpp / SGLang `ebnf`; entry rule `root`)."""
    return EBNFGrammar(_compiled("gbnf", text, vocab))


def _compiled(kind: str, text: str, vocab) -> CompiledCFG:
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{kind} grammar: empty grammar")
    key = (kind, text, id(vocab))
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is vocab:
            return hit[1]
    if kind == "gbnf":
        lark_text, regexes = gbnf_to_lark(text)
    else:
        lark_text, regexes = text, {}
    compiled = build_compiled(lark_text, vocab, regexes, source=text)
    with _LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = (vocab, compiled)
    return compiled


def build_compiled(
    lark_text: str,
    vocab,
    regexes: dict[str, str] | None = None,
    source: str = "",
) -> CompiledCFG:
    """Compile a Lark grammar; `regexes` gives the patterns of `%declare`d terminals."""
    regexes = regexes or {}
    try:
        # Lark's front half only: its lexers would check every terminal pair for collisions
        # with interegular (slow, and collisions are fine here).
        grammar, _ = load_grammar(lark_text, "<grammar>", None, False)
        terminals, rules, ignore = grammar.compile(["start"], set())
        analysis = LALR_Analyzer(ParserConf(rules, {}, ["start"]), debug=False, strict=False)
        analysis.compute_lalr()
    except LarkError as exc:
        hint = ""
        if "Reduce/Reduce" in str(exc):
            hint = " (the grammar is ambiguous or needs more than LALR(1) look-ahead"
            hint += "; GBNF rule `x` appears as `r_x`)" if regexes else ")"
        raise GrammarError(f"grammar error{hint}: {exc}") from exc
    conflicts = _shift_reduce_conflicts(analysis)
    if conflicts:
        logger.warning(
            "grammar is not LALR(1); resolved as shift (some sentences may be unreachable): %s",
            "; ".join(conflicts[:5]),
        )
    table = analysis.parse_table
    patterns = {t.name: t.pattern.to_regexp() for t in terminals}
    patterns.update(regexes)
    used = sorted(
        {s for row in table.states.values() for s in row if s.isupper() and s != END} | set(ignore)
    )
    missing = [name for name in used if name not in patterns]
    if missing:
        raise GrammarError(f"grammar error: terminals without a pattern: {', '.join(missing)}")
    term_index = {name: i for i, name in enumerate(used)}
    fsms = [TerminalFSM(name, patterns[name]) for name in used]
    lexer = Lexer(fsms, frozenset(term_index[n] for n in ignore))
    parser = Parser(table, "start", term_index)
    compiled = CompiledCFG(parser, lexer, get_trie(vocab), vocab.token_bytes, source)
    compiled.conflicts = conflicts
    return compiled


def _shift_reduce_conflicts(analysis) -> list[str]:
    """Lark resolves shift/reduce conflicts as shift, silently unless in debug mode; say so.
    The masks stay sound (only grammar sentences), but may miss sentences the shift excludes."""
    out = []
    for itemset in analysis.lr0_itemsets:
        shifts = {sym.name for sym in itemset.transitions}
        for la, rules in itemset.lookaheads.items():
            if la.name in shifts and len(rules) == 1:
                out.append(f"on {la.name}: shift vs reduce {next(iter(rules))}")
    return sorted(set(out))
