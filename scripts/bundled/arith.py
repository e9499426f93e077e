"""Arithmetic questions: small sums, differences and products answered with the number."""

from __future__ import annotations

import random

ARITH_OPS = [("+", 0, 60), ("-", 0, 60), ("*", 0, 12)]
_TEMPLATES = [
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "Calculate {a} {op} {b}.",
    "{a} {op} {b} = ?",
]


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def render_arith(op: str, a: int, b: int, template: int) -> tuple[str, str]:
    return _TEMPLATES[template].format(a=a, op=op, b=b), str(_apply(op, a, b))


def sample_arith(rng: random.Random) -> tuple[str, int, int]:
    """A training triple (op, a, b) that is not held out."""
    from .heldout import is_heldout_arith

    while True:
        op, lo, hi = rng.choice(ARITH_OPS)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if op == "-" and a < b:
            a, b = b, a
        if not is_heldout_arith(op, a, b):
            return op, a, b


def arith_messages(rng: random.Random) -> list[dict]:
    op, a, b = sample_arith(rng)
    q, ans = render_arith(op, a, b, rng.randrange(len(_TEMPLATES)))
    if rng.random() < 0.3:
        ans = f"{a} {op} {b} = {ans}"
    return [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
