"""Context-free grammars (Lark or GBNF) -> token masks.

    grammar = compile_gbnf('root ::= "SELECT " [a-z]+', vocab)   # or compile_lark(text, vocab)
    grammar.fill_mask(bitmask, row); grammar.accept_token(tid); grammar.jump_forward()

Pipeline: gbnf.py translates GBNF to Lark; lark parses the grammar and builds the LALR(1) table
(compiler.py); interegular compiles each terminal to a DFA stepped per UTF-8 byte (fsm.py);
the matcher state is a set of (parser stack, lexer state) branches (parser.py, lexer.py); masks
walk the vocabulary's token trie against it (trie.py, engine.py); grammar.py is the per-request
`Grammar` object. `vocab` is anything with `token_bytes`, `eos_token_ids` and `vocab_size`.

Semantics and limits:
- Lark: terminals match by per-terminal maximal munch with one byte of look-ahead, and every
  terminal that fits is tried (a contextual lexer that never guesses); terminal priorities
  are ignored. A terminal that could go on with the next byte does not end there, so
  `/\\d+(\\.\\d+)?/` followed by "." then a non-digit is rejected (real longest-match would back
  off). Lark's common ESCAPED_STRING uses look-behind, which interegular lacks: an equivalent
  regex is substituted; other look-arounds, `^`/`$` and the `x`/`m` flags are GrammarErrors.
- GBNF: exact character-level meaning (its terminals have fixed length). Not supported:
  xgrammar extensions such as lookahead assertions `(= ...)` and single-quoted strings.
- Parsing is LALR(1): reduce/reduce conflicts are GrammarErrors; shift/reduce conflicts are
  resolved as shift (lark's rule) and logged, which keeps masks sound but can make some
  sentences unreachable. Ambiguity between *terminals* is fine (branches).
"""

from .compiler import build_compiled, compile_gbnf, compile_lark
from .gbnf import gbnf_to_lark
from .grammar import EBNFGrammar
from .json_grammar import json_lark_grammar

__all__ = [
    "EBNFGrammar",
    "build_compiled",
    "compile_gbnf",
    "compile_lark",
    "gbnf_to_lark",
    "json_lark_grammar",
]
