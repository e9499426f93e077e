"""loom's JSON schema -> grammar translator.

`json_schema_to_regex` covers schemas without recursion; `json_schema_to_lark` writes any
schema (recursive `$ref`s included) as a Lark grammar; `compile_json_schema` picks the first
that applies and returns a `Grammar` over a vocabulary.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

from ..base import Grammar, GrammarError
from .algebra import LarkAlgebra, RegexAlgebra, TooLarge
from .negation import Unsatisfiable
from .translate import JsonSchemaOptions, Recursive, Translator

__all__ = [
    "JsonSchemaOptions",
    "compile_json_schema",
    "json_schema_to_lark",
    "json_schema_to_regex",
    "normalize_schema",
]
MAX_REGEX_CHARS = 200_000
log = logging.getLogger(__name__)


class NeedsCFG(GrammarError):
    """The schema has no (practical) regex; the CFG engine can take it."""


def normalize_schema(spec: Any) -> dict | bool:
    """A JSON string, a dict/bool, or a pydantic model class -> the schema object."""
    if isinstance(spec, (str, bytes)):
        try:
            return json.loads(spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"json_schema is not valid JSON: {e}") from None
    if isinstance(spec, type) and hasattr(spec, "model_json_schema"):
        return spec.model_json_schema()
    if isinstance(spec, (dict, bool)):
        return spec
    raise GrammarError(f"json_schema must be a JSON string, dict or pydantic model, got {spec!r}")


def has_recursive_ref(schema) -> bool:
    """Whether a local `$ref` cycle is reachable from the root (such a schema has no regex).
    A cheap walk over the schema's JSON, so callers can skip a regex attempt that would fail
    only after translating most of the schema."""
    from .merge import MergeError, resolve_pointer

    done: set[str] = set()

    def walk(node, refs: tuple) -> bool:
        if isinstance(node, list):
            return any(walk(x, refs) for x in node)
        if not isinstance(node, dict):
            return False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref in refs:
                return True
            if ref not in done:
                try:
                    target = resolve_pointer(schema, ref)
                except (MergeError, ValueError, IndexError):
                    target = None
                if walk(target, (*refs, ref)):
                    return True
                done.add(ref)
        # definitions are reached through the $refs that use them
        skip = ("$ref", "const", "enum", "$defs", "definitions")
        return any(walk(v, refs) for k, v in node.items() if k not in skip)

    return walk(schema, ())


def _options(opts: JsonSchemaOptions | None, kw) -> JsonSchemaOptions:
    return replace(opts or JsonSchemaOptions(), **kw)


def json_schema_to_regex(
    spec: Any, opts: JsonSchemaOptions | None = None, *, max_chars: int = MAX_REGEX_CHARS, **kw
) -> str:
    """The regex of a non-recursive schema's JSON texts: NeedsCFG if the schema is recursive or
    its regex would pass `max_chars` characters (the translation stops as soon as any part
    does, so a low limit also bounds the time spent finding out)."""
    return _to_regex(normalize_schema(spec), _options(opts, kw), max_chars=max_chars)[0]


def _to_regex(
    schema, options: JsonSchemaOptions, unroll: int | None = None, max_chars: int = MAX_REGEX_CHARS
) -> tuple[str, int]:
    tr = Translator(schema, RegexAlgebra(max_chars), options, unroll=unroll)
    try:
        return tr.value(schema), tr.unkeyed_any
    except Recursive as e:
        raise NeedsCFG(f"recursive $ref {e} cannot be a regex; use the CFG engine") from None
    except TooLarge:
        raise NeedsCFG("schema expands to too large a regex; use the CFG engine") from None
    except RecursionError:
        raise GrammarError("schema nests too deeply") from None
    except Unsatisfiable as e:
        raise GrammarError(f"schema admits no value: {e}") from None


def json_schema_to_lark(
    spec: Any, opts: JsonSchemaOptions | None = None, *, fuse: bool = True, **kw
) -> str:
    """A Lark grammar (start rule `start`) for any schema, recursive `$ref`s included.
    `fuse=False` keeps every literal and leaf its own terminal (see LarkAlgebra)."""
    schema = normalize_schema(spec)
    alg = LarkAlgebra(fuse)
    tr = Translator(schema, alg, _options(opts, kw), rules=True)
    try:
        return alg.grammar(tr.value(schema))
    except RecursionError:
        raise GrammarError("schema nests too deeply") from None
    except Unsatisfiable as e:
        raise GrammarError(f"schema admits no value: {e}") from None


def compile_json_schema(spec: Any, vocab, opts: JsonSchemaOptions | None = None, **kw) -> Grammar:
    """A grammar for `spec` over `vocab`.

    The regex engine (outlines-core) takes schemas it can hold well; recursive schemas, ones
    too large for a regex, and ones with a free-form value that no object key precedes
    (see Translator.keyed) go to the CFG engine, as does a regex outlines-core refuses.
    """
    from ..regex_grammar import CompiledRegex, RegexGrammar

    schema = normalize_schema(spec)
    options = _options(opts, kw)
    try:
        regex, unkeyed_any = _to_regex(schema, options)
        if unkeyed_any:
            raise NeedsCFG("free-form value at the top level")
        return RegexGrammar(CompiledRegex(regex, vocab))
    except NeedsCFG as e:
        reason = str(e)
    except GrammarError as e:
        if "cannot compile regex" not in str(e):
            raise
        reason = str(e)
    try:
        from ..ebnf import compile_lark
    except ImportError:
        raise GrammarError(f"{reason}, and the CFG engine is missing") from None
    try:
        return compile_lark(json_schema_to_lark(schema, options), vocab)
    except GrammarError as e:
        if "grammar error" not in str(e) or not reason.startswith("recursive"):
            raise
        cfg_error = e
    # The CFG engine is LALR(1): a recursive schema whose grammar is ambiguous there (anyOf
    # branches that overlap, ...) falls back to a regex that expands the recursion a bounded
    # number of times. Sound (every output is valid) but incomplete past that depth: say so.
    try:
        regex, _ = _to_regex(schema, options, unroll=options.max_recursion)
        grammar = RegexGrammar(CompiledRegex(regex, vocab))
    except GrammarError:
        raise cfg_error from None
    log.warning(
        "json schema: recursive $refs expanded %d levels deep (the CFG engine refused it: %s)",
        options.max_recursion,
        str(cfg_error)[:200],
    )
    return grammar
