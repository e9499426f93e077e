"""Two ways to write down the same JSON-schema structure: a regex, or a Lark grammar.

The translator builds its output from a handful of combinators (literal, regex leaf, sequence,
alternation, optional, repetition, rule reference). `RegexAlgebra` renders them as one regular
expression (the common case). `LarkAlgebra` renders them as Lark rules, for schemas with
recursive `$ref`s, which no regular expression can describe; maximal reference-free parts
collapse into single regex terminals, so the CFG engine lexes JSON strings and numbers whole.
"""

from __future__ import annotations

from .strings import escape


def group(r: str) -> str:
    return f"(?:{r})"


class TooLarge(Exception):
    pass


class RegexAlgebra:
    """Nodes are regex strings. `max_chars` bounds every intermediate regex (a regex cannot
    share a subexpression, so nested arrays and optional members multiply its size)."""

    def __init__(self, max_chars: int = 1 << 20):
        self.max_chars = max_chars

    def _check(self, r: str) -> str:
        if len(r) > self.max_chars:
            raise TooLarge(len(r))
        return r

    def lit(self, s: str) -> str:
        return escape(s)

    def leaf(self, r: str) -> str:
        return r

    def seq(self, *parts: str) -> str:
        return self._check("".join(group(p) if "|" in p else p for p in parts if p))

    def alt(self, *parts: str) -> str:
        uniq = list(dict.fromkeys(parts))
        return uniq[0] if len(uniq) == 1 else self._check(group("|".join(uniq)))

    def opt(self, x: str) -> str:
        return f"{group(x)}?" if x else ""

    def rep(self, x: str, lo: int, hi: int | None) -> str:
        if hi is not None and hi == 0:
            return ""
        if (lo, hi) == (0, None):
            return f"{group(x)}*"
        if (lo, hi) == (1, None):
            return f"{group(x)}+"
        if lo == hi:
            return group(x) if lo == 1 else f"{group(x)}{{{lo}}}"
        return f"{group(x)}{{{lo},{'' if hi is None else hi}}}"

    def ref(self, name: str) -> str:  # pragma: no cover - regex mode inlines every ref
        raise AssertionError("RegexAlgebra cannot reference rules")


def _unwrap(term: str) -> str:
    """`(x y)` -> `x y` when the parentheses enclose the whole term."""
    if not (term.startswith("(") and term.endswith(")")):
        return term
    depth = 0
    for i, c in enumerate(term):
        depth += c == "("
        depth -= c == ")"
        if depth == 0 and i < len(term) - 1:
            return term
    return term[1:-1]


class LarkAlgebra:
    """Nodes are (is_pure_regex, text): a pure node is a regex, the rest are Lark expressions.

    `fuse`: adjacent pure parts of a sequence become one terminal (what loom's LALR(1) engine
    needs). A lexer that matches terminals greedily without backtracking (llguidance) wants
    them apart: fused, `,[ ]?"role":...` beside a bare `,[ ]?` runs past the separator and
    rejects the next key; apart, separators, keys and values are each their own lexeme (on a
    MaskBench sample: 27 valid documents refused fused, 3 apart, the same 3 as one regex)."""

    HOIST = 200  # structural expressions longer than this become (deduplicated) rules

    def __init__(self, fuse: bool = True):
        self.fuse = fuse
        self.rules: dict[str, object] = {}
        self._hoisted: dict[str, str] = {}

    def lit(self, s: str):
        return (True, escape(s))

    def leaf(self, r: str):
        return (True, r)

    def term(self, node) -> str:
        pure, text = node
        if not pure:
            if len(text) <= self.HOIST:
                return f"({text})"
            name = self._hoisted.get(text)
            if name is None:
                name = self._hoisted[text] = f"h{len(self._hoisted)}"
            return name
        return "/" + text.replace("/", "\\/") + "/"

    def seq(self, *parts):
        # adjacent pure parts fuse into one terminal (", " and the next key lex as one token,
        # which keeps optional members LALR(1))
        runs: list = []
        for p in parts:
            if not p[1]:
                continue
            if self.fuse and p[0] and runs and runs[-1][0]:
                runs[-1] = (True, runs[-1][1] + group(p[1]))
            else:
                runs.append((p[0], group(p[1]) if p[0] else p[1]))
        if len(runs) == 1:
            return runs[0]
        return (False, " ".join(self.term(p) for p in runs))

    def alt(self, *parts):
        uniq = list(dict.fromkeys(parts))
        if len(uniq) == 1:
            return uniq[0]
        if all(p[0] for p in uniq):
            return (True, group("|".join(p[1] for p in uniq)))
        # distinct nodes can render alike ("(a b)" and "a b"); Lark rejects a rule that lists
        # the same expansion twice
        terms = dict.fromkeys(_unwrap(self.term(p)) for p in uniq)
        return (False, " | ".join(terms))

    def opt(self, x):
        return (False, f"[{self.term(x)}]") if x[1] else x

    def rep(self, x, lo: int, hi: int | None):
        if hi is not None and hi == 0:
            return (True, "")
        t = self.term(x)
        if hi is None:
            head = " ".join([t] * lo)
            return (False, f"{head} {t}*".strip())
        if lo == hi == 1:
            return x
        if lo == 0:
            return (False, f"[{t} ~ 1..{hi}]")
        return (False, f"{t} ~ {lo}..{hi}")

    def ref(self, name: str):
        return (False, name)

    def grammar(self, start) -> str:
        lines = [f"start: {self.term(start)}"]
        lines += [f"{name}: {self.term(body)}" for name, body in self.rules.items()]
        lines += [f"{name}: {text}" for text, name in self._hoisted.items()]
        return "\n".join(lines) + "\n"
