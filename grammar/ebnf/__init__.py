"""Context-free grammars (Lark or GBNF) -> token masks.

    grammar = compile_gbnf('root ::= "SELECT " [a-z]+', vocab)
    grammar.fill_mask(bitmask, row); grammar.accept_token(tid); grammar.jump_forward()

Lark parses the grammar and builds the LALR(1) table, interegular turns terminals into DFAs, and
the engine walks a token trie against (parser stack, lexer state) branches; see engine.py.
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
