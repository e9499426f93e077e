"""loom's eager engine: outlines-core's Index for regular forms, loom's LALR(1) engine for Lark.

The Index holds every automaton state x the whole vocabulary, built at compile time: masks are
one row copy, but a compile costs seconds (and memory in proportion) at a 128k vocabulary.
Kept as `--grammar-backend outlines` for comparison and for grammars that want its exact
masks per state; JSON schemas go through `compile_json_schema`, which chooses a regex or the
CFG engine per schema (and unrolls recursion the LALR engine refuses).
"""

from __future__ import annotations

import json
from typing import Any

from ..base import Grammar
from ..forms import Form
from . import Engine


class OutlinesEngine(Engine):
    name = "outlines"
    json_form = "json_schema"

    def __init__(self, tokenizer: Any, vocab):
        self.vocab = vocab

    def build(self, form: Form) -> Grammar:
        if form.syntax == "json_schema":
            from ..json_schema import compile_json_schema

            return compile_json_schema(json.loads(form.text), self.vocab, form.json_options)
        if form.syntax == "regex":
            from ..regex_grammar import CompiledRegex, RegexGrammar

            return RegexGrammar(CompiledRegex(form.text, self.vocab))
        from ..ebnf import compile_lark

        return compile_lark(form.text, self.vocab)
