"""Budget-closed decoding: a constrained output that always completes within max_new_tokens.

A grammar only guarantees a valid document if generation finishes; a tool call cut by the
token budget is not JSON. `Closer` knows, for every state of a regular grammar, how many
tokens the shortest completion from there takes, and `ClosingGrammar` wraps a request's
grammar (any engine) so that, with R tokens of budget left, the mask allows only tokens after
which the rest still fits: `need(state after t) <= R - 1`. When R reaches the need, the only
tokens left are the ones on a shortest completion, so the document closes on the last token.

The shadow automaton: the spec's regex (json_schema -> loom's regex, tool calls and choices
are regexes already) compiled by interegular to a character DFA and stepped per UTF-8 byte
(`TerminalFSM`), enumerated into a dense table `[state, byte] -> state` (live states only).
It runs beside the engine's own matcher, one byte string per accepted token, so the engine
underneath does not matter (llguidance, xgrammar and outlines all take it).

need(q), in tokens: the byte-shortest completion w(q) comes from a reverse breadth-first
search (`dist`, with one next byte per state); its suffixes are w of the states along it, so
the fewest tokens that spell w(q) is a dynamic program over those states:
need(q) = 1 + min over tokens t that spell a prefix of w(q) of need(state after t). Computed
once per compiled closer for every state, in order of distance. Along that token need falls
by exactly one, so whenever need(q) <= R some allowed token keeps need <= R - 1: steering
never runs out of tokens (except where the engine's mask is tighter than the bytes, see
`ClosingGrammar.fill_mask`).

Per state, the successors of every token come from one walk of the vocabulary's trie against
the dense table (numpy, one step per trie level), cached by state. Steering only starts when
R - 1 < the largest need of any state (`max_need`): before that no token can overrun, and the
wrapper costs one comparison a row.

Grammars without a regular form (ebnf, lark, recursive JSON schemas) have no closer: the
request field `close_within_budget` is refused for them by name.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np

from .base import Bitmask, Grammar, GrammarError, bitmask_row

INF = 32767  # need of a state that cannot complete (int16)
MAX_STATES = 50_000
SUCC_CACHE_BYTES = 64 << 20
FIELD = "close_within_budget"
_LEADS = tuple(range(0xC2, 0xF5))  # UTF-8 lead bytes (fsm.py refuses the others)
_CONTINUATION = tuple(range(0x80, 0xC0))


def closing_regex(kind: str, spec: Any, json_options=None) -> str:
    """The regex a closer is built from, or GrammarError naming the field when the kind has
    no regular form."""
    if kind == "regex":  # interegular reads \d \w \s as ASCII, as the engines' forms do
        return spec
    if kind == "choices":
        from .choices import choices_to_regex

        return choices_to_regex(list(spec))
    if kind == "json_schema":
        from .json_schema import NeedsCFG, has_recursive_ref, json_schema_to_regex

        schema = json.loads(spec) if isinstance(spec, str) else spec
        if has_recursive_ref(schema):
            raise GrammarError(f"{FIELD}: not supported for recursive JSON schemas (no regular "
                               "form to count the shortest completion on)")  # fmt: skip
        try:
            return json_schema_to_regex(schema, json_options)
        except NeedsCFG as e:
            raise GrammarError(f"{FIELD}: this JSON schema has no regular form ({e})") from None
    raise GrammarError(f"{FIELD}: supported for regex, json_schema, choices and tool calls, "
                       f"not for {kind} grammars")  # fmt: skip


class Closer:
    """The shared, immutable part: dense byte DFA of the spec, need per state, and the
    vocabulary's trie. `succ_need(q)` is cached per state (a bounded LRU)."""

    def __init__(self, regex: str, vocab):
        from .ebnf.fsm import TerminalFSM
        from .ebnf.trie import get_trie

        fsm = TerminalFSM("closing", regex, allow_empty=True)
        self.vocab = vocab
        self.trie = get_trie(vocab)
        self.table, final = _dense(fsm)
        self.need = _need(self.table, final, vocab)
        finite = self.need[self.need < INF]
        self.max_need = int(finite.max()) if len(finite) else 0
        # need of "no state" (-1: the token is dead in the shadow) is INF
        self._need_ext = np.append(self.need, np.int16(INF))
        self._succ: OrderedDict[int, tuple[np.ndarray, int]] = OrderedDict()
        self._succ_limit = max(16, SUCC_CACHE_BYTES // (2 * self.trie.n_words * 32))

    @property
    def initial(self) -> int:
        return 0

    def step(self, q: int, data: bytes) -> int:
        """The state after `data`; -1 when the shadow refuses it."""
        for b in data:
            q = int(self.table[q, b])
            if q < 0:
                return -1
        return q

    def succ_need(self, q: int) -> tuple[np.ndarray, int]:
        """(need after each token id [n_words * 32] int16, INF where the token is refused;
        the largest finite value)."""
        hit = self._succ.get(q)
        if hit is not None:
            self._succ.move_to_end(q)
            return hit
        trie = self.trie
        node_state = np.full(len(trie) + 1, -1, dtype=np.int32)
        states = np.array([q], dtype=np.int32)
        for nodes, parents, bytes_ in trie.levels:
            src = states[parents]
            live = src >= 0
            if not live.any():
                break
            nxt = np.full(len(parents), -1, dtype=np.int32)
            nxt[live] = self.table[src[live], bytes_[live]]
            node_state[nodes] = nxt
            states = nxt
        succ_need = self._need_ext[node_state[trie.token_node]]
        finite = succ_need[succ_need < INF]
        hit = (succ_need, int(finite.max()) if len(finite) else -1)
        self._succ[q] = hit
        if len(self._succ) > self._succ_limit:
            self._succ.popitem(last=False)
        return hit

    def restrictive(self, q: int, remaining: int) -> bool:
        """Whether some token the shadow allows at q would leave more to write than fits."""
        if q < 0 or remaining - 1 >= self.max_need:
            return False
        return self.succ_need(q)[1] > remaining - 1


def _dense(fsm) -> tuple[np.ndarray, np.ndarray]:
    """Enumerate the byte states reachable from the start: ([n, 256] int32, -1 = dead;
    [n] bool final)."""
    ids = {fsm.initial: 0}
    order = [fsm.initial]
    rows = []

    def id_of(state) -> int:
        j = ids.get(state)
        if j is None:
            if len(order) >= MAX_STATES:
                raise GrammarError(f"{FIELD}: the grammar has more than {MAX_STATES} "
                                   "byte states")  # fmt: skip
            j = ids[state] = len(order)
            order.append(state)
        return j

    i = 0
    while i < len(order):
        row = np.full(256, -1, dtype=np.int32)
        s = order[i]
        if isinstance(s, tuple):  # inside a character: only continuation bytes go on
            steps = _CONTINUATION
        else:
            for target, bytes_ in fsm.ascii_targets(s):
                row[bytes_] = id_of(target)
            steps = _LEADS if fsm.takes_non_ascii(s) else ()
        for b in steps:
            n = fsm.step(s, b)
            if n is not None:
                row[b] = id_of(n)
        rows.append(row)
        i += 1
    final = np.array([fsm.is_final(s) for s in order], dtype=bool)
    return np.stack(rows), final


def _need(table: np.ndarray, final: np.ndarray, vocab) -> np.ndarray:
    """Tokens in the fewest-token spelling of each state's byte-shortest completion."""
    n = len(table)
    dist = np.full(n, -1, dtype=np.int64)
    dist[final] = 0
    frontier = final.copy()
    d = 0
    while frontier.any():
        d += 1
        # states with a byte into the frontier, not reached yet
        into = frontier[np.where(table >= 0, table, 0)] & (table >= 0)
        new = into.any(axis=1) & (dist < 0)
        dist[new] = d
        frontier = new
    # one next byte per state, on a shortest path
    next_byte = np.full(n, -1, dtype=np.int64)
    reach = dist >= 0
    for q in np.flatnonzero(reach & (dist > 0)).tolist():
        row = table[q]
        ok = (row >= 0) & (dist[np.where(row >= 0, row, 0)] == dist[q] - 1)
        next_byte[q] = int(np.flatnonzero(ok)[0])
    tokens = {}
    for t, data in enumerate(vocab.token_bytes):
        if data and t not in vocab.eos_token_ids and data not in tokens:
            tokens[data] = t
    longest = max(map(len, tokens), default=1)
    need = np.full(n, INF, dtype=np.int16)
    need[final] = 0
    for q in np.argsort(dist, kind="stable").tolist():
        if dist[q] <= 0:
            continue
        best, piece, s = INF, bytearray(), q
        for _ in range(min(longest, int(dist[q]))):
            b = int(next_byte[s])
            piece.append(b)
            s = int(table[s, b])
            if bytes(piece) in tokens and need[s] < INF:
                best = min(best, 1 + int(need[s]))
        need[q] = min(best, INF)
    return need


class ClosingGrammar(Grammar):
    """A request's grammar with the budget steering on top. `budget`: the tokens this grammar
    may still accept when it is attached (max_new_tokens minus the output so far).

    Invariants: `_states[i]` is the shadow state after the first i accepted tokens (-1 once
    the shadow refused one: steering is off from there, the engine goes on alone);
    `steered_at` is the first accepted position whose row the steering restricted, None if
    none (rolled back with the tokens)."""

    def __init__(self, inner: Grammar, closer: Closer, budget: int):
        self.inner = inner
        self.closer = closer
        self.budget = budget
        self._states = [closer.initial]
        self.steered_at: int | None = None

    @classmethod
    def attach(
        cls, inner: Grammar, closer: Closer, max_new_tokens: int, output_ids
    ) -> ClosingGrammar:
        """Wrap a grammar that has already accepted `output_ids` (a closer built after the
        request started): the shadow replays them."""
        g = cls(inner, closer, max_new_tokens)
        for t in output_ids:
            g._advance(t)
        return g

    @property
    def _n(self) -> int:
        return len(self._states) - 1

    @property
    def budget_closed(self) -> bool:
        """Steered, and the document is complete (the engine says so, or the shadow stands in
        a final state): a budget under the shortest completion is steered from its first token
        too, but ends cut and must not be reported closed."""
        if self.steered_at is None:
            return False
        q = self._states[-1]
        return self.inner.is_terminated() or (q >= 0 and bool(self.closer.need[q] == 0))

    def _active(self) -> tuple[int, int] | None:
        """(shadow state, tokens left) when the steering restricts this row, else None."""
        q = self._states[-1]
        remaining = self.budget - self._n
        if remaining <= 0 or not self.closer.restrictive(q, remaining):
            return None
        return q, remaining

    def fill_mask(self, bitmask: Bitmask, row: int) -> None:
        self.inner.fill_mask(bitmask, row)
        active = self._active()
        if active is None:
            return
        q, remaining = active
        succ_need, _ = self.closer.succ_need(q)
        words = succ_need.shape[0] // 32
        target = bitmask_row(bitmask, row)[:words]
        inner_bits = np.unpackbits(target.view(np.uint8), bitorder="little").astype(bool)
        fits = succ_need <= remaining - 1
        fits[list(self.closer.trie.eos_token_ids)] = True  # ending always fits
        keep = inner_bits & fits
        if not keep.any():
            # the engine allows none of the shadow's fitting tokens (llguidance at a forced
            # state allows only the forced text's own tokenization): its tokens that leave
            # the least to write
            least = succ_need[inner_bits].min(initial=INF)
            keep = inner_bits & (succ_need <= least)
            if not keep.any():
                return
        target[:] = np.packbits(keep, bitorder="little").view(np.int32)

    def accept_token(self, token_id: int) -> None:
        self.inner.accept_token(token_id)
        if self.steered_at is None and self._active() is not None:
            self.steered_at = self._n
        self._advance(token_id)

    def _advance(self, token_id: int) -> None:
        q = self._states[-1]
        vocab = self.closer.vocab
        if q < 0 or token_id in vocab.eos_token_ids:
            self._states.append(q)  # EOS ends the output where it is
            return
        data = vocab.token_bytes[token_id] if token_id < vocab.vocab_size else None
        # the shadow refusing a token the engine took (the two read a regex a little
        # differently): steering is off from here on, the engine's own mask goes on alone
        self._states.append(self.closer.step(q, data) if data else -1)

    def rollback(self, k: int) -> None:
        self.inner.rollback(k)
        if k:
            del self._states[-k:]
            if self.steered_at is not None and self.steered_at >= self._n:
                self.steered_at = None

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def jump_forward(self) -> str | None:
        return self.inner.jump_forward()

    def is_forced(self) -> bool:
        # a restricted row's mask is tighter than `accept_token`: the lazy greedy rows
        # (runtime/step_grammar.py `LazyRows`) must mask it instead of trusting an accept
        return self._active() is not None or self.inner.is_forced()

    def forced_token(self) -> int | None:
        if self._active() is not None:
            return None
        return self.inner.forced_token()

    def copy(self) -> ClosingGrammar:
        g = ClosingGrammar(self.inner.copy(), self.closer, self.budget)
        g._states = list(self._states)
        g.steered_at = self.steered_at
        return g
