"""JSON schema -> structure, written through an algebra (regex or Lark, see algebra.py).

One `Translator` walks one schema. Every keyword is either enforced, ignored because it is an
annotation (title, description, examples, ...), or reported through `fail` with its JSON path:
a `GrammarError` by default, a logged warning with `lenient=True`. `oneOf` is written as
the union of its branches after checking, pair by pair, that no value can match two of them
(`Translator.exclusive`); where that cannot be shown the keyword is reported like any other.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, replace
from functools import lru_cache, reduce

from ..base import GrammarError
from . import numbers as N
from . import strings as S
from .merge import Conflict, MergeError, key_matches, merge, resolve_pointer
from .negation import Unsatisfiable, apply_not
from .regex_format import regex_format_body

log = logging.getLogger(__name__)

UNSUPPORTED = {
    "if", "uniqueItems",
    "contains", "minContains", "maxContains", "propertyNames", "unevaluatedProperties",
    "unevaluatedItems",
    "multipleOf", "$dynamicRef", "$recursiveRef",
}  # fmt: skip
# oneOf branches whose regexes are at most this long are checked for overlap with interegular
# (pure Python: its automata for a few thousand characters of JSON regex take minutes)
MAX_CHECK_CHARS = 600
_OBJECT_KEYS = ("properties", "required", "additionalProperties", "patternProperties")
_DEPENDENCY_KEYS = {"dependencies", "dependentRequired", "dependentSchemas"}
_ARRAY_KEYS = ("items", "prefixItems", "minItems", "maxItems", "additionalItems")
_STRING_KEYS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_FORMATS = {**S.FORMATS, "regex": regex_format_body()}


@dataclass(frozen=True)
class JsonSchemaOptions:
    """`whitespace_pattern`: regex for the whitespace allowed around every separator; None
    means compact output with at most one space after `,` and `:` (so it cannot loop).
    `additional_properties_default`: what a missing `additionalProperties` means. False (the
    default, like xgrammar's strict mode and OpenAI structured outputs) forbids unlisted keys,
    which is what a model should generate; True is the JSON Schema validation rule.
    `max_any_depth`: nesting allowed inside values the schema leaves free (regex only; the
    CFG path allows any depth). `max_repeat`: maxLength/maxItems above this are not enforced
    (logged): a DFA that counts to 32,767 is too big to build, and max_new_tokens bounds the
    output anyway. `max_recursion`: how many times a recursive `$ref` is expanded when the
    CFG engine cannot take the schema and a depth-bounded regex stands in for it."""

    whitespace_pattern: str | None = None
    lenient: bool = False
    additional_properties_default: bool = False
    max_any_depth: int = 2
    max_repeat: int = 512
    max_recursion: int = 3


class Recursive(Exception):
    """A recursive $ref in regex mode: the schema needs the CFG engine."""


class Translator:
    def __init__(
        self, root, alg, opts: JsonSchemaOptions, rules: bool = False, unroll: int | None = None
    ):
        self.root, self.A, self.o, self.rules = root, alg, opts, rules
        self.unroll = unroll  # regex mode: expand recursive $refs this many times, then cut
        self.stack: list[str] = []
        self.rule_names: dict[str, str] = {}
        self._any: dict[int, object] = {}
        # A free-form value that no object key precedes (at the root, in a root array or in
        # root-level extra members) makes outlines-core's DFA build explode: its start-anywhere
        # search automaton restarts at every nested "{" or "[". Such schemas go to the CFG.
        self.keyed = False
        self.unkeyed_any = 0
        ws = opts.whitespace_pattern
        A = alg
        if ws is None:
            self.comma, self.colon = A.leaf(",[ ]?"), A.leaf(":[ ]?")
            self.lbrace, self.rbrace, self.lbrack, self.rbrack = map(A.lit, "{}[]")
        else:
            w = f"(?:{ws})"
            self.comma, self.colon = A.leaf(f"{w},{w}"), A.leaf(f"{w}:{w}")
            self.lbrace, self.lbrack = A.leaf(r"\{" + w), A.leaf(r"\[" + w)
            self.rbrace, self.rbrack = A.leaf(w + r"\}"), A.leaf(w + r"\]")

    def fail(self, keyword: str, path: str, msg: str) -> None:
        text = f"{path or '#'}: {msg} (keyword {keyword!r})"
        if not self.o.lenient:
            raise GrammarError(text)
        log.warning("json schema: ignoring %s", text)

    # -- dispatch -------------------------------------------------------------------------------

    def value(self, s, path: str = "#"):
        A = self.A
        if s is True or s == {}:
            return self.any_value(self.o.max_any_depth)
        if s is False:
            raise Unsatisfiable(f"{path}: schema 'false' admits no value")
        if not isinstance(s, dict):
            raise GrammarError(f"{path}: a schema must be an object or a boolean, got {s!r}")
        if "$ref" in s:
            return self.ref(s, path)
        if "allOf" in s:
            parts = [self.deref(x, f"{path}/allOf/{i}") for i, x in enumerate(s["allOf"])]
            rest = {k: v for k, v in s.items() if k != "allOf"}
            try:
                merged = reduce(merge, parts, rest)
            except Conflict as e:
                raise Unsatisfiable(f"{path}: {e} admits no value") from None
            except MergeError as e:
                raise GrammarError(f"{path}: {e} (keyword 'allOf')") from None
            return self.value(merged, path)
        if _DEPENDENCY_KEYS & s.keys():
            return self.value(_dependencies_as_all_of(s), path)
        if "not" in s:
            folded = apply_not(s)
            if folded is None:
                self.fail("not", path, "this form of 'not' cannot be enforced by a token mask")
                folded = {k: v for k, v in s.items() if k != "not"}
            return self.value(folded, path)
        for kw in UNSUPPORTED & s.keys():
            if not _trivial(kw, s[kw]):
                self.fail(kw, path, "cannot be enforced by a token mask")
        if "const" in s or "enum" in s:
            values = self.admitted(s, path)
            if not values:
                raise Unsatisfiable(f"{path}: no const/enum value satisfies the schema")
            return A.alt(*[self.literal(v) for v in values])
        for kw in ("anyOf", "oneOf"):
            if kw in s:
                base = {k: v for k, v in s.items() if k not in ("anyOf", "oneOf")}
                branches, kept, raw = [], [], []
                for i, b in enumerate(s[kw]):
                    sub_path = f"{path}/{kw}/{i}"
                    try:
                        sub = merge(base, self.deref(b, sub_path)) if _constraining(base) else b
                        branches.append(self.value(sub, sub_path))
                        kept.append(sub)
                        raw.append(b)
                    except (MergeError, Unsatisfiable):
                        continue  # a branch that contradicts its siblings admits nothing
                if not branches:
                    raise Unsatisfiable(f"{path}: no {kw} branch is satisfiable")
                if kw == "oneOf" and len(branches) > 1:
                    exact = self.exclusive(kept, path, raw)
                    if exact is not None:
                        return self.value({"anyOf": exact}, path)
                return A.alt(*branches)
        types = self.types(s)
        if types is None:
            for kw in ("minProperties", "maxProperties"):
                if kw in s and not _trivial(kw, s[kw]):
                    self.fail(kw, path, "needs 'type': 'object' or listed properties")
            return self.any_value(self.o.max_any_depth)
        return A.alt(*[getattr(self, "t_" + t)(s, path) for t in types])

    def admitted(self, s: dict, path: str) -> list:
        """The const/enum values that also satisfy the schema's other keywords ({"enum": ["a",
        "bb"], "maxLength": 1} admits "a" only; merged allOf parts often look like this):
        each value's JSON text is matched against the regex of the rest of the schema."""
        from .algebra import RegexAlgebra, TooLarge

        values = [s["const"]] if "const" in s else list(s["enum"])
        if "const" in s and isinstance(s.get("enum"), list):
            allowed = _values({"enum": s["enum"]})
            values = [v for v in values if _values({"const": v}) <= allowed]
        rest = {k: v for k, v in s.items() if k not in _NOT_CONSTRAINTS}
        if not rest or not values:
            return values
        kept, checks = [], {}
        for v in values:
            # without a `type`, keywords constrain only their own type (JSON Schema's rule,
            # not the translator's inference that `properties` means an object)
            kind = _json_type(v) if "type" in rest else _schema_type(v)
            if kind not in checks:
                try:
                    opts = replace(self.o, additional_properties_default=True)
                    tr = Translator(self.root, RegexAlgebra(MAX_ENUM_CHECK_CHARS), opts)
                    typed = rest if "type" in rest else {**rest, "type": kind}
                    checks[kind] = re.compile(tr.value(typed, path))
                except Unsatisfiable:
                    checks[kind] = None
                except (TooLarge, Recursive, RecursionError, re.error):
                    self.fail("enum", path, "const/enum beside keywords too large to check")
                    return values
            if checks[kind] is not None and checks[kind].fullmatch(_dump(v)):
                kept.append(v)
        return kept

    def exclusive(self, schemas: list, path: str, own: list | None = None) -> list | None:
        """`oneOf` is written as the union of its branches, which is exact only when no value
        matches two of them: check every pair (by type, by const/enum values, by a required
        key the other branch forbids or pins to other values, or, for small regexes, by an
        empty automaton intersection). Overlapping branches that only require keys are made
        exclusive instead (returned: each branch and not the ones it overlaps); otherwise
        the keyword is reported. None: the union is exact as it is. `own`: the branches
        before the sibling keywords were merged in (what is negated)."""
        overlaps: dict[int, list[int]] = {}
        for i in range(len(schemas)):
            for j in range(i + 1, len(schemas)):
                a, b = (self.deref(x, path) for x in (schemas[i], schemas[j]))
                if self._disjoint(a, b) or self._disjoint_regex(a, b):
                    continue
                overlaps.setdefault(i, []).append(j)
                overlaps.setdefault(j, []).append(i)
        if not overlaps:
            return None
        own = schemas if own is None else own
        negations = {j: _negate_required(self._flat(self.deref(own[j], path))) for j in overlaps}
        if any(n is None for n in negations.values()):
            i = min(overlaps)
            self.fail("oneOf", path, f"branches {i} and {overlaps[i][0]} may both match one "
                      "value, so oneOf's exclusivity cannot be enforced")  # fmt: skip
            return None
        return [
            {"allOf": [s, *(negations[j] for j in overlaps.get(i, []))]}
            for i, s in enumerate(schemas)
        ]

    def _disjoint(self, a, b) -> bool:
        """No value loom writes for one branch is valid for the other, both ways."""
        return self._excludes(a, b) and self._excludes(b, a)

    def _excludes(self, x, y, depth: int = 0) -> bool:
        """Every value loom writes for schema `x` is invalid for schema `y` (JSON Schema's
        rules for `y`: keywords constrain only their own type, unlisted keys are allowed
        unless forbidden)."""
        if not (isinstance(x, dict) and isinstance(y, dict)) or depth > 8:
            return False
        x, y = self._flat(x), self._flat(y)
        tx, ty = _type_set(self, x), _explicit_types(y)
        if tx is not None and ty is not None and not (tx & ty):
            return True
        vx, vy = _values(x), _values(y)
        if vx is not None and vy is not None and not (vx & vy):
            return True
        if tx != {"object"}:
            return False
        # x's outputs are objects: y rejects them if it requires a key they never have, forbids
        # a key they always have, or pins such a key to values they never write there
        if any(not self._generates_key(x, k) for k in y.get("required") or []):
            return True
        y_props = y.get("properties") or {}
        for key in x.get("required") or []:
            if not isinstance(key, str):
                continue
            if key not in y_props:
                if y.get("additionalProperties") is False and not y.get("patternProperties"):
                    return True
                continue
            px = self.deref((x.get("properties") or {}).get(key, {}), "#")
            if self._excludes(px, self.deref(y_props[key], "#"), depth + 1):
                return True
        return False

    def _flat(self, s):
        """`s` with a top-level allOf merged in, when the parts merge."""
        if not isinstance(s, dict) or "allOf" not in s:
            return s
        try:
            parts = [self.deref(x, "#") for x in s["allOf"]]
            return reduce(merge, parts, {k: v for k, v in s.items() if k != "allOf"})
        except (MergeError, GrammarError):
            return s

    def _generates_key(self, x, key) -> bool:
        """Whether an output written for schema `x` can have member `key` (or be a
        non-object): False only for objects whose members loom writes are known."""
        if not isinstance(key, str) or _type_set(self, x) != {"object"}:
            return True
        props = x.get("properties") or {}
        if key in props or key in (x.get("required") or []):
            return True
        if any(key_matches(p, key) for p in x.get("patternProperties") or {}):
            return True
        default = self.o.additional_properties_default or "properties" not in x
        return x.get("additionalProperties", default and "patternProperties" not in x) is not False

    def _disjoint_regex(self, a, b) -> bool:
        """Both branches written with JSON Schema's own rules (unlisted keys allowed unless
        forbidden, free values 3 deep) as small regexes whose automata do not intersect."""
        from .algebra import RegexAlgebra, TooLarge

        opts = replace(self.o, additional_properties_default=True, max_any_depth=3)
        try:
            ra, rb = (
                Translator(self.root, RegexAlgebra(MAX_CHECK_CHARS), opts).value(x) for x in (a, b)
            )
            return _regexes_disjoint(ra, rb)
        except (TooLarge, Recursive, RecursionError, GrammarError, Unsatisfiable):
            return False

    def types(self, s) -> list[str] | None:
        t = s.get("type")
        if t is None:
            inferred = [
                name
                for name, keys in (
                    ("object", _OBJECT_KEYS),
                    ("array", _ARRAY_KEYS),
                    ("string", _STRING_KEYS),
                    ("number", _NUMBER_KEYS),
                )
                # `properties: {}`, `required: []`, `items: {}` constrain nothing: a schema of
                # only those admits any value (MaskBench has string items under them)
                if any(k in s and not _says_nothing(s[k]) for k in keys)
            ]
            if not inferred:
                return None
            t = inferred
        types = list(dict.fromkeys(t if isinstance(t, list) else [t]))
        if s.get("nullable") is True and "null" not in types:
            types.append("null")
        if "number" in types and "integer" in types:
            types.remove("integer")
        for x in types:
            if x not in ("null", "boolean", "object", "array", "number", "string", "integer"):
                raise GrammarError(f"unknown type {x!r} (keyword 'type')")
        return types

    def deref(self, s, path: str, depth: int = 0):
        """Replace a top-level $ref by its target merged with the sibling keywords."""
        while isinstance(s, dict) and "$ref" in s and depth < 32:
            try:
                target = resolve_pointer(self.root, s["$ref"])
                siblings = {k: v for k, v in s.items() if k != "$ref"}
                s = merge(target, siblings) if siblings else target
            except MergeError as e:
                raise GrammarError(f"{path}: {e} (keyword '$ref')") from None
            depth += 1
        return s

    def ref(self, s, path: str):
        ref = s["$ref"]
        if ref in self.stack and not self.rules:
            if self.unroll is None:
                raise Recursive(ref)
            if self.stack.count(ref) >= self.unroll:
                # the next level of a recursive schema: cut here (optional members, anyOf
                # branches and array items that need it drop out)
                raise Unsatisfiable(f"{path}: recursion through {ref} deeper than {self.unroll}")
        siblings = {k: v for k, v in s.items() if k != "$ref"}
        if self.rules and not _constraining(siblings):
            name = self.rule_names.get(ref)
            if name is None:
                name = f"r{len(self.rule_names)}_" + re.sub(r"[^a-z0-9]+", "_", ref.lower())[-40:]
                self.rule_names[ref] = name
                self.A.rules[name] = self.A.leaf("")  # placeholder while the body is built
                self.A.rules[name] = self.value(self.deref({"$ref": ref}, path), ref)
            return self.A.ref(name)
        self.stack.append(ref)
        try:
            return self.value(self.deref(s, path), path)
        finally:
            self.stack.pop()

    # -- values ---------------------------------------------------------------------------------

    def literal(self, v):
        A = self.A
        if isinstance(v, dict):
            members = [A.seq(A.lit(_dump(k)), self.colon, self.literal(x)) for k, x in v.items()]
            return A.seq(self.lbrace, *_join(A, members, self.comma), self.rbrace)
        if isinstance(v, list):
            items = [self.literal(x) for x in v]
            return A.seq(self.lbrack, *_join(A, items, self.comma), self.rbrack)
        if isinstance(v, float) and v == int(v) and abs(v) < 1e16:
            return A.alt(A.lit(str(int(v))), A.lit(_dump(v)))
        if isinstance(v, str):
            return A.alt(A.lit(_dump(v)), A.lit(json.dumps(v)))
        return A.lit(_dump(v))

    def any_value(self, depth: int):
        self.unkeyed_any += not self.keyed
        if self.rules:  # a CFG can say "any JSON value" exactly, at any depth
            return self._any_rule()
        if depth in self._any:
            return self._any[depth]
        A = self.A
        scalars = A.leaf(f'null|true|false|{N.NUMBER}|"{S.CHAR}*"')
        if depth <= 0:
            node = scalars
        else:
            inner = self.any_value(depth - 1)
            member = A.seq(A.leaf(f'"{S.CHAR}*"'), self.colon, inner)
            node = A.alt(
                scalars,
                A.seq(self.lbrack, A.opt(_list(A, inner, self.comma)), self.rbrack),
                A.seq(self.lbrace, A.opt(_list(A, member, self.comma)), self.rbrace),
            )
        self._any[depth] = node
        return node

    def _any_rule(self):
        A = self.A
        if "json_value" not in A.rules:
            A.rules["json_value"] = A.leaf("")
            value, string = A.ref("json_value"), A.leaf(f'"{S.CHAR}*"')
            member = A.seq(string, self.colon, value)
            A.rules["json_value"] = A.alt(
                A.leaf(f"null|true|false|{N.NUMBER}"),
                string,
                A.seq(self.lbrack, A.opt(_list(A, value, self.comma)), self.rbrack),
                A.seq(self.lbrace, A.opt(_list(A, member, self.comma)), self.rbrace),
            )
        return A.ref("json_value")

    def t_null(self, s, path):
        return self.A.lit("null")

    def t_boolean(self, s, path):
        return self.A.leaf("true|false")

    def t_integer(self, s, path):
        m = s.get("multipleOf")
        if m is not None and m != 1:
            self.fail("multipleOf", path, f"multipleOf {m} is not supported")
        lo, hi = N.integer_bounds(s)
        r = N.int_range(lo, hi)
        if r is None:
            raise GrammarError(f"{path}: integer range [{lo}, {hi}] is empty (keyword 'minimum')")
        return self.A.leaf(r)

    def t_number(self, s, path):
        m, digits = s.get("multipleOf"), None
        if m is not None:
            if m == 1:
                return self.t_integer({k: v for k, v in s.items() if k != "multipleOf"}, path)
            digits = N.decimal_places(m)
            if digits is None:
                self.fail("multipleOf", path, f"multipleOf {m} is not supported here")
        if not any(k in s for k in _NUMBER_KEYS):
            return self.A.leaf(N.NUMBER if digits is None else N.at_most_decimals(digits))
        try:
            r = N.number_range(s, digits)
        except ValueError as e:
            self.fail("minimum", path, f"number bound: {e}")
            return self.A.leaf(N.NUMBER)
        if r is None:
            raise GrammarError(f"{path}: number range is empty (keyword 'minimum')")
        return self.A.leaf(r)

    def bound(self, n, keyword: str, path: str):
        if n is not None and n > self.o.max_repeat:
            log.info("json schema %s: %s %d is not enforced (above %d)", path, keyword, n,
                     self.o.max_repeat)  # fmt: skip
            return None
        return n

    def t_string(self, s, path):
        lo, hi = s.get("minLength", 0), self.bound(s.get("maxLength"), "maxLength", path)
        fmt = _FORMATS.get(s.get("format"))
        if "pattern" in s and fmt is not None:
            body = self._pattern_and_format(s, fmt, path)
            if body == fmt:
                self._lengths_implied(S.regex_width(fmt), lo, hi, path, f"format {s['format']!r}")
                return self.A.leaf(f'"{body}"')
        if "pattern" in s:
            try:
                body = S.pattern_body(s["pattern"])
                if lo or hi is not None:
                    both = S.pattern_with_length(s["pattern"], lo, hi)
                    if both is not None:
                        body = both
                    else:
                        width = S.pattern_width(s["pattern"])
                        self._lengths_implied(width, lo, hi, path, "pattern")
            except S.PatternError as e:
                self.fail("pattern", path, str(e))
                body = S.string_body(lo, hi)
        elif fmt is not None:
            body = fmt
            self._lengths_implied(S.regex_width(body), lo, hi, path, f"format {s['format']!r}")
        elif "x-loom-not-strings" in s:
            plain = [v for v in s["x-loom-not-strings"] if v.isprintable() and '"' not in v]
            if len(plain) < len(s["x-loom-not-strings"]) or "\\" in "".join(plain):
                self.fail("not", path, "'not' of strings with quotes or escapes")
            body = S.not_in_set(plain)
        else:
            if "format" in s:
                log.info("json schema %s: format %r is not enforced", path, s["format"])
            body = S.string_body(lo, hi)
        return self.A.leaf(f'"{body}"')

    def _pattern_and_format(self, s, fmt: str, path: str) -> str:
        """`pattern` and `format` together: the format's body where it lies inside the
        pattern's language, else the pattern's where it lies inside the format's; otherwise
        the pattern's, and the format is not enforced (logged, as an unknown format is: the
        regex engines here have no intersection)."""
        try:
            pattern = S.pattern_body(s["pattern"])
        except S.PatternError:
            return ""  # t_string reports the pattern
        if _regex_subset(fmt, pattern):
            return fmt
        if not _regex_subset(pattern, fmt):
            log.info(
                "json schema %s: format %r beside a pattern is not enforced", path, s["format"]
            )
        return pattern

    def _lengths_implied(self, width, lo, hi, path, what):
        """A pattern or format decides the length; minLength/maxLength must not narrow it."""
        wlo, whi = width
        if wlo < lo or (hi is not None and (whi is None or whi > hi)):
            self.fail("maxLength", path, f"minLength/maxLength narrowing a {what}")

    def t_object(self, s, path):
        from .objects import object_node

        return object_node(self, s, path)

    def t_array(self, s, path):
        from .objects import array_node

        return array_node(self, s, path)


