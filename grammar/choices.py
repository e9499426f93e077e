"""A fixed set of strings as a grammar: an escaped alternation (grammar/forms.py compiles it
like any regex)."""

from __future__ import annotations

from .base import GrammarError
from .json_schema.strings import escape


def choices_to_regex(choices: list[str]) -> str:
    if isinstance(choices, str) or not choices:
        raise GrammarError("choices must be a non-empty list of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("every choice must be a non-empty string")
    # longest first keeps the alternation readable; the DFA does not care about order
    alts = sorted(dict.fromkeys(choices), key=lambda c: (-len(c), c))
    return "(?:" + "|".join(escape(c) for c in alts) + ")"
