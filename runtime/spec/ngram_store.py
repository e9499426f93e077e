"""The n-gram trie's node store: nodes as integer ids, out of the cyclic collector's sight.

`ngram_store_c.new_ngram_store` returns the C store (`ngram_store_c.CNgramTrie`: the same
ids, fields and eviction in C arrays, no Python object per node) where a C compiler is found;
the Python store below (`PyNgramTrie`) is the fallback and the reference it is tested
against. Both
answer the drafter's queries through the same methods (`extend_many`, `match`, `deepest`,
`best_child`, `recent_child`, `child`, `children`, `has_kids`), so no reader indexes a
store's containers.

A long-running scheduler's trie holds up to `capacity` (1,000,000) nodes. As objects (a
`__slots__` node with a children dict each) they were ~2 M containers the cyclic collector
tracked outside the frozen start-up heap: one full collection at capacity took ~750 ms, a
stall of the scheduler whenever any allocation triggered one. The trie needs no cyclic
collection (an eviction unlinks its node), so here a node is an id (the root is 0), its
fields are entries of int arrays and lists, and its children a dict token -> id: a dict whose
keys and values are all ints is not tracked, an array holds no objects, a list of ints is one
tracked object however long, so the store is a handful of tracked objects at any size (a full
collection still reads each entry of the lists: ~45 ms at capacity, `PyNgramTrie.__init__`).
An evicted id goes to a free list and is reused by a later node.

A request's suffix pointers (`extend`) are ids, and an id names another node once reused, so
pointers held across other requests' inserts are checked with `fresh(pointers, at)` (`at`:
the trie's clock when they were made) before use: they end before the first node evicted
since (the longer suffixes regrow one a token, as after `NgramLookup.catch_up`).

Bounded: at most `capacity` nodes, the least recently touched evicted first, approximately
(an evicted node's subtree is cut off with it and ages out of the queue in turn): the queue
holds nodes in creation order and a touch only stamps the node; eviction gives a node touched
since it was queued a second chance at the back (CLOCK), so a token seen costs no queue move
per node (`move_to_end` was a quarter of an insert).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

SECOND_CHANCES = 64  # queue moves an eviction makes at most per node it evicts
ROOT = 0
CUT = -1  # the parent of a node cut off by its parent's eviction
_GROW = 4096  # ids added to the store at a time


def fresh_pointers(trie, pointers: list[int], at: int) -> list[int]:
    """A store's `fresh`: `pointers` as made at clock `at`, up to the first node evicted
    since (its id may name a newer node now)."""
    if trie.evicted_at <= at:
        return pointers
    died = trie.died
    for i, p in enumerate(pointers):
        if died[p] > at:
            return pointers[:i]
    return pointers


def store_queue(trie) -> Iterator[int]:
    """A store's eviction queue, front first (both stores chain it through `nxt`)."""
    nxt = trie.nxt
    x = nxt[ROOT]
    while x != ROOT:
        yield x
        x = nxt[x]


def check_store(trie) -> None:
    """A store's invariants (tests), through the interface both stores share: every id is
    the root, queued once, or free; a queued node is its parent's child for its token unless
    cut off; a free id is dead."""
    order, free_ids = list(trie.queue()), trie.free_ids()
    queued, free = set(order), set(free_ids)
    assert len(queued) == len(order) == trie.size and len(free) == len(free_ids)
    assert trie.tail == (order[-1] if order else ROOT)
    assert not queued & free and queued | free | {ROOT} == set(range(trie.n_ids))
    for x in queued:
        p = trie.parent[x]
        assert trie.alive(x)
        assert p < 0 or trie.child(p, trie.token[x]) == x
        assert all(trie.parent[c] == x for c in trie.children(x))
    assert not any(trie.alive(x) for x in free)


