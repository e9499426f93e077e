"""Regular-language grammars: a regex compiled to a token automaton by outlines-core.

`CompiledRegex` is the shared, immutable part: the outlines-core `Index` (regex DFA x token
vocabulary), one packed bitmask row per automaton state (built on first use, so `fill_mask` is
one copy), and the bytes forced in each state (jump-forward), read off the same Index.
`RegexGrammar` is one request's position: a stack of automaton states, so
`rollback(k)` is a pop.

Why the sentinels: outlines-core's Index drops a token whose bytes run through a point where
the regex could end and stop where it cannot (its DFA reports matches one byte late), so with
choices ["a", "abc"] the token "ab" would never be allowed. Compiling `(?:R)` + U+10FFFF moves
the only match to after the sentinel; "the text is in R" becomes "the sentinel pseudo-token
is allowed here and completes the match". The same sentinel also opens the regex and the
initial state is the one after it: outlines-core determinizes a search that may start at any
position, so a regex whose later parts can re-match its start (a bounded JSON string, whose
`\\"` escape contains the opening quote, or any nested "{") grows a DFA exponential in the
nesting or the bound; a start character that never recurs keeps the DFA to one live thread.
"""

from __future__ import annotations

import os

import numpy as np

from .base import Bitmask, Grammar, GrammarError, bitmask_row, bitmask_words
from .vocab import SENTINEL, SENTINEL_BYTES, TokenVocabulary


class CompiledRegex:
    """A regex over a vocabulary, compiled once and shared by every request that uses it."""

    def __init__(self, pattern: str, vocab: TokenVocabulary):
        from outlines_core import Index

        self.pattern = pattern
        self.vocab = vocab
        try:
            self.index = Index(f"{SENTINEL}(?:{pattern}){SENTINEL}", vocab.outlines_vocabulary())
        except Exception as e:  # outlines-core raises plain ValueError / RuntimeError
            raise GrammarError(f"cannot compile regex {_short(pattern)!r}: {e}") from None
        start = self.index.get_next_state(self.index.get_initial_state(), vocab.sentinel_id)
        if start is None:
            raise GrammarError(f"cannot compile regex {_short(pattern)!r}: no start state")
        self.initial_state: int = start
        self._outlines_eos = min(vocab.eos_token_ids) if vocab.eos_token_ids else -1
        self._rows: dict[int, np.ndarray] = {}
        self._final: dict[int, bool] = {}
        self._terminal: dict[int, bool] = {}
        self._forced: dict[int, tuple[bytes, int | None] | None] = {}
        self._eos_row: np.ndarray | None = None

    # -- token level --------------------------------------------------------------------------

    def next_state(self, state: int, token_id: int) -> int | None:
        if token_id == self._outlines_eos:
            return None
        return self.index.get_next_state(state, token_id)

    def is_final(self, state: int) -> bool:
        """The text so far is in the language: the sentinel pseudo-token completes a match."""
        final = self._final.get(state)
        if final is None:
            t = self.index.get_next_state(state, self.vocab.sentinel_id)
            final = self._final[state] = t is not None and self.index.is_final_state(t)
        return final

    def _spurious(self, state: int, allowed: np.ndarray) -> list[int]:
        """Tokens allowed in a final state only because they start spelling the sentinel:
        those whose bytes end in a prefix of it and after which nothing but the rest of it
        may follow. (A regex that admits U+100000.. there keeps them.)"""
        tb, out = self.vocab.token_bytes, []
        for t in allowed.tolist():
            b = tb[t]
            for k in (1, 2, 3):
                if not b.endswith(SENTINEL_BYTES[:k]):
                    continue
                after = self.index.get_allowed_tokens(self.index.get_next_state(state, t)) or []
                rest = SENTINEL_BYTES[k:]
                if all(
                    tb[u] is None or rest.startswith(tb[u])
                    for u in after
                    if u < self.vocab.vocab_size
                ):
                    out.append(t)
                break
        return out

    def mask_row(self, state: int) -> np.ndarray:
        """The packed int32 bitmask of tokens allowed in `state` (EOS only if final)."""
        row = self._rows.get(state)
        if row is None:
            allowed = self.index.get_allowed_tokens(state) or []
            bits = np.zeros(bitmask_words(self.vocab.vocab_size) * 32, dtype=bool)
            ids = np.fromiter(allowed, dtype=np.int64)
            ids = ids[ids < self.vocab.vocab_size]
            if self._outlines_eos >= 0:
                ids = ids[ids != self._outlines_eos]
            bits[ids] = True
            final = self.is_final(state)
            if final:
                bits[self._spurious(state, ids)] = False
            self._terminal[state] = not bits.any()
            if final:
                bits[list(self.vocab.eos_token_ids)] = True
            packed = np.packbits(bits, bitorder="little").view("<i4")
            row = packed.astype(np.int32)
            self._rows[state] = row
        return row

    def eos_row(self) -> np.ndarray:
        if self._eos_row is None:
            bits = np.zeros(bitmask_words(self.vocab.vocab_size) * 32, dtype=bool)
            bits[list(self.vocab.eos_token_ids)] = True
            packed = np.packbits(bits, bitorder="little").view("<i4")
            self._eos_row = packed.astype(np.int32)
        return self._eos_row

    def is_terminal(self, state: int) -> bool:
        """Final and nothing but EOS may follow."""
        if state not in self._terminal:
            self.mask_row(state)
        return self._terminal[state] and self.is_final(state)

    # -- jump-forward ---------------------------------------------------------------------

    def forced(self, state: int) -> tuple[bytes, int | None] | None:
        """The bytes every continuation from `state` starts with, and the state after them
        (None when no token spells exactly those bytes), or None when nothing is forced.

        Read off the Index: the next token is one of the allowed ones, so their longest
        common prefix is forced, and a final state forces nothing (EOS may come). Cached
        per state; an allowed token that only leads to a dead end can hide a forced byte,
        never invent one."""
        if state in self._forced:
            return self._forced[state]
        out = None
        if not self.is_final(state):
            tb, n = self.vocab.token_bytes, self.vocab.vocab_size
            ids: list[int] | None = []
            for t in self.index.get_allowed_tokens(state) or []:
                if t >= n or tb[t] is None:
                    continue
                if ids and tb[t][0] != tb[ids[0]][0]:
                    ids = None  # two first bytes: nothing is forced (found early, usually)
                    break
                ids.append(t)
            if ids:
                prefix = os.path.commonprefix([tb[t] for t in ids])
                exact = next((t for t in ids if tb[t] == prefix), None)
                out = (prefix, None if exact is None else self.next_state(state, exact))
        self._forced[state] = out
        return out

    def forced_text(self, state: int, limit: int = 4096) -> str | None:
        """The text forced from `state` on, cut before an unfinished UTF-8 character."""
        out = bytearray()
        while state is not None and len(out) < limit:
            step = self.forced(state)
            if step is None:
                break
            out += step[0]
            state = step[1]
        try:
            text = out.decode("utf-8")
        except UnicodeDecodeError as e:  # also: the text so far ends inside a character
            text = out[: e.start].decode("utf-8")
        return text or None


