"""Terminal automata: interegular's character DFA, stepped one UTF-8 byte at a time.

Tokens are byte strings and may end inside a multi-byte character, so each terminal's
character-level DFA (built by interegular) is driven at byte level. A byte state is either a
character state `s` (an int: nothing pending) or `(s, pending)` with the first bytes of an
unfinished UTF-8 character. Only *live* states are ever returned: states from which an
accepting state is still reachable, so a surviving state always means "can still match".
"""

from __future__ import annotations

import re

import interegular
from interegular.fsm import anything_else

from ..base import GrammarError

# Lark's common terminals that use look-behind, which interegular cannot compile (keyed by
# their regex, whatever they are imported as): the same languages written without it.
_REGEX_FALLBACKS = {
    r'".*?(?<!\\)(\\\\)*?"': r'"(?:[^"\\\n]|\\[^\n])*"',  # ESCAPED_STRING
    r".*?(?<!\\)(\\\\)*?": r'(?:[^"\\\n]|\\[^\n])*',  # _STRING_ESC_INNER
}

_U_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u([0-9a-fA-F]{4})")
_UTF8_LEN = {**{b: 2 for b in range(0xC2, 0xE0)}, **{b: 3 for b in range(0xE0, 0xF0)}}
_UTF8_LEN.update({b: 4 for b in range(0xF0, 0xF5)})
_MIN_CP = {2: 0x80, 3: 0x800, 4: 0x10000}


def _normalize_regex(regex: str) -> str:
    """Rewrite `\\uHHHH` escapes (unsupported by interegular) as the characters themselves."""
    return _U_ESCAPE.sub(lambda m: m.group(1) + re.escape(chr(int(m.group(2), 16))), regex)


class TerminalFSM:
    """A byte-level view of one terminal's character DFA."""

    def __init__(self, name: str, regex: str, allow_empty: bool = False):
        self.name = name
        try:
            fsm = interegular.parse_pattern(_normalize_regex(regex)).to_fsm()
        except Exception as exc:  # interegular raises several unrelated types
            fallback = _REGEX_FALLBACKS.get(regex)
            if fallback is None:
                raise GrammarError(
                    f"terminal {name}: regex {regex!r} is not supported ({exc})"
                ) from exc
            fsm = interegular.parse_pattern(fallback).to_fsm()
        self.initial = fsm.initial
        self.finals = frozenset(fsm.finals)
        self._map = {s: dict(t) for s, t in fsm.map.items()}
        self._symbol = dict(fsm.alphabet._symbol_mapping)
        self._other = self._symbol.pop(anything_else, None)
        self.live = self._live_states()
        if self.initial not in self.live:
            raise GrammarError(f"terminal {name}: regex {regex!r} matches nothing")
        if self.initial in self.finals and not allow_empty:
            raise GrammarError(f"terminal {name}: regex {regex!r} matches the empty string")
        # Non-ASCII characters named explicitly in the alphabet, for liveness of pending bytes.
        self._wide = sorted(ord(c) for c in self._symbol if isinstance(c, str) and ord(c) >= 0x80)
        self._byte_cache: dict[tuple, object] = {}

    def _live_states(self) -> frozenset:
        reverse: dict = {}
        for s, trans in self._map.items():
            for t in trans.values():
                reverse.setdefault(t, set()).add(s)
        live, todo = set(self.finals), list(self.finals)
        while todo:
            for p in reverse.get(todo.pop(), ()):
                if p not in live:
                    live.add(p)
                    todo.append(p)
        return frozenset(live)

    def char_step(self, state: int, ch: str) -> int | None:
        sym = self._symbol.get(ch, self._other)
        if sym is None:
            return None
        nxt = self._map.get(state, {}).get(sym)
        return nxt if nxt in self.live else None

    def ascii_targets(self, state: int) -> list[tuple[int, list[int]]]:
        """A character state's ASCII transitions grouped by target: (live target, its bytes).
        One lookup per alphabet symbol instead of one `step` per byte (closing.py's table)."""
        groups = getattr(self, "_ascii_groups", None)
        if groups is None:
            by_symbol: dict = {}
            for b in range(0x80):
                by_symbol.setdefault(self._symbol.get(chr(b), self._other), []).append(b)
            groups = self._ascii_groups = [(k, v) for k, v in by_symbol.items() if k is not None]
        trans = self._map.get(state, {})
        out = []
        for symbol, bytes_ in groups:
            nxt = trans.get(symbol)
            if nxt in self.live:
                out.append((nxt, bytes_))
        return out

    def takes_non_ascii(self, state: int) -> bool:
        """Whether some non-ASCII character goes on from a character state."""
        if self._other is not None and self._map.get(state, {}).get(self._other) in self.live:
            return True
        return any(self.char_step(state, chr(c)) is not None for c in self._wide)

    def is_final(self, bstate) -> bool:
        return not isinstance(bstate, tuple) and bstate in self.finals

    def step(self, bstate, byte: int):
        """Byte-level transition; None when the terminal can no longer match."""
        key = (bstate, byte)
        try:
            return self._byte_cache[key]
        except KeyError:
            pass
        nxt = self._step(bstate, byte)
        self._byte_cache[key] = nxt
        return nxt

    def _step(self, bstate, byte: int):
        if isinstance(bstate, tuple):
            state, pending = bstate
            if not 0x80 <= byte <= 0xBF:
                return None
            if isinstance(pending, int):  # `pending` more bytes of a character of no class
                if pending > 1:
                    return (state, pending - 1)
                nxt = self._map.get(state, {}).get(self._other)
                return nxt if nxt in self.live else None
            pending += bytes((byte,))
            need = _UTF8_LEN[pending[0]]
        else:
            if byte < 0x80:
                return self.char_step(bstate, chr(byte))
            need = _UTF8_LEN.get(byte)
            if need is None:
                return None
            state, pending = bstate, bytes((byte,))
        if len(pending) == need:
            try:
                ch = pending.decode("utf-8")
            except UnicodeDecodeError:
                return None
            return self.char_step(state, ch)
        return self._pending(state, pending, need)

    def _pending(self, state: int, pending: bytes, need: int):
        """The live byte state for an unfinished character, or None. When every character
        that can complete `pending` is valid and outside the alphabet's explicit characters,
        only the count of missing bytes matters: `(state, count)`, so the many prefixes of
        e.g. CJK text inside a string share one state instead of one state each."""
        rest = need - len(pending)
        lead_bits = {2: 0x1F, 3: 0x0F, 4: 0x07}[need]
        cp = pending[0] & lead_bits
        for b in pending[1:]:
            cp = (cp << 6) | (b & 0x3F)
        raw_lo, raw_hi = cp << (6 * rest), ((cp + 1) << (6 * rest)) - 1
        lo, hi = max(raw_lo, _MIN_CP[need]), min(raw_hi, 0x10FFFF)
        if lo > hi or (lo >= 0xD800 and hi <= 0xDFFF):
            return None
        explicit = [c for c in self._wide if lo <= c <= hi]
        if any(self.char_step(state, chr(c)) is not None for c in explicit):
            return (state, pending)
        other = self._other is not None and self._map.get(state, {}).get(self._other) in self.live
        if not other or (hi - lo + 1) <= len(explicit):
            return None
        all_valid = (lo, hi) == (raw_lo, raw_hi) and (hi < 0xD800 or lo > 0xDFFF)
        return (state, rest) if all_valid and not explicit else (state, pending)
