"""The deterministic train/eval split.

A held-out item never appears in training text, but everything it is about does: every
country's capital is taught through the other question templates, every held-out sum uses
operands that appear in other sums, every held-out JSON name is made of seen first/last names.
"""

from __future__ import annotations

from .facts import COUNTRIES, PEOPLE

CAPITAL_TEMPLATES = [
    "What is the capital of {c}?",
    "What's the capital city of {c}?",
    "Which city is the capital of {c}?",
    "Name the capital of {c}.",
    "Tell me the capital of {c}.",
    "{c} has its capital in which city?",
]
CURRENCY_TEMPLATES = [
    "What currency is used in {c}?",
    "What is the currency of {c}?",
    "Which currency do people use in {c}?",
    "What money is used in {c}?",
    "Name the currency of {c}.",
]
AGE_TEMPLATES = [
    "How old is {p}?",
    "What is the age of {p}?",
    "What age is {p}?",
    "Tell me how old {p} is.",
]
CITY_TEMPLATES = [
    "Where does {p} live?",
    "Which city does {p} live in?",
    "In what city does {p} live?",
    "Tell me where {p} lives.",
]


def heldout_template(index: int, n_templates: int) -> int:
    """The one template index held out for the index-th entity."""
    return (index * 5 + 1) % n_templates


def is_heldout_arith(op: str, a: int, b: int) -> bool:
    return (a * 7 + b * 13 + len(op)) % 10 == 3


def is_heldout_name(first_index: int, last_index: int) -> bool:
    """Full names held out of JSON-extraction training (used only in eval inputs)."""
    return (first_index * 3 + last_index) % 10 == 0


def capital_eval() -> list[tuple[str, str]]:
    out = []
    for i, (c, cap, _) in enumerate(COUNTRIES):
        out.append(
            (CAPITAL_TEMPLATES[heldout_template(i, len(CAPITAL_TEMPLATES))].format(c=c), cap)
        )
    return out


def currency_eval() -> list[tuple[str, str]]:
    out = []
    for i, (c, _, cur) in enumerate(COUNTRIES):
        out.append(
            (CURRENCY_TEMPLATES[heldout_template(i, len(CURRENCY_TEMPLATES))].format(c=c), cur)
        )
    return out


def age_eval() -> list[tuple[str, str]]:
    out = []
    for i, (p, age, _, _) in enumerate(PEOPLE):
        out.append((AGE_TEMPLATES[heldout_template(i, len(AGE_TEMPLATES))].format(p=p), str(age)))
    return out


def arith_eval(n: int = 60) -> list[tuple[str, str]]:
    from .arith import ARITH_OPS, render_arith

    out = []
    for op, lo, hi in ARITH_OPS:
        items = [
            (a, b)
            for a in range(lo, hi + 1)
            for b in range(lo, hi + 1)
            if is_heldout_arith(op, a, b)
        ]
        if op == "-":
            items = [(a, b) for a, b in items if a >= b]
        step = max(1, len(items) // (n // len(ARITH_OPS)))
        for a, b in items[::step][: n // len(ARITH_OPS)]:
            q, ans = render_arith(op, a, b, template=0)
            out.append((q, ans))
    return out
