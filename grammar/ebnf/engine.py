"""The compiled grammar: parser + lexer + token trie, and the token-mask walk over them.

Matcher state: a frozenset of branches `(stack, lex)`, a parser stack and a lexer state (see
parser.py, lexer.py). There is more than one branch only while the text so far lexes in more
than one way (a keyword that is also an identifier prefix, `"a"` vs `[a-z]` in GBNF).

Matcher states are interned into a dense table `[state id, byte] -> state id`, filled lazily
and shared by every request on the grammar. `step` reads it, and the mask walk follows it over
the token trie one level at a time (numpy), so a mask costs a few vectorised steps plus Python
work only for transitions never seen before: mostly the first time a parser stack appears.
Whole masks are also cached by state (inside a string or a name, steps revisit one state).

An earlier version walked per lexer state (stack-independent, cached) and resolved terminal
boundaries against the stack one by one; with BPE tokens that span several terminals (" AND",
"\":") the boundaries dominate and the whole-state walk was as fast or faster on every grammar.

Not thread-safe: the tables grow lazily, so one compiled grammar is driven by one thread (the
scheduler's) at a time.
"""

from __future__ import annotations

import numpy as np

from .lexer import DEAD, Lexer
from .parser import REJECT, Parser
from .trie import TokenTrie

State = frozenset  # of (stack id, lexer state id)
_CACHE_LIMIT = 200_000
_STATE_LIMIT = 20_000
_EMPTY: State = frozenset()
UNKNOWN = -2


class CompiledCFG:
    def __init__(self, parser: Parser, lexer: Lexer, trie: TokenTrie, token_bytes, source: str):
        self.parser = parser
        self.lexer = lexer
        self.trie = trie
        self.token_bytes = token_bytes
        self.source = source
        self._masks: dict[State, int] = {}
        # masks are vocab/8 bytes each: keep the cache near 64 MiB whatever the vocabulary
        self._mask_limit = max(256, (64 << 20) // (trie.n_words * 4))
        self._next_bytes: dict[State, tuple[int, ...]] = {}
        self._state_ids: dict[State, int] = {}
        self._start_lex: dict[int, int] = {}
        self._state_list: list[State] = []
        self._dfa_next = np.full((64, 256), UNKNOWN, dtype=np.int32)
        start = parser.start
        self.initial_state: State = frozenset({(start, self.start_lex(start))})

    # --- stepping -------------------------------------------------------------------------
    def start_lex(self, stack: int) -> int:
        """The empty lexeme on `stack` (the terminals it accepts, plus ignored ones)."""
        lex = self._start_lex.get(stack)
        if lex is None:
            lex = self._start_lex[stack] = self.lexer.initial(self.parser.allowed(stack))
        return lex

    def _end_terminal(self, stack: int, term: int) -> int:
        return stack if term in self.lexer.ignore else self.parser.feed(stack, term)

    def step(self, state: State, byte: int) -> State:
        """The state after one more byte; empty when the text can no longer be completed."""
        sid = self._state_id(state)
        nid = int(self._dfa_next[sid, byte])
        if nid == UNKNOWN:
            nid = self._fill(sid, byte)
        return self._state_list[nid] if nid != DEAD else _EMPTY

    def _fill(self, sid: int, byte: int) -> int:
        """Compute one transition of the matcher-state table."""
        out = set()
        lex_step = self.lexer.step
        for stack, lex in self._state_list[sid]:
            nxt, ending = lex_step(lex, byte)
            if nxt != DEAD:
                out.add((stack, nxt))
            for term in ending:
                stack2 = self._end_terminal(stack, term)
                if stack2 != REJECT:
                    lex2 = lex_step(self.start_lex(stack2), byte)[0]
                    if lex2 != DEAD:
                        out.add((stack2, lex2))
        nid = self._state_id(frozenset(out)) if out else DEAD
        self._dfa_next[sid, byte] = nid
        return nid

    def step_bytes(self, state: State, data: bytes) -> State:
        for byte in data:
            state = self.step(state, byte)
            if not state:
                break
        return state

    def can_end(self, state: State, at_start: bool) -> bool:
        """Whether the text so far is a complete sentence (`at_start`: nothing consumed yet)."""
        parser = self.parser
        if at_start:
            return parser.accepts_end(parser.start)
        for stack, lex in state:
            for term in self.lexer.accepting(lex):
                stack2 = self._end_terminal(stack, term)
                if stack2 != REJECT and parser.accepts_end(stack2):
                    return True
        return False

    def next_bytes(self, state: State) -> tuple[int, ...]:
        """The bytes that may come next (a byte-level view of the mask)."""
        hit = self._next_bytes.get(state)
        if hit is None:
            hit = tuple(b for b in range(256) if self.step(state, b))
            self._remember(self._next_bytes, state, hit)
        return hit

    # --- masks ----------------------------------------------------------------------------
    def mask(self, state: State) -> int:
        """Bits of the non-EOS tokens allowed next (bit t = token id t)."""
        hit = self._masks.get(state)
        if hit is not None:
            return hit
        if len(self._state_list) > _STATE_LIMIT:  # bound the dense table (1 KiB per state)
            self._state_ids.clear()
            self._state_list.clear()
            self._dfa_next = np.full((64, 256), UNKNOWN, dtype=np.int32)
        bits = self._state_walk(state)
        if len(self._masks) >= self._mask_limit:
            self._masks.clear()
        self._masks[state] = bits
        return bits

    def _state_id(self, state: State) -> int:
        sid = self._state_ids.get(state)
        if sid is None:
            sid = len(self._state_list)
            self._state_list.append(state)
            self._state_ids[state] = sid
            if sid >= len(self._dfa_next):
                grow = np.full((len(self._dfa_next), 256), UNKNOWN, dtype=np.int32)
                self._dfa_next = np.vstack([self._dfa_next, grow])
        return sid

    def _state_walk(self, state: State) -> int:
        """Depth-first pruning done breadth-first: one numpy step per trie level follows every
        live node's matcher state through the dense table (a dead state prunes the node's
        whole subtree), computing in Python only the transitions never needed before."""
        trie = self.trie
        alive = np.zeros(len(trie) + 1, dtype=bool)
        states = np.array([self._state_id(state)], dtype=np.int64)
        for nodes, parents, bytes_ in trie.levels:
            parent_state = states[parents]
            live = parent_state >= 0
            if not live.any():
                break
            nodes, src, bytes_ = nodes[live], parent_state[live], bytes_[live]
            nxt = self._dfa_next[src, bytes_]
            unknown = nxt == UNKNOWN
            if unknown.any():
                for s, b in set(zip(src[unknown].tolist(), bytes_[unknown].tolist())):
                    self._fill(s, b)
                nxt = self._dfa_next[src, bytes_]
            states = np.full(len(parents), DEAD, dtype=np.int64)
            states[live] = nxt
            alive[nodes[nxt >= 0]] = True
        return trie.bits_of_nodes(alive)

    @staticmethod
    def _remember(cache: dict, key, value) -> None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()  # crude but bounded; entries are cheap to recompute
        cache[key] = value
