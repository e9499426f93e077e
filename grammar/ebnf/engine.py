"""The compiled grammar: parser + lexer + token trie, and the token-mask walk over them.

Matcher state: a frozenset of branches `(stack, lex)`, a parser stack and a lexer state (see
parser.py, lexer.py). There is more than one branch only while the text so far lexes in more
than one way (a keyword that is also an identifier prefix, `"a"` vs `[a-z]` in GBNF).

Mask walk. For one branch, the tokens that stay inside the current lexeme depend on the lexer
state alone, so `_lex_walk(node, lex)` walks the trie below `node` with the lexer only and is
cached across requests: it returns the token bits it reached plus the *events*, the trie edges
where a terminal ends. Only events involve the parser: each is resolved against the branch's
stack and continues as a fresh `_walk` below that edge (itself mostly cached). Whole masks are
cached by state, since most steps (inside a string, a number, a name) revisit a state.

Not thread-safe: the tables grow lazily, so one compiled grammar is driven by one thread (the
scheduler's) at a time.
"""

from __future__ import annotations

import numpy as np

from .lexer import DEAD, UNKNOWN, Lexer
from .parser import REJECT, Parser
from .trie import ROOT, TokenTrie

State = frozenset  # of (stack id, lexer state id)
_CACHE_LIMIT = 200_000


