"""loom's front ends: every grammar kind -> one `Form` (a regex or a Lark grammar) for an engine.

This is the part of structured generation loom owns, whatever engine computes the masks:

    regex        -> Form("regex", pattern)     (\\d \\w \\s as ASCII; checked by the engine)
    choices      -> Form("regex", escaped alternation)
    json_schema  -> Form("lark", json_schema_to_lark(schema))    (any schema, recursion too)
                    or Form("regex", ...) for engines that prefer one while it is
                    small (llguidance: up to 10k characters; xgrammar: 200k)
                    or Form("json_schema", ...) (outlines translates per schema itself)
    ebnf (GBNF)  -> Form("lark", ...)                            (loom's GBNF translation)
    ebnf (Lark)  -> Form("lark", text)                           (as outlines' CFG sends it)
    lark         -> Form("lark", text)

`translate` is a pure function of its arguments (a picklable result, no vocabulary), so the
backend can run it in a worker process that it kills when the translation runs past its
deadline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .base import GrammarError

KINDS = ("regex", "json_schema", "ebnf", "lark", "choices")


@dataclass(frozen=True)
class Form:
    """`syntax` is "regex" (the whole output must match `text`), "lark" (start rule `start`;
    terminals are regexes written `/.../`), or "json_schema" (the normalized schema as JSON
    text, for the outlines engine, which picks its own form per schema)."""

    syntax: str
    text: str
    json_options: Any = None  # only for syntax "json_schema" (an engine that translates itself)


def translate(
    kind: str,
    spec: Any,
    json_options=None,
    json_form: str = "lark",
    regex_limit: int | None = None,
) -> Form:
    """The Form of a spec; raises GrammarError naming what is wrong. `json_form` is the
    engine's choice for JSON schemas: "lark", "regex" (Lark when there is no regex, or when
    the regex would pass `regex_limit` characters) or "json_schema" (checked here, translated
    by the engine)."""
    if kind == "regex":
        if not spec:
            raise GrammarError("regex: empty pattern")
        from .regex_classes import ascii_classes

        return Form("regex", ascii_classes(spec))
    if kind == "choices":
        from .choices import choices_to_regex

        return Form("regex", choices_to_regex(list(spec)))
    if kind == "json_schema":
        import json

        from .json_schema import (
            NeedsCFG,
            has_recursive_ref,
            json_schema_to_lark,
            json_schema_to_regex,
        )

        if json_form == "json_schema":
            return Form("json_schema", json.dumps(spec), json_options)
        if json_form == "regex" and not has_recursive_ref(spec):
            limit = {} if regex_limit is None else {"max_chars": regex_limit}
            try:
                return Form("regex", json_schema_to_regex(spec, json_options, **limit))
            except NeedsCFG:
                pass
        # unfused terminals: the Lark engines here lex greedily or per character
        return Form("lark", json_schema_to_lark(spec, json_options, fuse=False))
    if kind == "ebnf":
        if is_lark(spec):  # outlines' CFG type (and others) send Lark as SGLang's `ebnf`
            return Form("lark", spec)
        try:
            return Form("lark", gbnf_as_lark(spec))
        except GrammarError as e:
            raise GrammarError(f"{e} (ebnf accepts GBNF, `root ::= ...`, or a Lark grammar "
                               "with a `start` rule)") from None  # fmt: skip
    if kind == "lark":
        if not spec.strip():
            raise GrammarError("lark grammar: empty grammar")
        return Form("lark", spec)
    raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {KINDS}")


_LARK_RULE = re.compile(r"(?m)^[ \t]*[?!]?[A-Za-z_]\w*(\.-?\d+)?[ \t]*:(?!:)")


def is_lark(text: str) -> bool:
    """A grammar written in Lark (`name: ...` definitions, a `start` rule), not GBNF (whose
    rules are `name ::= ...`)."""
    return (
        isinstance(text, str)
        and "::=" not in text
        and re.search(r"(?m)^[ \t]*[?!]?start[ \t]*:", text) is not None
        and _LARK_RULE.search(text) is not None
    )


def gbnf_as_lark(text: str) -> str:
    """GBNF -> a self-contained Lark grammar: loom's translation (ebnf/gbnf.py), with its
    side-table terminals written out as `T: /regex/` definitions."""
    from .ebnf.gbnf import gbnf_to_lark

    if not isinstance(text, str) or not text.strip():
        raise GrammarError("ebnf grammar: empty grammar")
    lark_text, terminals = gbnf_to_lark(text)
    lines = [ln for ln in lark_text.splitlines() if not ln.startswith("%declare")]
    for name, regex in terminals.items():
        lines.append(f"{name}: /{lark_regex(regex)}/")
    return "\n".join(lines) + "\n"


def lark_regex(regex: str) -> str:
    """A regex escaped for Lark's `/.../` literal (a bare `/` would end it)."""
    out, i = [], 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            out.append(regex[i : i + 2])
            i += 2
            continue
        out.append("\\/" if c == "/" else c)
        i += 1
    return "".join(out)
