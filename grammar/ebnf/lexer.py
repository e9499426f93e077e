"""The lexer half of the matcher state: which terminals the current lexeme may still become.

A lexer state is the set of `(terminal, byte state)` candidates for the partial lexeme since
the last terminal boundary, interned to an int so states hash and compare in O(1). Lexing is
maximal munch per terminal with one byte of look-ahead: a terminal ends exactly when it is in
an accepting state and the next byte cannot extend it (or at end of input). Several terminals
may end at once, or one may end while another goes on: the engine follows every such branch and
lets the parser decide (a contextual lexer that never has to guess).
"""

from __future__ import annotations

import numpy as np

from .fsm import TerminalFSM

DEAD = -1
UNKNOWN = -2


class Lexer:
    def __init__(self, terminals: list[TerminalFSM], ignore: frozenset[int]):
        self.terminals = terminals
        self.ignore = ignore
        self._ids: dict[frozenset, int] = {}
        self._states: list[frozenset] = []
        self._accepting: list[tuple[int, ...]] = []
        self.transitions: dict[int, tuple[int, tuple[int, ...]]] = {}  # (lex << 8) | byte ->
        self._initial: dict[frozenset, int] = {}
        # Dense copies of `transitions` for the vectorised trie walk: next state (UNKNOWN until
        # computed) and whether some terminal ends before the byte.
        self.next_table = np.full((64, 256), UNKNOWN, dtype=np.int32)
        self.ends_table = np.zeros((64, 256), dtype=bool)

    def intern(self, candidates: frozenset) -> int:
        lex = self._ids.get(candidates)
        if lex is None:
            lex = len(self._states)
            self._states.append(candidates)
            self._accepting.append(
                tuple(sorted(t for t, s in candidates if self.terminals[t].is_final(s)))
            )
            self._ids[candidates] = lex
            if lex >= len(self.next_table):
                grow = len(self.next_table)
                self.next_table = np.vstack(
                    [self.next_table, np.full((grow, 256), UNKNOWN, dtype=np.int32)]
                )
                self.ends_table = np.vstack([self.ends_table, np.zeros((grow, 256), dtype=bool)])
        return lex

    def initial(self, allowed: frozenset[int]) -> int:
        """The empty lexeme, when the parser accepts `allowed` (ignored terminals added)."""
        lex = self._initial.get(allowed)
        if lex is None:
            terms = allowed | self.ignore
            lex = self.intern(frozenset((t, self.terminals[t].initial) for t in terms))
            self._initial[allowed] = lex
        return lex

    def accepting(self, lex: int) -> tuple[int, ...]:
        """Terminals the lexeme may end as right now (at end of input)."""
        return self._accepting[lex]

    def step(self, lex: int, byte: int) -> tuple[int, tuple[int, ...]]:
        """-> (lexer state after `byte` with no boundary or DEAD, terminals that end before it)."""
        key = (lex << 8) | byte
        hit = self.transitions.get(key)
        if hit is not None:
            return hit
        going, ending = [], []
        for t, s in self._states[lex]:
            fsm = self.terminals[t]
            nxt = fsm.step(s, byte)
            if nxt is not None:
                going.append((t, nxt))
            elif fsm.is_final(s):
                ending.append(t)
        result = (self.intern(frozenset(going)) if going else DEAD, tuple(sorted(ending)))
        self.transitions[key] = result
        self.next_table[lex, byte] = result[0]
        self.ends_table[lex, byte] = bool(ending)
        return result

    def __len__(self) -> int:
        return len(self._states)