def _short(pattern: str, n: int = 120) -> str:
    return pattern if len(pattern) <= n else pattern[:n] + "..."


class RegexGrammar(Grammar):
    """One request's position in a `CompiledRegex`.

    `_states[i]` is the automaton state after the first i accepted tokens; `_tokens` are those
    tokens (an EOS accepted in a final state is recorded and keeps the state).
    """

    def __init__(self, compiled: CompiledRegex):
        self.compiled = compiled
        self._states: list[int] = [compiled.initial_state]
        self._tokens: list[int] = []

    @property
    def state(self) -> int:
        return self._states[-1]

    def fill_mask(self, bitmask: Bitmask, row: int) -> None:
        target = bitmask_row(bitmask, row)
        if self._tokens and self._tokens[-1] in self.compiled.vocab.eos_token_ids:
            target[:] = self.compiled.eos_row()  # finished: nothing but EOS
        else:
            target[:] = self.compiled.mask_row(self.state)

    def accept_token(self, token_id: int) -> None:
        c = self.compiled
        if token_id in c.vocab.eos_token_ids:
            if not c.is_final(self.state):
                raise GrammarError(f"EOS token {token_id} before the grammar is complete")
            nxt = self.state
        else:
            nxt = c.next_state(self.state, token_id)
            if nxt is None:
                raise GrammarError(f"token {token_id} is not allowed here")
        self._states.append(nxt)
        self._tokens.append(token_id)

    def rollback(self, k: int) -> None:
        if k < 0 or k > len(self._tokens):
            raise GrammarError(f"cannot roll back {k} of {len(self._tokens)} tokens")
        if k:
            del self._states[-k:]
            del self._tokens[-k:]

    def is_terminated(self) -> bool:
        return self.compiled.is_terminal(self.state) or (
            bool(self._tokens) and self._tokens[-1] in self.compiled.vocab.eos_token_ids
        )

    def copy(self) -> RegexGrammar:
        g = RegexGrammar(self.compiled)
        g._states = list(self._states)
        g._tokens = list(self._tokens)
        return g

    def jump_forward(self) -> str | None:
        """The text every continuation starts with (None at the end, or if nothing is forced)."""
        return None if self.is_terminated() else self.compiled.forced_text(self.state)
