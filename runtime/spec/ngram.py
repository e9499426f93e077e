"""N-gram drafting (lookahead): a token trie over prompts, outputs and recent requests.

The trie stores every window of `depth` = max match window + branch length consecutive tokens
seen (each request's prompt and output, inserted as they grow). A request keeps `pointers`:
the trie nodes of its current suffixes of length 1 .. depth-1, so appending a token extends each
pointer by one child (O(depth) dict operations, no rebuild) and matching the last w tokens is
reading the pointer at depth w. A draft follows, from the deepest matched suffix that has a
continuation, the most recently seen child (match type BFS) or the most frequent one (PROB).
When the last token is new after a context of 2+ tokens the trie knows (a name, a number in
a JSON value), the draft continues as the most recently seen other token after that context
did (a skip-gram: `"name": "Alice` drafts `", "age": ` learnt from `"name": "Bob", "age": `),
unless an exact match of a longer window exists. Where a chain runs out (a long match leaves
few trie levels below it), its own last tokens are matched again from the root, so a copy
continues past one window (at most MAX_REMATCHES times a draft). Where the answer copies a
word from its prompt at that context (a JSON value: `ngram_copy.PromptCopy`), the draft takes
this prompt's word and goes on as the trie went on after another request's value there.

A free request's decode drafts ask its own tokens first (`ngram_own.OwnIndex`: the
longest earlier window of its prompt tail and output), the trie where they have no match.

The trie (`ngram_store_c.new_ngram_store`: node ids, out of the cyclic collector's sight) holds at
most `capacity` nodes, the least recently touched evicted first. A prompt contributes at most
its last `MAX_PROMPT_TOKENS` tokens, so the first draft of a request costs O(that x depth).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from loom.runtime.spec.ngram_copy import CONTEXT, PromptCopy
from loom.runtime.spec.ngram_corpus import CorpusIndex
from loom.runtime.spec.ngram_own import OWN_WINDOW, OwnIndex
from loom.runtime.spec.ngram_store_c import new_ngram_store

__all__ = ["MAX_PROMPT_TOKENS", "NgramLookup", "NgramState", "new_ngram_store"]

MAX_PROMPT_TOKENS = 2048
SKIP_MIN_CONTEXT = 2  # tokens of context a skip-gram match needs
SKIP_SCAN = 32  # siblings a skip-gram match looks at
CATCHUP_TOKENS = 24  # tokens a request returning to drafting inserts at most (`catch_up`)
MAX_REMATCHES = 2  # times a draft chain that ran out is matched again from its last tokens


class NgramState:
    """A request's place in the trie: its suffix pointers and how many of its tokens the
    trie has seen. Lives on `req.spec_state`."""

    __slots__ = (
        "pointers",
        "at",
        "seen",
        "rates",
        "steps",
        "expected",
        "gains",
        "raw",
        "opening",
        "shadow",
        "skipped",
        "prompt_index",
        "own",
    )

    def __init__(self, num_positions: int):
        self.pointers: list[int] = []  # trie node ids (the store's `extend`)
        self.at = 0  # the trie's clock when `pointers` were made (the store's `fresh`)
        self.seen = 0
        # per draft position: running acceptance rate (given the draft reached it)
        self.rates = [1.0] * num_positions
        self.steps = 0
        self.expected = 0.0  # draft tokens the current draft is expected to get accepted
        self.gains: list[float] | None = []  # per position of the current chain (None: a tree)
        # the chain's chances by the request's rates alone, before the drafter's calibration
        # (`NgramSpeculator._calibrated`; None: not a chain the calibration learns from)
        self.raw: list[float] | None = None
        # which of the drafter's opening-step rates the draft being verified used (-1: the
        # request's own; 0: it rides the prefill; k: the k-th draft after it)
        self.opening = -1
        # a chain drafted but not verified: (tokens, output length then, opening, forced)
        self.shadow: tuple | None = None
        # the request ran in a decode batch too large to draft since it last drafted (its
        # tokens since then are unseen: `NgramLookup.catch_up` bounds what it costs)
        self.skipped = False
        # `PromptCopy.index` of the request's prompt, built at its first copy lookup
        self.prompt_index: dict[int, int] | None = None
        # the request's own n-grams (`NgramLookup.propose` with `own`), built at its first use
        self.own: OwnIndex | None = None


class NgramLookup:
    """The n-gram lookup a drafter asks (not a `Drafter` itself: `NgramSpeculator` is the
    n-gram drafter, `NgramPolicy` the head drafters' constrained fallback).
    `propose(req, max_len, after=())`: up to max_len tokens the request's history predicts
    after its current tokens followed by `after` (forced text not yet in the sequence).
    `copy` (a `PromptCopy`, or None): words the answer copies from its prompt."""

    def __init__(
        self,
        min_window: int,
        max_window: int,
        branch_length: int,
        capacity: int,
        match_type: str = "BFS",
    ):
        assert 1 <= min_window <= max_window
        self.min_window = min_window
        self.max_window = max_window
        self.branch_length = branch_length
        self.trie = new_ngram_store(max_window + branch_length, capacity)
        self.by_count = match_type.upper() == "PROB"
        self.copy: PromptCopy | None = None
        # a read-only datastore of text written on other prompts (`ngram_corpus`), asked
        # where the request's own tokens and the trie have no match
        self.corpus: CorpusIndex | None = None
        self.corpus_min_window = 1
        self.corpus_order = "last"  # "last": own, trie, corpus; "before-trie": own, corpus, trie

    def _corpus(self, req, after: Sequence[int], max_len: int) -> list[int]:
        n = req.seq_len
        w = self.corpus.window
        context = (req.tokens(max(0, n - w), n) + list(after))[-w:]
        return self.corpus.propose(context, max_len, self.corpus_min_window)

    def observe(
        self, req, state: NgramState, prompt_tail: int = MAX_PROMPT_TOKENS, limit: int = 1 << 30
    ) -> bool:
        """Insert the request's tokens the trie has not seen yet (of its prompt, at most the
        last `prompt_tail` tokens; at most `limit` tokens this call). Returns whether it
        has seen them all."""
        n = req.seq_len
        trie = self.trie
        state.pointers, state.at = trie.fresh(state.pointers, state.at), trie.clock
        if state.seen > n:  # the tail was rewritten: start the suffixes afresh
            state.pointers, state.seen = [], 0
        if state.seen == 0:
            state.seen = max(0, len(req.origin_input_ids) - prompt_tail)
        end = min(n, state.seen + limit)
        if state.seen < end:
            tokens = req.tokens(state.seen, end)
            generated_from = len(req.origin_input_ids) - state.seen  # outputs from there on
            state.pointers = trie.extend_many(state.pointers, tokens, generated_from)
            state.at = trie.clock
            state.seen = end
        return end == n

    def catch_up(self, req, state: NgramState) -> None:
        """A request that drafts again after steps in a batch too large to draft: the trie
        sees only its last CATCHUP_TOKENS tokens (at least the depth - 1 its suffix pointers
        need), not every token since it last drafted. A batch shrinking under the size
        threshold would otherwise insert all of them, ~depth trie nodes a token, for each
        of its requests in one step (chat at batch 16: ~100 tokens x 19 nodes a request)."""
        state.skipped = False
        keep = max(CATCHUP_TOKENS, self.trie.depth - 1)
        if req.seq_len - state.seen > keep:
            state.pointers, state.seen = [], req.seq_len - keep

    def propose(
        self,
        req,
        state: NgramState,
        max_len: int,
        after: Sequence[int] = (),
        skip: bool = True,
        own: bool = False,
    ) -> list[int]:
        """The chain from the matched node; where it runs out (the trie keeps windows of
        `depth` tokens, and a long match leaves few below it), the last tokens drafted so far
        are matched again from the root, so a copy continues past one window. `skip`: False
        takes the exact match where a skip-gram would answer (`_match`). `own` (and no
        `after`): the request's own tokens' continuation first (`ngram_own.OwnIndex`), the
        trie's where they have no match."""
        self.observe(req, state)
        if own and not after:
            draft = self._own(req, state).propose(max_len, self.min_window)
            if draft:
                return draft
        corpus = self.corpus is not None and max_len > 0
        if corpus and self.corpus_order == "before-trie":
            draft = self._corpus(req, after, max_len)
            if draft:
                return draft
        node = self._match(state.pointers, after, skip)
        if node is None and corpus and self.corpus_order == "last":
            return self._corpus(req, after, max_len)
        draft: list[int] = []
        rematches = 0
        copy = self.copy
        trie, by_count = self.trie, self.by_count
        token = trie.token
        if copy is not None:  # the last CONTEXT tokens before the next draft token
            n = req.seq_len
            context = (req.tokens(max(0, n - CONTEXT), n) + list(after))[-CONTEXT:]
            prompt = req.origin_input_ids
            if state.prompt_index is None:  # the prompt's part the trie holds too
                state.prompt_index = copy.index(prompt, max(0, len(prompt) - MAX_PROMPT_TOKENS))
        while node is not None and len(draft) < max_len:
            word = copy.draft(prompt, state.prompt_index, tuple(context)) if copy else None
            if word:
                child = trie.child(node, word[0])
                if child is None:  # a value no request wrote here: the trie goes on
                    word = word[: max_len - len(draft)]  # as it did after another's
                    draft += word
                    context = (context + word)[-CONTEXT:]
                    node = self._after_value(node)
                    continue
                node = child
            else:
                child = trie.best_child(node, by_count)
                if child is None:
                    if not draft or rematches >= MAX_REMATCHES:
                        break
                    rematches += 1
                    node = self._rematch(req, after, draft)
                    continue
                node = child
            draft.append(token[node])
            if copy is not None:
                context = (context + [token[node]])[-CONTEXT:]
        return draft

    def _own(self, req, state: NgramState) -> OwnIndex:
        """The request's `OwnIndex`, caught up with its tokens (its prompt's last
        MAX_PROMPT_TOKENS, as the trie takes); made afresh if its sequence got shorter (a
        rewritten tail: jump-forward re-tokenising, which only constrained requests do, and
        they never ask it)."""
        index, n = state.own, req.seq_len
        if index is None or index.seen > n:
            start = max(0, len(req.origin_input_ids) - MAX_PROMPT_TOKENS)
            index = state.own = OwnIndex(min(self.max_window, OWN_WINDOW), start)
        if index.seen < n:
            index.extend(req.tokens(index.seen, n))
        return index

    def _after_value(self, slot: int) -> int | None:
        """Where the trie goes on after a copied word at `slot`: the most recently generated
        value there (a child with a continuation), followed through its word pieces (`4`
        `8` of an age), so its node's children are what came after it (`,` then the next
        key; `"}` after a city). None: no value there was followed by anything."""
        trie = self.trie
        node = trie.recent_child(slot, scan=SKIP_SCAN)
        while node is not None:
            nxt = trie.best_child(node)
            if nxt is None:
                return None
            if not self.copy.is_piece(trie.token[nxt]):
                return node
            node = nxt
        return None

    def _rematch(self, req, after: Sequence[int], draft: list[int]) -> int | None:
        """The deepest node with a continuation for the last max_window tokens of the
        request's tokens + `after` + `draft` (None: no window of them has one)."""
        w = self.max_window
        tail = list(after) + draft
        if len(tail) < w:
            n = req.seq_len
            tail = req.tokens(max(0, n - (w - len(tail))), n) + tail
        return self.trie.deepest(tail[-w:], self.min_window)

    def propose_tree(
        self,
        req,
        state: NgramState,
        max_nodes: int,
        max_depth: int,
        breadth: tuple[int, int],
        after: Sequence[int] = (),
    ) -> tuple[list[int], list[int]]:
        """A draft tree (tokens, parents; parent -1 = after `after`) of at most max_nodes
        nodes and max_depth levels, grown best-first from the matched trie node: the next node
        is the continuation with the highest estimated chance (the product of count shares
        along its path), at most breadth(depth) children per node, where breadth goes from
        breadth[1] at depth 0 down to breadth[0], halving per level. A confident history
        yields a chain; branches appear where the history disagrees."""
        self.observe(req, state)
        start = self._match(state.pointers, after)
        tokens: list[int] = []
        parents: list[int] = []
        if start is None or max_nodes <= 0 or max_depth <= 0:
            return tokens, parents
        lo, hi = breadth
        heap: list[tuple[float, int, int, int, int]] = []
        tie = 0
        trie = self.trie
        count = trie.count
        rank = trie.frequency if self.by_count else trie.recency

        def push(node: int, parent: int, depth: int, chance: float) -> None:
            nonlocal tie
            kids = trie.children(node) if depth < max_depth else []
            if not kids:
                return
            total = sum(count[c] for c in kids)
            kids.sort(key=rank, reverse=True)
            for c in kids[: max(lo, hi >> depth)]:
                tie += 1
                heapq.heappush(heap, (-chance * count[c] / total, tie, c, parent, depth))

        push(start, -1, 0, 1.0)
        while heap and len(tokens) < max_nodes:
            neg, _, node, parent, depth = heapq.heappop(heap)
            tokens.append(trie.token[node])
            parents.append(parent)
            push(node, len(tokens) - 1, depth + 1, -neg)
        return tokens, parents

    def _match(self, pointers: list[int], after: Sequence[int], skip: bool = True) -> int | None:
        """The deepest node (suffix length in the match window) of current tokens + `after`
        that has a continuation; or, when the last token is new after a longer context
        (a name, a number), a sibling's node (skip-gram fallback, `skip` and no `after`):
        the context before the last token (at least SKIP_MIN_CONTEXT and more than the
        exact match's window) was seen, the last token after it was not (`"name": "` then
        a new name): continue as the most recently seen other token after that context did
        (`", "age": `), a sibling a model generated first (any context length, longest
        first: an answer's `<city>\nQ:` follows the earlier answers', not the prompt's `The
        capital of`), then any; else the exact match's node. One store call
        (the store's `match`: in C, the loops cost one call)."""
        windows = (self.min_window, self.max_window)
        return self.trie.match(pointers, after, windows, skip, SKIP_MIN_CONTEXT, SKIP_SCAN)
