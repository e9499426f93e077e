"""The lexer half of the matcher state: which terminals the current lexeme may still become.

A lexer state is the set of `(terminal, byte state)` candidates for the partial lexeme since
the last terminal boundary, interned to an int so states hash and compare in O(1). Lexing is
maximal munch per terminal with one byte of look-ahead: a terminal ends exactly when it is in
an accepting state and the next byte cannot extend it (or at end of input). Several terminals
may end at once, or one may end while another goes on: the engine follows every such branch and
lets the parser decide (a contextual lexer that never has to guess).
"""

from __future__ import annotations

from .fsm import TerminalFSM

DEAD = -1


class Lexer:
    def __init__(self, terminals: list[TerminalFSM], ignore: frozenset[int]):
        self.terminals = terminals
        self.ignore = ignore
        self._ids: dict[frozenset, int] = {}
        self._states: list[frozenset] = []
        self._accepting: list[tuple[int, ...]] = []
        self._trans: dict[int, tuple[int, tuple[int, ...]]] = {}  # (lex << 8) | byte ->
        self._initial: dict[frozenset, int] = {}

    def intern(self, candidates: frozenset) -> int:
        lex = self._ids.get(candidates)
        if lex is None:
            lex = len(self._states)
            self._states.append(candidates)
            self._accepting.append(
                tuple(sorted(t for t, s in candidates if self.terminals[t].is_final(s)))
            )
            self._ids[candidates] = lex
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
        hit = self._trans.get(key)
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
        self._trans[key] = result
        return result

    def __len__(self) -> int:
        return len(self._states)