def _dependencies_as_all_of(s: dict) -> dict:
    """`dependencies` (and 2019-09's dependentRequired / dependentSchemas) as plain keywords:
    each trigger key k is either absent, or present together with what it needs (the listed
    keys, or the dependent schema): {"anyOf": [{"properties": {k: false}}, {required: [k, ..]}]},
    one such anyOf per trigger under allOf, which the merge expands into object variants."""
    rest = {k: v for k, v in s.items() if k not in _DEPENDENCY_KEYS}
    parts = list(rest.pop("allOf", []))
    for kw in sorted(_DEPENDENCY_KEYS & s.keys()):
        deps = s[kw]
        if not isinstance(deps, dict):
            raise GrammarError(f"'{kw}' must be an object, got {deps!r}")
        for key, need in deps.items():
            absent = {"properties": {key: False}}
            if isinstance(need, list):
                if not need:
                    continue
                present = {"required": [key, *need]}
            elif need is True or need == {}:
                continue
            elif need is False:
                parts.append(absent)
                continue
            else:
                present = {"allOf": [{"required": [key]}, _absence(need)]}
            parts.append({"anyOf": [absent, present]})
    return {**rest, "allOf": parts} if parts else rest


_ANNOTATIONS = {"title", "description", "$comment", "examples", "default"}
# keys beside const/enum that do not constrain the value
_NOT_CONSTRAINTS = _ANNOTATIONS | {
    "const", "enum", "$schema", "$id", "id", "definitions", "$defs", "deprecated", "readOnly",
    "writeOnly", "$anchor",
}  # fmt: skip
MAX_ENUM_CHECK_CHARS = 100_000


