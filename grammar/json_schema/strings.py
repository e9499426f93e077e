"""JSON string pieces as regexes: characters, lengths, formats, and the schema's `pattern`.

Everything here describes the *serialized* text between the quotes, where `"`, `\\` and control
characters only appear escaped. A schema `pattern` is written for the decoded string, so it is
rewritten: its literals and classes are mapped onto serialized characters (a `"` in the pattern
matches `\\"` in the text), and an unanchored pattern is wrapped in `CHAR*` on the open sides.
"""

from __future__ import annotations

import re._constants as C  # noqa: N812
import re._parser as sre
import warnings

from ..regex_classes import ASCII_CLASSES  # one reading of \d \w \s for every regex

_META = set("\\.^$*+?{}[]|()")
_CLASS_META = set("\\]^-[&~")
CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
_NAMED_ESCAPES = {0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
_MAX = 0x10FFFF


def escape(s: str) -> str:
    """Escape regex metacharacters (only those: Rust, Python and interegular all agree)."""
    out = []
    for ch in s:
        o = ord(ch)
        if ch in _META:
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        else:
            out.append(ch)
    return "".join(out)


def string_body(min_len: int = 0, max_len: int | None = None) -> str:
    if (min_len, max_len) == (0, None):
        return CHAR + "*"
    hi = "" if max_len is None else str(max_len)
    if max_len is not None and min_len == max_len:
        return f"{CHAR}{{{min_len}}}"
    return f"{CHAR}{{{min_len},{hi}}}"


_DATE = (  # days per month; February 29 whatever the year
    r"[0-9]{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-9]))"
)
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[zZ]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?"
_HEX = "[0-9a-fA-F]"
_SCHEME = "[a-zA-Z][a-zA-Z0-9+.-]*"
_UCHAR = r'[^\x00-\x20"\\<>^`{|}]'
# RFC 6570: literals and {op varname[:len|*], ...} expressions ("{" left open is an error)
_VARCHAR = rf"(?:[a-zA-Z0-9_]|%{_HEX}{{2}})"
_VARSPEC = rf"{_VARCHAR}(?:\.?{_VARCHAR})*(?::[1-9][0-9]{{0,3}}|\*)?"
_URI_TEMPLATE = (
    rf"(?:[^\x00-\x20\"'%<>\\^`{{|}}\x7f]|%{_HEX}{{2}}"
    rf"|\{{[+#./;?&=,!@|]?{_VARSPEC}(?:,{_VARSPEC})*\}})*"
)
FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[tT]" + _TIME,  # RFC 3339's grammar: no space instead of T
    "uuid": f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}",
    "email": r"[a-zA-Z0-9!#$%&'*+=?^_`{|}~./-]+@" + f"{_LABEL}(?:\\.{_LABEL})*",
    "ipv4": rf"(?:{_OCTET}\.){{3}}{_OCTET}",
    "hostname": rf"{_LABEL}(?:\.{_LABEL})*",
    "uri": rf"{_SCHEME}:{_UCHAR}*",
    # RFC 3986: a URI, or a relative reference whose first segment has no ":" ("://" is none)
    "uri-reference": rf"(?:{_SCHEME}:{_UCHAR}*|[^\x00-\x20\"\\<>^`{{|}}:/?#]*(?:[/?#]{_UCHAR}*)?)",
    "uri-template": _URI_TEMPLATE,
    "duration": r"P(?:[0-9]+Y)?(?:[0-9]+M)?(?:[0-9]+W)?(?:[0-9]+D)?(?:T(?:[0-9]+H)?(?:[0-9]+M)?(?:[0-9]+(?:\.[0-9]+)?S)?)?",
}
FORMATS["idn-email"] = FORMATS["email"]
FORMATS["idn-hostname"] = FORMATS["hostname"]
FORMATS["iri"] = FORMATS["uri"]
FORMATS["iri-reference"] = FORMATS["uri-reference"]


class PatternError(ValueError):
    pass


