"""GBNF (llama.cpp / SGLang `ebnf`) -> an equivalent Lark grammar.

GBNF is a character-level CFG: no lexer, every literal and character class matches text
directly. The translation keeps that meaning exactly: each distinct string literal and each
character class becomes one `%declare`d terminal (its regex returned on the side, since Lark's
own terminal syntax is not needed), rules become Lark rules (`r_<name>`, `root` -> `start`),
and repetition becomes Lark's `*` `+` `?` (bounded `{m,n}` unrolled as nested optionals, which
LR parsers like). Overlapping terminals (`"a"` vs `[a-z]`) are fine: the engine lexes every way
at once, and since these terminals have fixed length, per-terminal maximal munch is exact.

Supported: `name ::= ...` rules (names may contain `-`), `|`, grouping, `*` `+` `?` `{m}`
`{m,}` `{m,n}`, string literals and `[...]` / `[^...]` classes with ranges and the escapes
`\\n \\r \\t \\\\ \\" \\[ \\] \\xHH \\uHHHH \\UHHHHHHHH`, `.` (any character), `#` comments.
"""

from __future__ import annotations

import re

from ..base import GrammarError

_TOKEN = re.compile(
    r"""(?P<ws>[ \t\r]+)|(?P<nl>\n)|(?P<comment>\#[^\n]*)
    |(?P<define>::=)|(?P<name>[A-Za-z_][A-Za-z0-9_-]*)
    |(?P<string>"(?:[^"\\\n]|\\.)*")|(?P<cls>\[(?:[^\]\\\n]|\\.)*\])
    |(?P<rep>\{\s*\d*\s*(?:,\s*\d*\s*)?\})|(?P<op>[()|*+?.])""",
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "[": "[", "]": "]"}
_MAX_UNROLL = 1000
ANY_CHAR = r"(?:[^\n]|\n)"


def _regex_char(ch: str) -> str:
    """One character, escaped so it is literal both in and out of a regex class."""
    if ch.isascii() and ch.isalnum():
        return ch
    code = ord(ch)
    if code < 0x20 or code == 0x7F:
        return f"\\x{code:02x}"
    if code < 0x80:
        return "\\" + ch
    return ch  # interegular has no \u escapes; non-ASCII characters are never special


