"""Objects and arrays: members in schema order, commas only between present members.

Properties are emitted in the order the schema lists them (what a model should generate);
keys the schema does not list (when `additionalProperties` allows them) may follow the listed
ones, with any key that is not a listed name. Optional members make the comma placement the
only subtle part: `_comma_join` writes "the first present member has no comma, every later one
has one" without enumerating subsets (each member is written at most twice).
"""

from __future__ import annotations

import json
import logging

from ..base import GrammarError
from . import strings as S
from .merge import key_matches
from .negation import Unsatisfiable

log = logging.getLogger(__name__)
REQ, OPT, STAR = "required", "optional", "star"


def _comma_join(A, comma, slots, nonempty: bool = False):
    """slots: [(kind, member)] in order -> node for their comma-separated sequence, or None
    when only the empty sequence fits. `nonempty`: at least one member.

    Left-nested so each member is written at most twice: with Q = the non-empty sequences
    over the slots so far and E = "all of them were optional",
    Q' = Q (,m)? | m      (optional; the `| m` branch only while E holds)
    Q' = Q ,m | m         (required; then E no longer holds)
    Q' = Q (,m)* | m(,m)* (any number of extra members)
    """
    q, empty_ok = None, True
    for kind, m in slots:
        cm = A.seq(comma, m)
        cont = cm if kind == REQ else A.opt(cm) if kind == OPT else A.rep(cm, 0, None)
        fresh = A.seq(m, A.rep(cm, 0, None)) if kind == STAR else m
        if q is None:
            q = fresh
        elif empty_ok:
            q = A.alt(A.seq(q, cont), fresh)
        else:
            q = A.seq(q, cont)
        empty_ok = empty_ok and kind != REQ
    if q is None:
        return None
    return A.opt(q) if empty_ok and not nonempty else q


