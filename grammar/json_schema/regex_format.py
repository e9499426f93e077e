"""`format: "regex"` as a regex over the serialized string body: text that is a valid regex.

Validators check this format by compiling the string (Python's `jsonschema` calls
`re.compile`), so "*" (nothing to repeat), "a(b" or a trailing "\\" are invalid. Regexes nest
parentheses, which no regular language counts exactly; this is a sound approximation: every
string it admits compiles under Python's `re` (and reads the same under ECMA-262), and it
admits groups nested up to `DEPTH` levels, the common escapes, classes whose ranges have
alphanumeric ends in order, and quantifiers whose bounds are provably ordered. It refuses some
valid regexes (backreferences, named groups, lookbehind, `{` as a literal, deeper nesting)
rather than admit an invalid one.
"""

from __future__ import annotations

from .strings import _class_char

DEPTH = 3
_HEX = "[0-9a-fA-F]"
# a non-ASCII character as json.dumps writes it by default (`\uXXXX`, surrogate pairs too)
_U_NON_ASCII = (
    r"\\u(?:00[89a-fA-F][0-9a-fA-F]|0[1-9a-fA-F][0-9a-fA-F]{2}|[1-9a-fA-F][0-9a-fA-F]{3})"
)


def _any_but(chars: str) -> str:
    """One decoded character outside `chars` (printable ASCII), in its serialized forms."""
    plain = "".join(_class_char(ord(c)) for c in chars)
    alts = [f'[^"\\\\\\x00-\\x1f{plain}]', r"\\[bfnrt/]", r"\\u00[01][0-9a-fA-F]", _U_NON_ASCII]
    alts += [r"\\\"" * ('"' not in chars), r"\\\\" * ("\\" not in chars)]
    return "(?:" + "|".join(a for a in alts if a) + ")"


_BS = r"\\\\"
_ALNUM = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_ESC_TAIL = rf"{_any_but(_ALNUM)}|x{_HEX}{{2}}|u{_HEX}{{4}}|0[0-7]{{0,2}}"
ESCAPE = rf"{_BS}(?:{_ESC_TAIL}|[dDsSwWfnrtv])"  # a character or a class: can repeat
ASSERTION = rf"{_BS}[bBAZ]|\^|\$"  # a position: nothing to repeat
LITERAL = _any_but("\\^$.|?*+()[{")


def _ordered_ranges() -> str:
    """`x-y` with alphanumeric ends, x <= y (a range out of order is an error)."""
    alts = []
    for block in ("0123456789", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz"):
        for i, c in enumerate(block):
            alts.append(f"{c}-[{block[i]}-{block[-1]}]")
    return "(?:" + "|".join(alts) + "|[0-9]-[A-Za-z]|[A-Z]-[a-z])"


def _class() -> str:
    esc = rf"{_BS}(?:{_ESC_TAIL}|[dDsSwWbfnrtv])"
    item = f"(?:{_ordered_ranges()}|{_any_but(chr(92) + ']-')}|{esc})"
    first = f"(?:{_ordered_ranges()}|{_any_but(chr(92) + ']-^')}|{esc})"
    # `]` or `-` first is a literal; `^` first negates, so a first item is not `^`
    return rf"\[\^?(?:\]|-|{first}){item}*-?\]"


def _ordered_pair() -> str:
    """`n,m` with n <= m provable digit by digit: fewer digits than m (m without a leading
    zero), one digit each, or two digits with a smaller first digit."""
    alts = [f"[0-9]{{1,{j - 1}}},[1-9][0-9]{{{j - 1}}}" for j in range(2, 10)]
    alts += [f"{d},[{d}-9]" for d in range(10)]
    alts += [f"{d}[0-9],[{d + 1}-9][0-9]" for d in range(1, 9)]
    return "(?:" + "|".join(alts) + ")"


QUANTIFIER = rf"(?:[*+?]|\{{(?:[0-9]{{1,9}},?|,[0-9]{{1,9}}|{_ordered_pair()})\}})\??"


def regex_format_body() -> str:
    """The serialized body of a string that compiles as a regex (see the module's note)."""
    cls = _class()
    alt = None
    for _ in range(DEPTH + 1):
        atom = f"{LITERAL}|{ESCAPE}|\\.|{cls}"
        if alt is not None:  # a group, or a lookahead (Python and ECMA-262 both repeat one)
            atom += rf"|\((?:\?[:=!])?{alt}\)"
        term = f"(?:(?:{atom})(?:{QUANTIFIER})?|{ASSERTION})"
        alt = f"(?:{term}|\\|)*"  # terms and bars in any order: term*(\|term*)*
    return rf"(?:\(\?[ims]+\))?{alt}"