def _negate_required(s) -> dict | None:
    """`not s` for a branch that only requires keys (`{"required": ["a", "b"]}`): some of
    them is absent. None for any other branch."""
    if not isinstance(s, dict) or set(s) - _ANNOTATIONS != {"required"}:
        return None
    keys = s["required"]
    if not keys or not all(isinstance(k, str) for k in keys):
        return None
    absent = [{"properties": {k: False}} for k in dict.fromkeys(keys)]
    return absent[0] if len(absent) == 1 else {"anyOf": absent}


def _absence(s):
    """{"not": {"required": [k]}} (k must be absent) as {"properties": {k: false}}, which merges
    with other such conditions where several 'not's would not."""
    if isinstance(s, dict) and s.keys() == {"not"} and isinstance(s["not"], dict):
        req = s["not"].get("required")
        if s["not"].keys() == {"required"} and isinstance(req, list) and len(req) == 1:
            return {"properties": {req[0]: False}}
    return s


def _says_nothing(v) -> bool:
    """An empty `properties`/`required`/`items` value (`1 == True`, hence `is True`)."""
    return v is True or (isinstance(v, (dict, list)) and not v)


def _trivial(kw: str, v) -> bool:
    return (
        (kw == "uniqueItems" and v is False)
        or (kw == "minProperties" and v == 0)
        or (kw == "maxProperties" and v is None)
        or (kw in ("multipleOf",))  # checked per type
    )


