"""`\\d`, `\\w` and `\\s` in a user's regex mean their ASCII classes, whatever engine runs it.

The engines read a pattern with Rust-like syntax, where these are Unicode classes of the
engine's own Unicode version (llguidance, outlines-core) or a mix (xgrammar: ASCII `\\d` and
`\\w`, Unicode `\\s`). With `[A-Z]{3}-\\d{2}` a sampled model wrote "III-\\U0001e4f5۱" (Nag
Mundari and Extended Arabic-Indic digits), which Python 3.11's `re` does not even take for
`\\d`. Structured output wants the ASCII reading, which loom's JSON-schema `pattern`
translation already gives:
  \\d = [0-9]   \\w = [0-9A-Za-z_]   \\s = [\\t\\n\\v\\f\\r ]   (\\D, \\W, \\S: their complements)
A pattern that wants Unicode says so: `\\p{Nd}`, `\\p{L}` pass unchanged (for the engines that
know them).

The rewrite is lexical: an escape pair is read as one unit (so `\\\\d` stays a backslash and a
"d"). Inside a bracket class a positive class becomes its ranges and a negated one its
complement's ranges, written `\\u{X}-\\u{Y}` with the UTF-16 surrogates left out (xgrammar
would emit their non-UTF-8 encodings; none of the engines nests classes the same way).
"""

from __future__ import annotations

ASCII_CLASSES = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x09, 0x0D), (0x20, 0x20)],
}
_SURROGATES = (0xD800, 0xDFFF)
_MAX = 0x10FFFF


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, lo = [], 0
    for a, b in sorted(ranges + [_SURROGATES]):
        if a > lo:
            out.append((lo, a - 1))
        lo = max(lo, b + 1)
    if lo <= _MAX:
        out.append((lo, _MAX))
    return out


def _spell(ranges: list[tuple[int, int]]) -> str:
    return "".join(f"\\u{{{a:X}}}" if a == b else f"\\u{{{a:X}}}-\\u{{{b:X}}}" for a, b in ranges)


_INSIDE = {k: _spell(v) for k, v in ASCII_CLASSES.items()}
_INSIDE.update({k.upper(): _spell(_complement(v)) for k, v in ASCII_CLASSES.items()})
_OUTSIDE = {k: f"[{_INSIDE[k]}]" for k in ASCII_CLASSES}
_OUTSIDE.update({k.upper(): f"[^{_INSIDE[k]}]" for k in ASCII_CLASSES})


def ascii_classes(pattern: str) -> str:
    out: list[str] = []
    depth = 0  # bracket-class nesting
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e in _OUTSIDE:
                out.append(_INSIDE[e] if depth else _OUTSIDE[e])
            else:
                out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[":
            if depth and pattern.startswith("[:", i):  # a POSIX class [:alpha:] is one unit
                end = pattern.find(":]", i + 2)
                if end != -1:
                    out.append(pattern[i : end + 2])
                    i = end + 2
                    continue
            depth += 1
            out.append(c)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a "]" first in a class is a literal
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)
