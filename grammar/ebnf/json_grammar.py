"""A Lark grammar for any JSON value, for `json_object` and recursive JSON-schema parts."""

from __future__ import annotations

_START = "start: value\n"
_JSON_LARK = r"""
?value: object | array | STRING | NUMBER | "true" | "false" | "null"
object: "{" WS? "}" | "{" WS? member (WS? "," WS? member)* WS? "}"
member: STRING WS? ":" WS? value
array: "[" WS? "]" | "[" WS? value (WS? "," WS? value)* WS? "]"
STRING: /"(?:[^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/
NUMBER: /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/
WS: /[ \t\n]{1,%d}/
"""


def json_lark_grammar(max_whitespace: int = 16, with_start: bool = True) -> str:
    """Lark text for a JSON value (RFC 8259 strings and numbers).

    Whitespace is allowed only between tokens and at most `max_whitespace` characters at a
    time, so a model cannot loop on blanks forever. The grammar's rules (`value`, `object`,
    `member`, `array`) and terminals (`STRING`, `NUMBER`, `WS`) may be reused by name;
    `with_start=False` leaves out `start: value`, to append them to another grammar.
    """
    if max_whitespace < 1:
        raise ValueError("max_whitespace must be >= 1")
    return (_START if with_start else "") + _JSON_LARK % max_whitespace