def _type_set(tr, s) -> set | None:
    """The JSON types a schema admits (integer counted as number), None when unknown."""
    if "const" in s or "enum" in s:
        vals = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(vals, list):
            return None
        return {_json_type(v) for v in vals}
    if "type" not in s and any(k in s for k in ("anyOf", "oneOf", "allOf", "not", "$ref")):
        return None  # (an explicit type bounds the types whatever the composites say)
    try:
        types = tr.types(s)
    except GrammarError:
        return None
    if types is None:
        return None
    return {"number" if t == "integer" else t for t in types}


def _explicit_types(s) -> set | None:
    """The types a schema admits under JSON Schema's rules (no inference from keywords):
    its `type` or const/enum values; None when it admits every type."""
    if "const" in s or isinstance(s.get("enum"), list):
        return {_json_type(v) for v in ([s["const"]] if "const" in s else s["enum"])}
    t = s.get("type")
    if t is None or "$ref" in s:  # (before 2019-09, keywords beside $ref are ignored)
        return None
    types = set(t if isinstance(t, list) else [t])
    if s.get("nullable") is True:
        types.add("null")
    return {"number" if x == "integer" else x for x in types}


def _schema_type(v) -> str:
    """The `type` of a JSON value, integers (also 2.0) as "integer"."""
    t = _json_type(v)
    return "integer" if t == "number" and float(v).is_integer() else t


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), "?")