class CompiledCFG:
    def __init__(
        self,
        parser: Parser,
        lexer: Lexer,
        trie: TokenTrie,
        token_bytes,
        source: str,
        state_walk: bool = False,
    ):
        self.parser = parser
        self.state_walk = state_walk
        self.lexer = lexer
        self.trie = trie
        self.token_bytes = token_bytes
        self.source = source
        self._lex_walks: dict[tuple[int, int], tuple[int, tuple]] = {}
        self._node_bits: dict[int, int] = {}
        self._masks: dict[State, int] = {}
        self._steps: dict[tuple[State, int], State] = {}
        self._next_bytes: dict[State, tuple[int, ...]] = {}
        self._state_ids: dict[State, int] = {}
        self._state_list: list[State] = []
        self._dfa_next = np.full((64, 256), UNKNOWN, dtype=np.int32)
        start = parser.start
        self.initial_state: State = frozenset({(start, self.start_lex(start))})

    # --- stepping -------------------------------------------------------------------------
    def start_lex(self, stack: int) -> int:
        return self.lexer.initial(self.parser.allowed(stack))

    def _end_terminal(self, stack: int, term: int) -> int:
        return stack if term in self.lexer.ignore else self.parser.feed(stack, term)

    def step(self, state: State, byte: int) -> State:
        """The state after one more byte; empty when the text can no longer be completed."""
        key = (state, byte)
        hit = self._steps.get(key)
        if hit is not None:
            return hit
        out = set()
        lex_step = self.lexer.step
        for stack, lex in state:
            nxt, ending = lex_step(lex, byte)
            if nxt != DEAD:
                out.add((stack, nxt))
            for term in ending:
                stack2 = self._end_terminal(stack, term)
                if stack2 != REJECT:
                    lex2 = lex_step(self.start_lex(stack2), byte)[0]
                    if lex2 != DEAD:
                        out.add((stack2, lex2))
        result = frozenset(out)
        self._remember(self._steps, key, result)
        return result

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
        if self.state_walk:
            bits = self._state_walk(state)
        else:
            memo: dict[tuple[int, int, int], int] = {}
            bits = 0
            for stack, lex in state:
                bits |= self._walk(ROOT, stack, lex, memo)
        self._remember(self._masks, state, bits)
        return bits

    def _walk(self, node: int, stack: int, lex: int, memo: dict) -> int:
        key = (node, stack, lex)
        hit = memo.get(key)
        if hit is not None:
            return hit
        bits, events = self._lex_walk(node, lex)
        lex_step = self.lexer.step
        for child, byte, ending in events:
            for term in ending:
                stack2 = self._end_terminal(stack, term)
                if stack2 == REJECT:
                    continue
                lex2 = lex_step(self.start_lex(stack2), byte)[0]
                if lex2 == DEAD:
                    continue
                bits |= self._tokens_at(child) | self._walk(child, stack2, lex2, memo)
        memo[key] = bits
        return bits

    def _lex_walk(self, node: int, lex: int) -> tuple[int, tuple]:
        """Tokens below `node` reachable with no terminal boundary, and the boundary edges."""
        key = (node, lex)
        hit = self._lex_walks.get(key)
        if hit is not None:
            return hit
        if node == ROOT:
            result = self._lex_walk_root(lex)
            self._remember(self._lex_walks, key, result)
            return result
        edges, tokens = self.trie.edges, self.trie.tokens
        lex_step, known = self.lexer.step, self.lexer.transitions
        ids: list[int] = []
        events = []
        todo = [(node, lex)]
        while todo:
            n, cur = todo.pop()
            base = cur << 8
            for byte, child, has_tokens in edges[n]:
                hit = known.get(base | byte)
                nxt, ending = hit if hit is not None else lex_step(cur, byte)
                if ending:
                    events.append((child, byte, ending))
                if nxt != DEAD:
                    if has_tokens:
                        ids.extend(tokens[child])
                    if edges[child]:
                        todo.append((child, nxt))
        result = (self.trie.to_bits(ids), tuple(events))
        self._remember(self._lex_walks, key, result)
        return result

    def _lex_walk_root(self, lex: int) -> tuple[int, tuple]:
        """`_lex_walk` from the root, one numpy step per trie level instead of one Python
        step per node (the root walk visits most of the trie when a lexeme such as a string
        body accepts almost any byte)."""
        lexer, trie = self.lexer, self.trie
        alive = np.zeros(len(trie) + 1, dtype=bool)
        states = np.array([lex], dtype=np.int64)
        events = []
        for nodes, parents, bytes_ in trie.levels:
            parent_state = states[parents]
            live = parent_state >= 0
            if not live.any():
                break
            nodes, src, bytes_ = nodes[live], parent_state[live], bytes_[live]
            nxt = lexer.next_table[src, bytes_]
            unknown = nxt == UNKNOWN
            if unknown.any():
                for s, b in set(zip(src[unknown].tolist(), bytes_[unknown].tolist())):
                    lexer.step(s, b)
                nxt = lexer.next_table[src, bytes_]
            ends = lexer.ends_table[src, bytes_]
            if ends.any():
                for child, s, b in zip(
                    nodes[ends].tolist(), src[ends].tolist(), bytes_[ends].tolist()
                ):
                    events.append((child, b, lexer.transitions[(s << 8) | b][1]))
            states = np.full(len(parents), DEAD, dtype=np.int64)
            states[live] = nxt
            alive[nodes[nxt >= 0]] = True
        return trie.bits_of_nodes(alive), tuple(events)

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
        """The mask by a vectorised trie walk over whole matcher states (interned, with a
        dense transition table). Better than `_walk` when terminals are single characters
        (GBNF): there every byte is a boundary, so `_walk` would resolve an event per node,
        while here the few matcher states a character loop cycles through are reused."""
        if len(self._state_list) > _CACHE_LIMIT:
            self._state_ids.clear()
            self._state_list.clear()
            self._dfa_next.fill(UNKNOWN)
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
                    after = self.step(self._state_list[s], b)
                    self._dfa_next[s, b] = self._state_id(after) if after else DEAD
                nxt = self._dfa_next[src, bytes_]
            states = np.full(len(parents), DEAD, dtype=np.int64)
            states[live] = nxt
            alive[nodes[nxt >= 0]] = True
        return trie.bits_of_nodes(alive)

    def _tokens_at(self, node: int) -> int:
        bits = self._node_bits.get(node)
        if bits is None:
            bits = 0
            for tid in self.trie.tokens[node]:
                bits |= 1 << tid
            self._node_bits[node] = bits
        return bits

    @staticmethod
    def _remember(cache: dict, key, value) -> None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()  # crude but bounded; entries are cheap to recompute
        cache[key] = value