class _Parser:
    def __init__(self, text: str):
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, line)
        line, pos = 1, 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                what = {'"': "unterminated string literal", "[": "unterminated character class"}
                problem = what.get(text[pos], f"unexpected character {text[pos]!r}")
                raise GrammarError(f"GBNF line {line}: {problem}")
            kind = m.lastgroup
            if kind == "nl":
                line += 1
            elif kind not in ("ws", "comment"):
                self.tokens.append((kind, m.group(), line))
            pos = m.end()
        self.pos = 0
        self.rule = "?"
        self.literals: dict[str, str] = {}  # regex -> terminal name
        self.helpers: dict[str, str] = {}  # expression -> helper rule name

    def peek(self, ahead: int = 0):
        i = self.pos + ahead
        return self.tokens[i] if i < len(self.tokens) else None

    def error(self, message: str, line: int | None = None):
        if line is None:
            tok = self.peek() or (self.tokens[-1] if self.tokens else ("", "", 1))
            line = tok[2]
        raise GrammarError(f"GBNF line {line} (rule '{self.rule}'): {message}")

    def decode_char(self, body: str, i: int, line: int) -> tuple[str, int]:
        """The character at body[i] (escapes decoded) and the index after it."""
        ch = body[i]
        if ch != "\\":
            return ch, i + 1
        if i + 1 >= len(body):
            self.error("dangling backslash", line)
        esc = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(esc)
        if width is None:
            return _ESCAPES.get(esc, esc), i + 2
        digits = body[i + 2 : i + 2 + width]
        if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
            self.error(f"bad escape \\{esc}{digits}", line)
        code = int(digits, 16)
        if code > 0x10FFFF:
            self.error(f"escape \\{esc}{digits} is past U+10FFFF", line)
        return chr(code), i + 2 + width

    def terminal(self, regex: str) -> str:
        name = self.literals.get(regex)
        if name is None:
            name = self.literals[regex] = f"T{len(self.literals)}"
        return name

    def parse_rules(self) -> list[tuple[str, str, int]]:
        rules = []
        while self.peek() is not None:
            kind, text, line = self.peek()
            nxt = self.peek(1)
            if kind != "name" or nxt is None or nxt[0] != "define":
                self.error(f"expected 'name ::=' to start a rule, got {text!r}", line)
            self.rule = text
            self.pos += 2
            body = self.parse_alternatives(nested=False)
            rules.append((text, body, line))
        return rules

    def parse_alternatives(self, nested: bool) -> str:
        seqs = [self.parse_sequence()]
        while self.peek() is not None and self.peek()[1] == "|":
            self.pos += 1
            seqs.append(self.parse_sequence())
        tok = self.peek()
        if not nested and tok is not None and tok[1] == ")":
            self.error("unbalanced ')'")
        full = [s for s in seqs if s]
        if not full:
            return ""
        body = " | ".join(full)
        if len(full) < len(seqs):  # an empty alternative
            return f"({body})?"
        return body if not nested or len(full) == 1 else f"({body})"

    def parse_sequence(self) -> str:
        items = []
        while True:
            tok = self.peek()
            if tok is None or tok[1] in ("|", ")"):
                break
            nxt = self.peek(1)
            if tok[0] == "name" and nxt is not None and nxt[0] == "define":
                break
            item = self.parse_postfix(self.parse_primary())
            if item:
                items.append(item)
        return " ".join(items)

    def parse_primary(self) -> str:
        kind, text, line = self.peek()
        self.pos += 1
        if kind == "name":
            return "\0" + text + "\0"  # a rule reference, resolved once all names are known
        if kind == "string":
            body, chars, i = text[1:-1], [], 0
            while i < len(body):
                ch, i = self.decode_char(body, i, line)
                chars.append(_regex_char(ch))
            return self.terminal("".join(chars)) if chars else ""
        if kind == "cls":
            return self.terminal(self.char_class(text, line))
        if text == ".":
            return self.terminal(ANY_CHAR)
        if text == "(":
            inner = self.parse_alternatives(nested=True)
            tok = self.peek()
            if tok is None or tok[1] != ")":
                self.error("missing ')'", line)
            self.pos += 1
            return f"({inner})" if inner else ""
        self.error(f"unexpected {text!r}", line)

    def char_class(self, text: str, line: int) -> str:
        body, negate = text[1:-1], False
        if body.startswith("^"):
            body, negate = body[1:], True
        parts, i = [], 0
        while i < len(body):
            lo, i = self.decode_char(body, i, line)
            if i + 1 < len(body) and body[i] == "-":
                hi, i = self.decode_char(body, i + 1, line)
                if ord(hi) < ord(lo):
                    self.error(f"bad range {lo!r}-{hi!r} in {text}", line)
                parts.append(f"{_regex_char(lo)}-{_regex_char(hi)}")
            else:
                parts.append(_regex_char(lo))
        if not parts:
            if negate:
                return ANY_CHAR
            self.error(f"empty character class {text}", line)
        return f"[{'^' if negate else ''}{''.join(parts)}]"

    def hoist(self, expr: str) -> str:
        """A helper rule for `expr` (deduplicated). Lark expands `?` and alternatives inside
        a rule by cross product, so nesting stays linear only when groups get rules."""
        name = self.helpers.get(expr)
        if name is None:
            name = self.helpers[expr] = f"g_{len(self.helpers)}"
        return name

    def parse_postfix(self, item: str) -> str:
        while self.peek() is not None and (self.peek()[1] in "*+?" or self.peek()[0] == "rep"):
            kind, text, line = self.peek()
            self.pos += 1
            if not item:
                continue  # repeating the empty string is the empty string
            if kind != "rep":
                if " " in item.strip("()"):
                    item = self.hoist(item)
                item = f"({item}){text}"
                continue
            nums = text[1:-1].split(",")
            low = int(nums[0]) if nums[0].strip() else 0
            high = low if len(nums) == 1 else (int(nums[1]) if nums[1].strip() else None)
            if (high is not None and high < low) or max(low, high or 0) > _MAX_UNROLL:
                self.error(f"bad repetition {text}", line)
            unit = self.hoist(item) if " " in item.strip("()") else f"({item})"
            parts = [unit] * low
            if high is None:
                parts.append(f"{unit}*")
            elif high > low:
                # up to k more: g_k: unit g_(k-1) | <empty>, a right-nested chain of rules
                tail = ""
                for _ in range(high - low):
                    tail = self.hoist(f"{unit} {tail} |" if tail else f"{unit} |")
                parts.append(tail)
            item = " ".join(parts)
            item = f"({item})" if item else ""
        return item


def _rule_names(names: list[str]) -> dict[str, str]:
    out, taken = {}, set()
    for name in names:
        base = "start" if name == "root" else "r_" + re.sub(r"[^a-z0-9_]", "_", name.lower())
        cand, n = base, 1
        while cand in taken:
            cand, n = f"{base}_{n}", n + 1
        taken.add(cand)
        out[name] = cand
    return out


def gbnf_to_lark(text: str) -> tuple[str, dict[str, str]]:
    """-> (Lark grammar text, {declared terminal name: regex})."""
    parser = _Parser(text)
    rules = parser.parse_rules()
    seen: dict[str, int] = {}
    for name, _, line in rules:
        if name in seen:
            raise GrammarError(f"GBNF line {line}: rule '{name}' defined twice")
        seen[name] = line
    if "root" not in seen:
        raise GrammarError("GBNF grammar has no 'root' rule")
    names = _rule_names([name for name, _, _ in rules])
    lines = []
    for name, body, line in rules:
        parts = body.split("\0")
        for i in range(1, len(parts), 2):
            ref = parts[i]
            if ref not in names:
                raise GrammarError(f"GBNF line {line}: rule '{name}' uses undefined rule '{ref}'")
            parts[i] = names[ref]
        lines.append(f"{names[name]}: {''.join(parts)}")
    for expr, helper in parser.helpers.items():
        parts = expr.split("\0")
        for i in range(1, len(parts), 2):
            parts[i] = names[parts[i]]  # every name was checked in its rule above
        lines.append(f"{helper}: {''.join(parts)}")
    terminals = {name: regex for regex, name in parser.literals.items()}
    if terminals:
        lines.append("%declare " + " ".join(terminals))
    return "\n".join(lines) + "\n", terminals