def _values(s) -> set | None:
    """The canonical texts of a const/enum schema's values, None for other schemas."""
    if "const" in s:
        vals = [s["const"]]
    elif isinstance(s.get("enum"), list):
        vals = s["enum"]
    else:
        return None
    return {json.dumps(_integral(v), sort_keys=True) for v in vals}


def _integral(v):
    """1.0 and 1 are one JSON Schema value: compare them alike (also inside containers)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_integral(x) for x in v]
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    return v


def _constraining(siblings: dict) -> bool:
    meta = {"title", "description", "default", "examples", "$comment", "readOnly", "writeOnly"}
    meta |= {"$defs", "definitions", "$schema", "$id", "id"}
    return any(k not in meta for k in siblings)


def _dump(v) -> str:
    return json.dumps(v, ensure_ascii=False)


def _join(A, items, sep) -> list:
    out = []
    for i, x in enumerate(items):
        out += [sep, x] if i else [x]
    return out


def _list(A, item, sep):
    """One or more `item`s separated by `sep`."""
    return A.seq(item, A.rep(A.seq(sep, item), 0, None))


@lru_cache(maxsize=1024)
def _regex_subset(ra: str, rb: str) -> bool:
    """Every string matching `ra` matches `rb` (interegular automata, the two regexes
    together at most 2 * MAX_CHECK_CHARS characters; False where that cannot be shown)."""
    import interegular

    # interegular unrolls bounded repeats (a hostname's {0,61}) and splits its alphabet at
    # every class boundary (the non-ASCII ranges of a pattern's classes): either takes minutes
    bounds = re.findall(r"\{(?:[0-9]*,)?([0-9]+)\}", ra + rb)
    if len(ra) + len(rb) > 2 * MAX_CHECK_CHARS or max(map(int, bounds), default=0) > 16:
        return False
    if not (ra + rb).isascii():
        return False
    try:
        fa = interegular.parse_pattern(ra).to_fsm()
        fb = interegular.parse_pattern(rb).to_fsm()
        return (fa - fb).empty()
    except Exception:  # noqa: BLE001 - a regex interegular cannot read proves nothing
        return False


@lru_cache(maxsize=4096)
def _regexes_disjoint(ra: str, rb: str) -> bool:
    """No string matches both regexes (interegular automata; pure Python, so remembered: a
    schema translated twice, or a oneOf seen again, pays once)."""
    import interegular

    try:
        fa = interegular.parse_pattern(ra).to_fsm()
        fb = interegular.parse_pattern(rb).to_fsm()
        return (fa & fb).empty()
    except Exception:  # noqa: BLE001 - a regex interegular cannot read proves nothing
        return False