def _bounded_body(tr, s, path, slots):
    """The members' node under minProperties / maxProperties, where the member layout can
    express them (no bound, min <= 1 or <= the required members, max 0 or 1 or >= the
    members possible); other bounds are reported through `tr.fail`."""
    A = tr.A
    lo, hi = s.get("minProperties", 0), s.get("maxProperties")
    for kw, v in (("minProperties", lo), ("maxProperties", hi)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise GrammarError(f"{path}: {kw} must be a non-negative integer, got {v!r}")
    n_req = sum(kind == REQ for kind, _ in slots)
    n_max = None if any(kind == STAR for kind, _ in slots) else len(slots)
    if n_max is not None and lo > n_max:
        raise GrammarError(f"{path}: minProperties {lo} exceeds the {n_max} allowed members")
    if hi is not None and (hi < n_req or hi < lo):
        raise GrammarError(f"{path}: maxProperties {hi} is below the required members")
    nonempty = lo > n_req
    if nonempty and lo > 1:
        tr.fail("minProperties", path, f"minProperties {lo} with {n_req} required members")
    if hi is None or (n_max is not None and hi >= n_max):
        return _comma_join(A, tr.comma, slots, nonempty)
    if hi == 0:
        return None
    if hi == 1:
        singles = [m for kind, m in slots if kind == REQ] or [m for _, m in slots]
        one = A.alt(*singles)
        return one if nonempty or n_req else A.opt(one)
    tr.fail("maxProperties", path, f"maxProperties {hi} with optional or extra members")
    return _comma_join(A, tr.comma, slots, nonempty)


def object_node(tr, s, path):
    A = tr.A
    props = s.get("properties") or {}
    required = list(s.get("required") or [])
    # an object schema that lists no properties means "any object", whatever the default
    default = tr.o.additional_properties_default or "properties" not in s
    addl = s.get("additionalProperties", default and "patternProperties" not in s)
    names = list(props)
    for r in required:  # required keys without a schema of their own
        if r not in props:
            props = {**props, r: addl if isinstance(addl, dict) else True}
            names.append(r)
    patterns = s.get("patternProperties") or {}
    forbidden = list(s.get("x-loom-forbidden", []))
    slots = []
    keyed, tr.keyed = tr.keyed, True
    try:
        for name in names:
            m = A.seq(A.lit(json.dumps(name, ensure_ascii=False)), tr.colon)
            # a listed key that a pattern also matches must satisfy both schemas
            both = [sub for pat, sub in patterns.items() if key_matches(pat, name)]
            try:
                value = _value_with(tr, props[name], both, f"{path}/properties/{name}")
            except Unsatisfiable:
                if name in required:
                    raise
                continue  # an optional member no value satisfies is simply never present
            slots.append((REQ if name in required else OPT, A.seq(m, value)))
        for pat, sub in patterns.items():
            try:
                key = S.pattern_body(pat)
            except S.PatternError as e:
                raise GrammarError(f"{path}/patternProperties: {e}") from None
            # The key regex cannot leave out the listed (or forbidden) names it matches, so
            # its values must also satisfy theirs: sound, if stricter than the schema.
            also = [props[n] for n in names if key_matches(pat, n)]
            also += [False for n in forbidden if key_matches(pat, n)]
            try:
                value = _value_with(tr, sub, also, f"{path}/patternProperties/{pat}")
            except Unsatisfiable:
                continue
            slots.append((STAR, A.seq(A.leaf(f'"{key}"'), tr.colon, value)))
    finally:
        tr.keyed = keyed
    if addl is not False:
        taken = names + forbidden
        plain = all(n.isprintable() and '"' not in n and "\\" not in n for n in taken)
        key = S.not_in_set(taken) if plain else S.CHAR + "*"
        # likewise, keys a pattern matches are not additional: their values obey it too (and
        # the listed ones', when the key regex cannot leave those names out)
        also = [*patterns.values()]
        if not plain:
            also += [*(props[n] for n in names), *(False for _ in forbidden)]
        try:
            value = _value_with(
                tr, addl if isinstance(addl, dict) else True, also, f"{path}/additionalProperties"
            )
            slots.append((STAR, A.seq(A.leaf(f'"{key}"'), tr.colon, value)))
        except Unsatisfiable:
            pass
    body = _bounded_body(tr, s, path, slots)
    return A.seq(tr.lbrace, body, tr.rbrace) if body is not None else A.seq(tr.lbrace, tr.rbrace)


def _value_with(tr, schema, also: list, path: str):
    """The value node for `schema` that must also satisfy every schema in `also`. Where those
    cannot be merged, a member that is optional anyway is left out (Unsatisfiable): fewer
    documents, never an invalid one."""
    if not also:
        return tr.value(schema, path)
    try:
        return tr.value({"allOf": [schema, *also]}, path)
    except GrammarError as e:
        log.info("json schema %s: member left out: %s", path, e)
        raise Unsatisfiable(f"{path}: {e}") from None


def array_node(tr, s, path):
    A = tr.A
    items = s.get("items")
    if "prefixItems" in s:
        prefix, rest = list(s["prefixItems"]), items if items is not None else True
    elif isinstance(items, list):
        prefix, rest = items, s.get("additionalItems", True)
    else:
        prefix, rest = [], items if items is not None else True
    lo, hi = s.get("minItems", 0), tr.bound(s.get("maxItems"), "maxItems", path)
    if hi is not None and lo > hi:
        raise GrammarError(f"{path}: minItems {lo} > maxItems {hi} (keyword 'minItems')")
    p_nodes = []
    for i, x in enumerate(prefix[:hi]):
        try:
            p_nodes.append(tr.value(x, f"{path}/prefixItems/{i}"))
        except Unsatisfiable:
            if i < lo:
                raise
            break  # no array reaches this position
    try:
        r_node = (
            None
            if rest is False or len(p_nodes) < len(prefix[:hi])
            else tr.value(rest, f"{path}/items")
        )
    except Unsatisfiable:
        r_node = None
    if r_node is None and lo > len(p_nodes):
        raise Unsatisfiable(f"{path}: minItems {lo} needs more items than allowed")

    def tail(i):
        if hi is not None and i >= hi:
            return None
        if i < len(p_nodes):
            item = A.seq(tr.comma, p_nodes[i]) if i else p_nodes[i]
            after = tail(i + 1)
            inner = A.seq(item, after) if after is not None else item
            return inner if i < lo else A.opt(inner)
        if r_node is None:
            return None
        a, b = max(lo - i, 0), None if hi is None else hi - i
        more = A.seq(tr.comma, r_node)
        if i > 0:
            return A.rep(more, a, b)
        x = A.seq(r_node, A.rep(more, max(a - 1, 0), None if b is None else b - 1))
        return x if a > 0 else A.opt(x)

    body = tail(0)
    return A.seq(tr.lbrack, body, tr.rbrack) if body is not None else A.seq(tr.lbrack, tr.rbrack)