def pattern_body(pattern: str) -> str:
    """Rewrite an ECMA-style `pattern` into a regex over the serialized string body."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # Python's notes on future syntax
            tree = sre.parse(pattern)
    except Exception as e:
        raise PatternError(f"cannot parse pattern {pattern!r}: {e}") from None
    if tree.state.flags & (C.SRE_FLAG_IGNORECASE | C.SRE_FLAG_MULTILINE | C.SRE_FLAG_DOTALL):
        raise PatternError("inline regex flags are not supported")
    return _search_body(list(tree))


def _search_body(items) -> str:
    """What `re.search(items, s)` accepts, as a full-match regex over the string body. A
    top-level alternation anchored on only some sides (`^dev|beta|stable$`) is taken one
    alternative at a time."""
    try:
        start = _anchored(items, first=True)
        end = _anchored(items, first=False)
    except PatternError:
        while (inner := _group_body(items)) is not None:
            items = inner
        if len(items) != 1 or items[0][0] is not C.BRANCH:
            raise
        return "(?:" + "|".join(_search_body(list(b)) for b in items[0][1][1]) + ")"
    body = _emit(items)
    return ("" if start else CHAR + "*") + f"(?:{body})" + ("" if end else CHAR + "*")


def pattern_with_length(pattern: str, lo: int, hi: int | None) -> str | None:
    """Body for `pattern` AND lo <= length <= hi, when the pattern is anchored and either has
    one variable part, a repeat of single characters (`^[a-z][a-z0-9-]*$`), whose bounds absorb
    the lengths, or the lengths only rule out the empty string (`^$|^[a-z]+$` with minLength
    1). None otherwise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        items = list(sre.parse(pattern))
    if not (_anchored(items, True) and _anchored(items, False)):
        return None
    items = [it for it in items if it[0] is not C.AT]
    while (inner := _group_body(items)) is not None:  # (^...$) as a whole
        items = [it for it in inner if it[0] is not C.AT]
    wlo, whi = _width(items)
    if lo == 1 and wlo == 0 and (hi is None or whi <= hi):
        body = _nonempty(items)
        if body is None:
            raise PatternError("pattern and minLength admit no string")
        return body
    fixed, var = 0, None
    for i, (op, av) in enumerate(items):
        w = _width([(op, av)])
        if w[0] == w[1]:
            fixed += w[0]
        elif op is C.MAX_REPEAT and var is None and av[2].getwidth() == (1, 1):
            var = i
        else:
            return None
    if var is None:
        return None
    rlo, rhi, sub = items[var][1]
    rhi = None if rhi is C.MAXREPEAT else rhi
    new_lo = max(rlo, lo - fixed)
    new_hi = rhi if hi is None else (hi - fixed if rhi is None else min(rhi, hi - fixed))
    if new_hi is not None and new_hi < new_lo:
        raise PatternError("pattern and minLength/maxLength admit no string")
    items[var] = (C.MAX_REPEAT, (new_lo, C.MAXREPEAT if new_hi is None else new_hi, sub))
    return f"(?:{_emit(items)})"


def _group_body(items) -> list | None:
    """The items inside `items` when it is exactly one group without flags, else None."""
    if len(items) == 1 and items[0][0] is C.SUBPATTERN and not (items[0][1][1] or items[0][1][2]):
        return list(items[0][1][3])
    return None


def _width(items) -> tuple[int, int]:
    return sre.SubPattern(sre.State(), list(items)).getwidth()


def _nonempty(items) -> str | None:
    """Regex for the non-empty strings of the sequence `items` (None: it only matches "").
    The first item matches something, or it matches nothing and the rest is non-empty."""
    if not items:
        return None
    (op, av), rest = items[0], items[1:]
    alts = []
    first = _nonempty_item(op, av)
    if first is not None:
        alts.append(first + _emit(rest))
    if _width([(op, av)])[0] == 0:
        tail = _nonempty(rest)
        if tail is not None:
            alts.append(tail)
    return None if not alts else alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def _nonempty_item(op, av) -> str | None:
    if op is C.AT:
        return None
    if op is C.BRANCH:
        alts = [a for a in (_nonempty(list(b)) for b in av[1]) if a is not None]
        return "(?:" + "|".join(alts) + ")" if alts else None
    if op is C.SUBPATTERN:
        if av[1] or av[2]:
            raise PatternError("inline regex flags are not supported")
        return _nonempty(list(av[3]))
    if op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
        lo, hi, sub = av
        once = _nonempty(list(sub))
        if once is None or hi == 0:
            return None
        hi_s = "" if hi is C.MAXREPEAT else str(hi)
        if _width(sub)[0] == 0:  # empty rounds can be dropped: X{m,n} is (X non-empty){0,n}
            return f"(?:{once}){{1,{hi_s}}}"
        return "(?:" + _emit(list(sub)) + f"){{{max(lo, 1)},{hi_s}}}"
    return _emit([(op, av)])  # a single character (or an unsupported construct: raises)


def pattern_width(pattern: str) -> tuple[int, int | None]:
    """(min, max) decoded length of strings a `pattern` accepts (max None = unbounded)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        tree = sre.parse(pattern)
    items = list(tree)
    lo, hi = tree.getwidth()
    if not (_anchored(items, True) and _anchored(items, False)):
        hi = None
    return lo, (None if hi is None or hi >= C.MAXREPEAT else hi)


def regex_width(regex: str) -> tuple[int, int | None]:
    """(min, max) length of a fully matched escape-free regex such as a format's."""
    return pattern_width("^(?:" + regex + ")$")


def _anchored(items, first: bool) -> bool:
    if not items:
        return False
    op, av = items[0] if first else items[-1]
    if op is C.AT:
        return av in (
            (C.AT_BEGINNING, C.AT_BEGINNING_STRING) if first else (C.AT_END, C.AT_END_STRING)
        )
    if op is C.SUBPATTERN:
        return _anchored(list(av[3]), first)
    if op is C.BRANCH:
        flags = {_anchored(list(b), first) for b in av[1]}
        if len(flags) > 1:
            raise PatternError("anchors on only some alternatives are not supported")
        return flags.pop()
    return False


