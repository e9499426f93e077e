"""The parser half of the matcher state: an LALR(1) driver over lark's parse table.

Stacks are persistent and interned: stack `i` is `(LALR state, parent stack)`, so pushing is
O(1), equal stacks are the same int, and every result (feed a terminal, accept end of input,
the terminals that may come next) is memoised per stack. Trees are never built: the engine
only needs to know whether a token sequence is still a prefix of the language.
"""

from __future__ import annotations

from lark.parsers.lalr_analysis import Shift

REJECT = -1
END = "$END"


class Parser:
    def __init__(self, parse_table, start: str, term_index: dict[str, int]):
        self._term_index = term_index
        names = {i: n for n, i in term_index.items()}
        # table[state] = {symbol: (True, next state) | (False, (lhs, rhs length))}; terminal
        # symbols are ints (lexer indices), nonterminals and $END keep their names.
        self._table: dict[int, dict] = {}
        for state, actions in parse_table.states.items():
            row = {}
            for sym, (action, arg) in actions.items():
                key = term_index.get(sym, sym)
                if action is Shift:
                    row[key] = (True, arg)
                else:
                    row[key] = (False, (arg.origin.name, len(arg.expansion)))
            self._table[state] = row
        self._names = names
        self._end_state = parse_table.end_states[start]
        self._nodes: list[tuple[int, int]] = []  # stack id -> (state, parent id)
        self._ids: dict[tuple[int, int], int] = {}
        self._feed: dict[tuple[int, int], int] = {}
        self._accepts_end: dict[int, bool] = {}
        self._allowed: dict[int, frozenset[int]] = {}
        self.start = self._push(REJECT, parse_table.start_states[start])

    def _push(self, parent: int, state: int) -> int:
        key = (state, parent)
        node = self._ids.get(key)
        if node is None:
            node = len(self._nodes)
            self._nodes.append(key)
            self._ids[key] = node
        return node

    def _run(self, stack: int, symbol) -> int:
        """Reduce as needed, then shift `symbol`; REJECT if the parser errors first.
        For END, returns the stack when the input is accepted."""
        nodes, table = self._nodes, self._table
        while True:
            state = nodes[stack][0]
            act = table[state].get(symbol)
            if act is None:
                return REJECT
            is_shift, arg = act
            if is_shift:
                return self._push(stack, arg)
            lhs, size = arg
            for _ in range(size):
                stack = nodes[stack][1]
            is_shift, goto = table[nodes[stack][0]][lhs]
            stack = self._push(stack, goto)
            if symbol == END and goto == self._end_state:
                return stack

    def feed(self, stack: int, term: int) -> int:
        """The stack after terminal `term` (a lexer index), or REJECT."""
        key = (stack, term)
        hit = self._feed.get(key)
        if hit is None:
            hit = self._feed[key] = self._run(stack, term)
        return hit

    def accepts_end(self, stack: int) -> bool:
        hit = self._accepts_end.get(stack)
        if hit is None:
            hit = self._accepts_end[stack] = self._run(stack, END) != REJECT
        return hit

    def allowed(self, stack: int) -> frozenset[int]:
        """Terminals that can really be shifted next (LALR may reduce on a look-ahead that
        only fails later, so each candidate is tried)."""
        hit = self._allowed.get(stack)
        if hit is None:
            row = self._table[self._nodes[stack][0]]
            hit = frozenset(t for t in row if isinstance(t, int) and self.feed(stack, t) != REJECT)
            self._allowed[stack] = hit
        return hit

    def __len__(self) -> int:
        return len(self._nodes)
