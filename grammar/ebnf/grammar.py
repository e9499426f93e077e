"""One request's position in a compiled context-free grammar (the `Grammar` contract)."""

from __future__ import annotations

import numpy as np

from ..base import Grammar, GrammarError, bitmask_row
from .engine import CompiledCFG, State

_ENDED: State = frozenset({("end",)})  # after EOS was accepted at a valid end
_JUMP_LIMIT = 4096


class EBNFGrammar(Grammar):
    """State history over a shared `CompiledCFG`; `rollback` pops it, `copy` forks it."""

    def __init__(self, compiled: CompiledCFG, history: list[State] | None = None):
        self.compiled = compiled
        self._history = history if history is not None else [compiled.initial_state]

    @property
    def _state(self) -> State:
        return self._history[-1]

    def _can_end(self) -> bool:
        if self._state is _ENDED:
            return True
        return self.compiled.can_end(self._state, at_start=len(self._history) == 1)

    def allowed_bits(self) -> int:
        """The mask as a Python int: bit t set when token t is allowed (EOS included)."""
        state = self._state
        if state is _ENDED:
            return self.compiled.trie.eos_bits
        bits = self.compiled.mask(state)
        if self._can_end():
            bits |= self.compiled.trie.eos_bits
        return bits

    def allowed_token_ids(self) -> list[int]:
        n_words = self.compiled.trie.n_words
        raw = np.frombuffer(self.allowed_bits().to_bytes(n_words * 4, "little"), dtype=np.uint8)
        return np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist()

    def fill_mask(self, bitmask, row: int) -> None:
        n_words = self.compiled.trie.n_words
        data = self.allowed_bits().to_bytes(n_words * 4, "little")
        target = bitmask_row(bitmask, row)
        target[:n_words] = np.frombuffer(data, dtype="<i4")
        target[n_words:] = 0

    def accept_token(self, token_id: int) -> None:
        compiled = self.compiled
        if token_id in compiled.trie.eos_token_ids:
            if not self._can_end():
                raise GrammarError(f"EOS token {token_id} is not allowed here")
            self._history.append(_ENDED)
            return
        data = compiled.token_bytes[token_id] if 0 <= token_id < len(compiled.token_bytes) else None
        if not data or self._state is _ENDED:
            raise GrammarError(f"token {token_id} is not allowed here")
        state = compiled.step_bytes(self._state, data)
        if not state:
            raise GrammarError(f"token {token_id} ({data!r}) is not allowed here")
        self._history.append(state)

    def accept_bytes(self, data: bytes) -> bool:
        """Advance over raw text (e.g. a jump-forward string) as one step (for `rollback`);
        False, with the state unchanged, if invalid. Empty text is valid and not a step."""
        if not data:
            return True
        if self._state is _ENDED:
            return False
        state = self.compiled.step_bytes(self._state, data)
        if not state:
            return False
        self._history.append(state)
        return True

    def rollback(self, k: int) -> None:
        if k < 0 or k >= len(self._history):
            raise ValueError(f"cannot roll back {k} steps from {len(self._history) - 1}")
        if k:
            del self._history[-k:]

    def is_terminated(self) -> bool:
        state = self._state
        if state is _ENDED:
            return True
        return self._can_end() and not self.compiled.next_bytes(state)

    def jump_forward(self) -> str | None:
        compiled, state = self.compiled, self._state
        if state is _ENDED:
            return None
        out = bytearray()
        at_start = len(self._history) == 1
        while len(out) < _JUMP_LIMIT and not compiled.can_end(state, at_start and not out):
            nxt = compiled.next_bytes(state)
            if len(nxt) != 1:
                break
            out.append(nxt[0])
            state = compiled.step(state, nxt[0])
        try:
            text = out.decode("utf-8")
        except UnicodeDecodeError as exc:  # stop before an unfinished character
            text = out[: exc.start].decode("utf-8")
        return text or None

    def copy(self) -> EBNFGrammar:
        return EBNFGrammar(self.compiled, list(self._history))
