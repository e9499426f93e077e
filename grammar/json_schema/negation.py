"""`not`, for the forms that have a schema without it.

Regular languages are closed under complement, but the regexes here are built, not
complemented, so `not` is rewritten instead: `not {}` admits nothing, `not {not: X}` is X,
`not {type: T}` narrows `type`, `not {enum/const}` of strings, null and booleans narrows those
types, and `not {required: [k]}` forbids key k. Other forms are reported as unenforceable.
"""

from __future__ import annotations

import json

from .merge import MergeError, merge

ALL_TYPES = ["null", "boolean", "object", "array", "number", "string"]


class Unsatisfiable(Exception):
    """The schema admits no value."""


def _types(s: dict) -> list[str]:
    t = s.get("type", ALL_TYPES)
    t = list(t) if isinstance(t, list) else [t]
    if "integer" in t and "number" in t:
        t.remove("integer")
    return t


def apply_not(s: dict) -> dict | None:
    """`s` with its `not` folded in, or None when this form of `not` is not supported."""
    neg = s["not"]
    rest = {k: v for k, v in s.items() if k != "not"}
    if neg is True or neg == {}:
        raise Unsatisfiable("'not {}' admits no value")
    if neg is False:
        return rest
    if not isinstance(neg, dict):
        return None
    keys = set(neg) - {"title", "description", "$comment"}
    try:
        if keys == {"not"}:
            return merge(rest, neg["not"])
        if keys == {"type"}:
            drop = set(neg["type"] if isinstance(neg["type"], list) else [neg["type"]])
            if "number" in drop:
                drop.add("integer")
            kept = [t for t in _types(rest) if t not in drop]
            if "integer" in drop and "number" in kept:
                return None  # "a number that is not an integer" has no type of its own
            if not kept:
                raise Unsatisfiable("'not' excludes every type")
            return {**rest, "type": kept}
    except MergeError:
        return None
    if keys in ({"enum"}, {"const"}):
        values = neg["enum"] if "enum" in neg else [neg["const"]]
        return _not_values(rest, values)
    if keys == {"required"} and len(neg["required"]) == 1:
        key = neg["required"][0]
        props = {k: v for k, v in (rest.get("properties") or {}).items() if k != key}
        if key in (rest.get("required") or []):
            raise Unsatisfiable(f"key {key!r} is both required and forbidden")
        forbidden = list(rest.get("x-loom-forbidden", [])) + [key]
        return {**rest, "properties": props, "x-loom-forbidden": forbidden}
    return None


def _not_values(rest: dict, values: list) -> dict | None:
    types = _types(rest)
    strings = [v for v in values if isinstance(v, str)]
    for v in values:
        if v is None and "null" in types:
            types.remove("null")
        elif isinstance(v, bool) and "boolean" in types:
            other = not v
            if rest.get("enum") is None and types == ["boolean"]:
                return {**rest, "const": other}
            return None
        elif not isinstance(v, (str, type(None), bool)):
            return None  # numbers, objects, arrays
    if not types:
        raise Unsatisfiable("'not' excludes every value")
    out = {**rest, "type": types}
    if strings and "string" in types:
        if "enum" in rest:  # an enum minus the excluded strings
            keep = [x for x in rest["enum"] if json.dumps(x) not in {json.dumps(v) for v in values}]
            if not keep:
                raise Unsatisfiable("'not' excludes every enum value")
            return {**{k: v for k, v in rest.items() if k != "type"}, "enum": keep}
        if any(k in rest for k in ("pattern", "format", "minLength", "maxLength")):
            return None
        out["x-loom-not-strings"] = strings
    return out