class PyNgramTrie:
    """The store in Python objects: the reference the C store is tested against, and the
    store where no C compiler is found. Per node id: `kids` (token -> child id; None: a free id), `count` (times seen),
    `stamp` (clock when last seen), `ostamp` (clock when last seen as a generated token; 0:
    prompts only), `queued` (clock when it took its place in the eviction queue), `nxt` (the
    next id in the queue; the root's: the queue's front, 0: its end), `parent` (CUT: cut off
    by its parent's eviction), `token`, `died` (clock when last evicted; 0: never)."""

    def __init__(self, depth: int, capacity: int):
        self.depth = depth
        self.capacity = capacity
        self.root = ROOT
        self.kids: list[dict[int, int] | None] = [{}]
        # the fields every token touches are lists: CPython 3.11 specializes a list's
        # index, not an array's (as arrays too, bench_ngram_trie's drafting ran 1.05-1.3x
        # the `_Node` trie's time); a full collection reads a list of a million ints in
        # ~10 ms, the kids list in ~16; the other fields are arrays, never read by it
        self.count, self.stamp, self.ostamp = [0], [0], [0]
        self.queued, self.nxt, self.died = array("q", [0]), array("q", [0]), array("q", [0])
        self.parent, self.token = array("q", [CUT]), array("q", [-1])
        self.tail = ROOT  # the queue's back (the root: empty)
        self.size = 0  # nodes in the queue: every node but the root
        self.free = array("q")  # ids to reuse, the next one last
        self.clock = 0
        self.evicted_at = 0  # the clock of the last eviction
        # child orders (closures over the fields, which are never replaced)
        stamp, ostamp, count = self.stamp, self.ostamp, self.count
        # BFS: what a model generated there most recently first, then what was seen there
        # most recently (prompt text). A model's answers follow its own earlier answers'
        # shape (`\nQ: What's the capital city of`) over the prompt's, which the newest
        # request's prompt would otherwise win by recency alone.
        self.recency = lambda c: (ostamp[c], stamp[c])
        self.frequency = lambda c: (count[c], stamp[c])  # PROB

    def __len__(self) -> int:
        return self.size

    @property
    def n_ids(self) -> int:
        """Ids made so far (root, queued and free)."""
        return len(self.kids)

    def free_ids(self) -> list[int]:
        return self.free.tolist()

    def alive(self, node: int) -> bool:
        return self.kids[node] is not None

    def child(self, node: int, token: int) -> int | None:
        return self.kids[node].get(token)

    def has_kids(self, node: int) -> bool:
        return bool(self.kids[node])

    def children(self, node: int) -> list[int]:
        """Its children, in insertion order."""
        return list(self.kids[node].values())

    def best_child(self, node: int, by_count: bool = False) -> int | None:
        """The child ranked highest (`frequency` with by_count, else `recency`), the first
        inserted among equals; None: no child."""
        kids = self.kids[node]
        return (
            max(kids.values(), key=self.frequency if by_count else self.recency) if kids else None
        )

    def recent_child(
        self, parent: int, other_than: int = -1, generated: bool = False, scan: int = 1 << 62
    ) -> int | None:
        """Among the first `scan` children of `parent` that have a continuation (and are not
        `other_than`; with `generated`, that a model wrote), the most recent (`recency`)."""
        kids, ostamp, recency = self.kids, self.ostamp, self.recency
        best = None
        for n, sib in enumerate(kids[parent].values()):
            if n >= scan:
                break
            if sib == other_than or not kids[sib] or (generated and not ostamp[sib]):
                continue
            if best is None or recency(sib) > recency(best):
                best = sib
        return best

    def match(
        self,
        pointers: list[int],
        after: Sequence[int],
        windows: tuple[int, int],
        skip: bool,
        skip_min_context: int,
        skip_scan: int,
    ) -> int | None:
        """`NgramLookup._match`'s search (the policy is described there): the deepest
        window w of `windows` (min, max; min >= 1) of the suffix `pointers` (the nodes of
        the suffixes of 1, 2, .. tokens) + `after` whose node has a continuation; with
        `skip` and no `after`, a sibling of a new last token after a known context
        instead (`_skip_sibling`). None: none."""
        k = len(after)
        for w in range(windows[1], windows[0] - 1, -1):
            if w > k:
                i = w - k - 1  # pointer of the suffix of length w - k (ascending depth)
                if i >= len(pointers):
                    continue
                node = self.walk(pointers[i], after)
            else:
                node = self.walk(ROOT, after[k - w :])
            if node is not None and self.kids[node]:
                if k == 0 and skip:
                    return self._skip_sibling(pointers, w, windows[1], skip_min_context, skip_scan)
                return node
        if k == 0 and skip:
            return self._skip_sibling(pointers, 0, windows[1], skip_min_context, skip_scan)
        return None

    def _skip_sibling(
        self, pointers: list[int], exact: int, max_window: int, min_context: int, scan: int
    ) -> int | None:
        """For the suffixes longer than `exact` (and than min_context - 1 tokens of context)
        whose last token is new after their context, longest first and a model's siblings
        before any: the most recent sibling (`recent_child` over the first `scan`); else the
        node of the exact match's window (None: none)."""
        exact_node = pointers[exact - 1] if 0 < exact <= len(pointers) else None
        parent, kids = self.parent, self.kids
        lo = max(exact, min_context - 1)
        for generated in (True, False):
            for i in range(min(len(pointers), max_window) - 1, lo, -1):
                mine = pointers[i]  # the suffix of i + 1 tokens; its parent: the i before the last
                if parent[mine] == CUT or kids[mine]:
                    continue  # evicted, or not new here (the exact match covers it)
                best = self.recent_child(parent[mine], mine, generated, scan)
                if best is not None:
                    return best
        return exact_node

    def deepest(self, tokens: Sequence[int], min_window: int) -> int | None:
        """The node of the longest suffix of `tokens` (at least min_window >= 1 long) that
        the trie holds with a continuation (None: none)."""
        for k in range(len(tokens), min_window - 1, -1):
            node = self.walk(ROOT, tokens[len(tokens) - k :])
            if node is not None and self.kids[node]:
                return node
        return None

    def extend_many(
        self, pointers: list[int], tokens: Sequence[int], generated_from: int
    ) -> list[int]:
        """`extend` for each of `tokens` in turn, tokens[i] generated when i >=
        generated_from; returns the last pointers."""
        for i, t in enumerate(tokens):
            pointers = self.extend(pointers, t, i >= generated_from)
        return pointers

    def _grow(self) -> None:
        """_GROW more free ids (fields 0: each is set as its node is created)."""
        n = len(self.kids)
        zeros = array("q", bytes(8 * _GROW))
        for field in (self.queued, self.nxt, self.parent, self.token, self.died):
            field.extend(zeros)
        for field in (self.count, self.stamp, self.ostamp):
            field.extend([0] * _GROW)
        self.kids.extend([None] * _GROW)
        self.free.extend(range(n + _GROW - 1, n - 1, -1))  # ascending ids popped first

    def extend(self, pointers: list[int], token: int, generated: bool = False) -> list[int]:
        """Append `token` after every suffix in `pointers` (ascending depth, as `extend`
        returned them and `fresh` checked them); returns the new suffix pointers (ascending
        depth, the full-length window left out). `generated`: the token is a model output
        (not prompt text)."""
        self.clock += 1
        clock, kids, free, nxt, tail = self.clock, self.kids, self.free, self.nxt, self.tail
        added = 0
        count, stamp, ostamp = self.count, self.stamp, self.ostamp
        queued, parent, tokens = self.queued, self.parent, self.token
        out = []
        # inlined (no call per node): a prompt's first draft inserts ~depth nodes a token
        for node in (ROOT, *pointers):
            child = kids[node].get(token)
            if child is None:
                if not free:
                    self._grow()
                child = free.pop()
                kids[node][token] = child
                kids[child] = {}
                count[child] = 1
                ostamp[child] = clock if generated else 0
                queued[child] = clock
                parent[child] = node
                tokens[child] = token
                nxt[tail] = child  # to the queue's back
                tail = child
                added += 1
            else:
                count[child] += 1
                if generated:
                    ostamp[child] = clock
            stamp[child] = clock
            out.append(child)
        if added:
            nxt[tail] = ROOT
            self.tail = tail
            self.size += added
        if len(out) >= self.depth:
            out.pop()
        if self.size > self.capacity and self._evict(self.size - self.capacity):
            out = self.fresh(out, clock - 1)
        return out

    def fresh(self, pointers: list[int], at: int) -> list[int]:
        return fresh_pointers(self, pointers, at)

    def _evict(self, n: int) -> bool:
        """Evict n nodes from the front of the queue; a node touched since it was queued goes
        to the back instead (at most SECOND_CHANCES x n moves, then the front goes whatever
        its stamp, so one call stays bounded). Returns whether a node touched at this clock
        went (one `extend` is returning)."""
        chances, clock, tail = SECOND_CHANCES * n, self.clock, self.tail
        kids, parent, token, nxt = self.kids, self.parent, self.token, self.nxt
        stamp, queued, died, free = self.stamp, self.queued, self.died, self.free
        touched = False
        evicted = 0
        while evicted < n:
            x = nxt[ROOT]  # the front
            if x == ROOT:
                break
            if stamp[x] > queued[x] and chances > 0:  # a second chance, at the back
                chances -= 1
                queued[x] = clock
                if x != tail:
                    nxt[ROOT] = nxt[x]
                    nxt[tail] = x
                    nxt[x] = ROOT
                    tail = x
                continue
            nxt[ROOT] = nxt[x]
            if x == tail:
                tail = ROOT
            evicted += 1
            touched |= stamp[x] == clock
            p = parent[x]
            if p >= 0 and kids[p].get(token[x]) == x:
                del kids[p][token[x]]
            for c in kids[x].values():  # its subtree is cut off (and ages out in turn)
                parent[c] = CUT
            kids[x] = None
            died[x] = clock
            free.append(x)
        self.tail = tail
        self.size -= evicted
        self.evicted_at = clock
        return touched

    def queue(self) -> Iterator[int]:
        return store_queue(self)

    def check(self) -> None:
        check_store(self)

    def walk(self, node: int, tokens: Sequence[int]) -> int | None:
        """The node `tokens` lead to from `node` (None: none)."""
        kids = self.kids
        for t in tokens:
            node = kids[node].get(t)
            if node is None:
                return None
        return node
