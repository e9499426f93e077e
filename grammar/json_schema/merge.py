"""Schema plumbing before translation: local `$ref` resolution and `allOf` merging.

`allOf` is merged into one schema (an intersection) rather than concatenated: two object
schemas become one object with the union of properties and of `required`, bounds take the
tighter value, `type`/`enum` intersect. Keywords whose intersection has no schema form
(two different `pattern`s, say) raise `MergeError`.
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote


class MergeError(ValueError):
    pass


class Conflict(MergeError):
    """The parts contradict each other: no value satisfies both (types, consts)."""


def resolve_pointer(root, ref: str):
    """Resolve a local JSON pointer `#/a/b` (or `#`) against the root schema."""
    if not ref.startswith("#"):
        raise MergeError(f"remote $ref {ref!r} is not supported (only local '#/...')")
    if ref != "#" and not ref.startswith("#/"):  # a plain-name fragment: an anchor, not a path
        found = _anchor(root, ref)
        if found is None:
            raise MergeError(f"$ref {ref!r} does not resolve (no schema has that id or $anchor)")
        return found
    node = root
    for part in unquote(ref[1:]).split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise MergeError(f"$ref {ref!r} does not resolve")
    return node


def _anchor(node, ref: str):
    """The subschema whose `$anchor` is ref's name or whose `id`/`$id` is `#name` (draft 4-7
    plain-name fragments); None if there is none."""
    if isinstance(node, list):
        return next((f for f in (_anchor(x, ref) for x in node) if f is not None), None)
    if not isinstance(node, dict):
        return None
    if node.get("$anchor") == ref[1:] or ref in (node.get("id"), node.get("$id")):
        return node
    return next((f for f in (_anchor(v, ref) for v in node.values()) if f is not None), None)


_VALIDATION = {
    "const", "pattern", "format", "multipleOf", "not", "if", "then", "else", "prefixItems",
    "patternProperties", "propertyNames", "dependencies", "contains", "uniqueItems",
    "nullable", "$ref",
}  # fmt: skip


def _key(v) -> str:
    return json.dumps(v, sort_keys=True)


_TYPES = ("null", "boolean", "object", "array", "number", "string", "integer")


def _types(t) -> set[str]:
    return set(t) if isinstance(t, list) else {t}


def _merge_types(a, b) -> list[str]:
    ta, tb = _types(a), _types(b)
    out = ta & tb
    if "number" in ta and "integer" in tb or "integer" in ta and "number" in tb:
        out.add("integer")
    if not out:
        raise Conflict(f"allOf types {sorted(ta)} and {sorted(tb)} do not intersect")
    return sorted(out)


def merge(a, b):
    """The intersection of schemas a and b as one schema (both already dereferenced)."""
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    out = _merge(a, b)
    if "properties" in out:  # a key one side lists may be "additional" to the other side
        props = dict(out["properties"])
        for side, other in ((a, b), (b, a)):
            addl = side.get("additionalProperties", True)
            if addl is True or not isinstance(other.get("properties"), dict):
                continue
            for name in other["properties"]:
                if not _listed(side, name):
                    props[name] = False if addl is False else {"allOf": [props[name], addl]}
        out["properties"] = props
    return out


def _listed(s: dict, name: str) -> bool:
    """Whether `name` is one of schema s's own keys (listed, or matched by a pattern)."""
    if name in (s.get("properties") or {}):
        return True
    return any(key_matches(p, name) for p in s.get("patternProperties") or {})


def key_matches(pattern: str, name: str) -> bool:
    """Whether a patternProperties pattern matches a key (one Python cannot read may)."""
    try:
        return re.search(pattern, name) is not None
    except re.error:
        return True


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, vb in b.items():
        if k not in out:
            out[k] = vb
            continue
        va = out[k]
        if _key(va) == _key(vb):
            continue
        if k == "type":
            out[k] = _merge_types(va, vb)
        elif k == "properties":
            props = dict(va)
            for name, s in vb.items():
                props[name] = {"allOf": [props[name], s]} if name in props else s
            out[k] = props
        elif k == "required":
            out[k] = list(dict.fromkeys(list(va) + list(vb)))
        elif k == "enum":
            keys = {_key(x) for x in vb}
            out[k] = [x for x in va if _key(x) in keys]
        elif k in ("minimum", "minLength", "minItems", "exclusiveMinimum", "minProperties"):
            out[k] = max(va, vb)
        elif k in ("maximum", "maxLength", "maxItems", "exclusiveMaximum", "maxProperties"):
            out[k] = min(va, vb)
        elif k in ("items", "additionalProperties", "additionalItems", "not_a_keyword"):
            out[k] = {"allOf": [va, vb]} if va is not False and vb is not False else False
        elif k in ("anyOf", "oneOf"):
            cross = [{"allOf": [x, y]} for x in va for y in vb]
            if len(cross) > 256:
                raise MergeError(f"allOf of two {k} lists is too large ({len(cross)} branches)")
            out[k] = cross
        elif k in ("allOf",):
            out[k] = list(va) + list(vb)
        elif k in ("$defs", "definitions"):
            out[k] = {**va, **vb}
        elif k == "const":
            raise Conflict(f"allOf of const {va!r} and const {vb!r}")
        elif k in _VALIDATION:
            raise MergeError(f"cannot merge two different {k!r} values in allOf")
        # any other keyword is an annotation: the first value stays
    return out
