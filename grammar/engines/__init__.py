"""Mask engines behind loom's translation: a registry and a factory with lazy imports.

An engine turns a `Form` (forms.py: a regex or a Lark grammar) into a `Grammar` over one
vocabulary. It is built once per `GrammarBackend` (building its tokenizer view is the
expensive part: about a second at 128k tokens) and shared by every compile.

    llguidance  lazy Earley parser + token trie + derivative regexes (the default)
    xgrammar    pushdown automata with an adaptive token-mask cache
    outlines    loom's eager engine: outlines-core's regex x vocabulary Index for regular
                forms, loom's LALR(1) engine (ebnf/) for Lark forms
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

from ..base import Grammar, GrammarError
from ..forms import Form

ENGINES = {
    "llguidance": ("llguidance_engine", "LLGuidanceEngine"),
    "xgrammar": ("xgrammar_engine", "XGrammarEngine"),
    "outlines": ("outlines_engine", "OutlinesEngine"),
}
DEFAULT_ENGINE = "llguidance"


class Engine(ABC):
    """`json_form`: how json_schema specs reach `build` (see forms.translate);
    `json_regex_limit`: with json_form "regex", the longest regex (characters) the engine
    takes before the schema comes as Lark rules instead (None: the translator's own bound)."""

    name: str
    json_form: str = "lark"
    json_regex_limit: int | None = None

    @abstractmethod
    def build(self, form: Form) -> Grammar:
        """A fresh grammar object at the start of `form`; raises GrammarError."""


class MatcherGrammar(Grammar):
    """A Grammar over a native matcher that rolls back by token count: `matcher.rollback(k)`.
    `_n` counts the tokens accepted since the start (the rollback bound); subclasses add one
    per accepted token and carry it into copies."""

    matcher: Any
    _n: int

    def rollback(self, k: int) -> None:
        if k < 0 or k > self._n:
            raise GrammarError(f"cannot roll back {k} of {self._n} tokens")
        if k:
            self.matcher.rollback(k)
            self._n -= k


def check_engine(name: str) -> str:
    if name not in ENGINES:
        raise ValueError(f"unknown grammar engine {name!r}; expected one of {tuple(ENGINES)}")
    return name


def make_engine(name: str, tokenizer: Any, vocab) -> Engine:
    module, cls = ENGINES[check_engine(name)]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(tokenizer, vocab)
