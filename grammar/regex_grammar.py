"""Regular-language grammars: a regex compiled to a token automaton by outlines-core.

`CompiledRegex` is the shared, immutable part: the outlines-core `Index` (regex DFA x token
vocabulary), one packed bitmask row per automaton state (built on first use, so `fill_mask` is
one copy), and, for jump-forward only, a character-level DFA from `interegular` built in the
background. `RegexGrammar` is one request's position: a stack of automaton states, so
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

import threading

import numpy as np
import torch

from . import char_dfa as CD
from .base import Grammar, GrammarError, bitmask_words
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
        self._rows: dict[int, torch.Tensor] = {}
        self._final: dict[int, bool] = {}
        self._terminal: dict[int, bool] = {}
        self._char_dfa = None
        self._char_dfa_stage = "new"  # -> "queued" -> "building" -> "done"
        self._char_dfa_done = threading.Event()
        self._eos_row: torch.Tensor | None = None
        self._lock = threading.Lock()

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

    def mask_row(self, state: int) -> torch.Tensor:
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
            row = torch.from_numpy(packed.astype(np.int32))
            self._rows[state] = row
        return row

    def eos_row(self) -> torch.Tensor:
        if self._eos_row is None:
            bits = np.zeros(bitmask_words(self.vocab.vocab_size) * 32, dtype=bool)
            bits[list(self.vocab.eos_token_ids)] = True
            packed = np.packbits(bits, bitorder="little").view("<i4")
            self._eos_row = torch.from_numpy(packed.astype(np.int32))
        return self._eos_row

    def is_terminal(self, state: int) -> bool:
        """Final and nothing but EOS may follow."""
        if state not in self._terminal:
            self.mask_row(state)
        return self._terminal[state] and self.is_final(state)

    # -- character level (jump-forward) -------------------------------------------------------

    def char_dfa(self, wait: bool = False):
        """(fsm, live states, symbol -> chars), or None when it is not (yet) available.

        interegular is pure Python and takes seconds on a large JSON-schema regex, so the
        scheduler never waits for it: the first call queues the build on the one background
        builder (char_dfa.py) and jump-forward stays off until it is done. `wait=True` builds
        it now in the caller's thread if the builder has not started it (tests, warm-up).
        """
        build_here = False
        with self._lock:
            if self._char_dfa_stage == "new" and not wait:
                self._char_dfa_stage = "queued"
                CD.enqueue(self)
            elif self._char_dfa_stage in ("new", "queued") and wait:
                self._char_dfa_stage = "building"
                build_here = True
        if build_here:
            self._build_char_dfa()
        elif wait:
            self._char_dfa_done.wait()
        dfa = self._char_dfa
        return None if dfa is None or dfa is CD.NO_JUMP else dfa

    def build_char_dfa_if_queued(self) -> None:
        """The builder thread's entry: build unless a `wait=True` caller took it over."""
        with self._lock:
            if self._char_dfa_stage != "queued":
                return
            self._char_dfa_stage = "building"
        self._build_char_dfa()

    def _build_char_dfa(self) -> None:
        try:
            self._char_dfa = CD.build_char_dfa(self.pattern)
        finally:
            self._char_dfa_stage = "done"
            self._char_dfa_done.set()


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
        self._char_states: list[tuple] = []  # lazily: (char-DFA state or None, pending bytes)

    @property
    def state(self) -> int:
        return self._states[-1]

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._tokens and self._tokens[-1] in self.compiled.vocab.eos_token_ids:
            bitmask[row].copy_(self.compiled.eos_row())  # finished: nothing but EOS
        else:
            bitmask[row].copy_(self.compiled.mask_row(self.state))

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
            del self._char_states[len(self._tokens) + 1 :]

    def is_terminated(self) -> bool:
        return self.compiled.is_terminal(self.state) or (
            bool(self._tokens) and self._tokens[-1] in self.compiled.vocab.eos_token_ids
        )

    def copy(self) -> RegexGrammar:
        g = RegexGrammar(self.compiled)
        g._states = list(self._states)
        g._tokens = list(self._tokens)
        g._char_states = list(self._char_states)
        return g

    def jump_forward(self) -> str | None:
        """Walk the char DFA while the state is not final and exactly one char may follow."""
        dfa = self.compiled.char_dfa()
        if dfa is None or self.is_terminated():
            return None
        fsm, live, by_symbol = dfa
        state, pending = self._char_state()
        if state is None or pending:
            return None  # off the char DFA, or inside a multi-byte character
        out: list[str] = []
        while state not in fsm.finals:
            nexts = [(sym, t) for sym, t in fsm.map.get(state, {}).items() if t in live]
            if len(nexts) != 1:
                break
            chars = by_symbol.get(nexts[0][0], [])
            if len(chars) != 1 or not isinstance(chars[0], str):
                break  # a class of several chars, or "anything else"
            out.append(chars[0])
            state = nexts[0][1]
        return "".join(out) or None

    def _char_state(self) -> tuple:
        """Char-DFA state after all accepted tokens, fed incrementally and cached per token."""
        fsm, _, _ = self.compiled.char_dfa()  # only called once it is built
        if not self._char_states:
            self._char_states.append((fsm.initial, b""))
        token_bytes = self.compiled.vocab.token_bytes
        for i in range(len(self._char_states) - 1, len(self._tokens)):
            state, pending = self._char_states[i]
            data = token_bytes[self._tokens[i]] or b""  # EOS adds nothing
            self._char_states.append(_feed(fsm, state, pending + data))
        return self._char_states[len(self._tokens)]


def _feed(fsm, state, data: bytes) -> tuple:
    """Advance the char DFA over the complete UTF-8 characters in `data`."""
    if state is None:
        return None, b""
    cut = len(data)
    # keep a trailing incomplete UTF-8 sequence for the next token
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:
            continue
        need = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 1
        if need > back:
            cut = len(data) - back
        break
    text = data[:cut].decode("utf-8", errors="replace")
    from interegular.fsm import anything_else

    for ch in text:
        sym = fsm.alphabet[ch] if ch in fsm.alphabet else fsm.alphabet[anything_else]
        state = fsm.map.get(state, {}).get(sym)
        if state is None:
            return None, b""
    return state, data[cut:]