def _emit(items) -> str:
    out = []
    for op, av in items:
        if op is C.LITERAL:
            out.append(_char_alts([(av, av)]))
        elif op is C.NOT_LITERAL:
            out.append(_char_alts(_complement([(av, av)])))
        elif op is C.ANY:
            out.append(_char_alts(_complement([(0x0A, 0x0A)])))
        elif op is C.IN:
            out.append(_char_alts(_class_ranges(av)))
        elif op is C.BRANCH:
            out.append("(?:" + "|".join(_emit(list(b)) for b in av[1]) + ")")
        elif op is C.SUBPATTERN:
            if av[1] or av[2]:
                raise PatternError("inline regex flags are not supported")
            out.append("(?:" + _emit(list(av[3])) + ")")
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
            lo, hi, sub = av
            hi_s = "" if hi is C.MAXREPEAT else str(hi)
            quant = f"{{{lo},{hi_s}}}" if hi_s != str(lo) else f"{{{lo}}}"
            out.append("(?:" + _emit(list(sub)) + ")" + quant)
        elif op is C.AT:
            if av not in (C.AT_BEGINNING, C.AT_BEGINNING_STRING, C.AT_END, C.AT_END_STRING):
                raise PatternError(f"regex assertion {av} is not supported")
        elif op is C.CATEGORY:
            out.append(_char_alts(_category(av)))
        else:
            raise PatternError(f"regex construct {op} (lookaround/backreference) is not supported")
    return "".join(out)


def _category(cat) -> list[tuple[int, int]]:
    digit, word, space = ASCII_CLASSES["d"], ASCII_CLASSES["w"], ASCII_CLASSES["s"]
    table = {
        C.CATEGORY_DIGIT: digit,
        C.CATEGORY_WORD: word,
        C.CATEGORY_SPACE: space,
        C.CATEGORY_NOT_DIGIT: _complement(digit),
        C.CATEGORY_NOT_WORD: _complement(word),
        C.CATEGORY_NOT_SPACE: _complement(space),
    }
    if cat not in table:
        raise PatternError(f"regex category {cat} is not supported")
    return table[cat]


def _class_ranges(items) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    negate = False
    for op, av in items:
        if op is C.NEGATE:
            negate = True
        elif op is C.LITERAL:
            ranges.append((av, av))
        elif op is C.RANGE:
            ranges.append(av)
        elif op is C.CATEGORY:
            ranges += _category(av)
        else:
            raise PatternError(f"character class item {op} is not supported")
    return _complement(ranges) if negate else _normalize(ranges)


def _normalize(ranges):
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(r) for r in out]


def _complement(ranges):
    out, prev = [], 0
    for lo, hi in _normalize(ranges):
        if lo > prev:
            out.append((prev, lo - 1))
        prev = hi + 1
    if prev <= _MAX:
        out.append((prev, _MAX))
    return out


def _subtract(ranges, lo_x, hi_x):
    out = []
    for lo, hi in ranges:
        if hi < lo_x or lo > hi_x:
            out.append((lo, hi))
            continue
        if lo < lo_x:
            out.append((lo, lo_x - 1))
        if hi > hi_x:
            out.append((hi_x + 1, hi))
    return out


def _class_char(o: int) -> str:
    if o < 0x20 or o == 0x7F:
        return f"\\x{o:02x}"
    ch = chr(o)
    return "\\" + ch if ch in _CLASS_META else ch


def _char_alts(ranges) -> str:
    """Decoded characters in `ranges` -> regex of their serialized forms."""
    raw = ranges
    for lo, hi in ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF)):
        raw = _subtract(raw, lo, hi)
    alts = []
    if raw:
        if len(raw) == 1 and raw[0][0] == raw[0][1]:
            alts.append(escape(chr(raw[0][0])))
        else:
            body = "".join(
                _class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                for lo, hi in raw
            )
            alts.append(f"[{body}]")
    inside = lambda o: any(lo <= o <= hi for lo, hi in ranges)  # noqa: E731
    if inside(0x22):
        alts.append(r"\\\"")
    if inside(0x5C):
        alts.append(r"\\\\")
    for o in range(0x20):
        if inside(o):
            alts.append("\\\\" + _NAMED_ESCAPES.get(o, f"u00{o:02x}"))
    if not alts:
        raise PatternError("empty character class")
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def not_in_set(keys: list[str]) -> str:
    """Serialized string bodies that differ from each of `keys` (all plain, escape-free)."""
    trie: dict = {}
    for k in keys:
        node = trie
        for ch in k:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node) -> str:
        kids = [c for c in node if c]
        alts = []
        other = "".join(_class_char(ord(c)) for c in kids)
        first = f'[^{other}"\\\\\\x00-\\x1f]' if other else '[^"\\\\\\x00-\\x1f]'
        alts.append(f'(?:{first}|\\\\["\\\\/bfnrt]|\\\\u[0-9a-fA-F]{{4}}){CHAR}*')
        alts += [escape(c) + build(node[c]) for c in kids]
        return "(?:" + "|".join(alts) + (")" if "" in node else ")?")

    return build(trie)
