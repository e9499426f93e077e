"""The n-gram trie's node store in C: `ngram_store.PyNgramTrie`'s ids, fields and eviction,
with no Python object per node.

The Python store keeps a dict (token -> child id) per node and its fields in lists: a token
inserts up to depth (~19-30) nodes, each a dict lookup, often a new dict and PyLongs, ~15 us
a token, most of it in making and filling those objects (updating them from C through the
C API saved a third). Here the fields are int64 arrays in one anonymous mmap (pages
materialize as ids are first used: ids are handed out ascending), a node's children are a
doubly linked sibling list in insertion order (a dict's order: a deleted key re-inserted goes
last), and one open-addressing table maps (parent, token) -> child. A table slot holds only
the child id (0: empty, the root is nobody's child); its key is the child's own parent and
token fields, so a node's entry is deleted before its parent field changes.

Same semantics, field for field, as the Python store (tests/test_spec_ngram_store.py runs
random streams through both and compares every field, child order and pointer): the same
ids (a free stack, grown _GROW ids at a time, ascending ids popped first), the same CLOCK
queue and SECOND_CHANCES, the same `fresh` after an eviction. `extend` takes many tokens in
one call (`NgramDrafter.observe` inserts a request's new tokens at once). The readers'
loops over a node's children (the most recent / frequent child, the skip-gram's sibling
scan) are C calls too; the fields a reader indexes (`token`, `count`, `stamp`, `ostamp`,
`parent`, `died`) are memoryviews over the arrays.
"""

from __future__ import annotations

import ctypes
import mmap
from array import array
from collections.abc import Iterator, Sequence

from loom.runtime import cpu_kernels
from loom.runtime.spec.ngram_store import (
    _GROW,
    CUT,
    ROOT,
    SECOND_CHANCES,
    check_store,
    fresh_pointers,
    store_queue,
)

# header slots (int64) at the start of the mapping, then the fields, max_ids entries each
_H = ("depth", "capacity", "max_ids", "n_ids", "size", "tail", "clock", "evicted_at",
      "nfree", "table", "mask")  # fmt: skip
_HEADER = 16
_N_IDS, _SIZE, _TAIL, _CLOCK, _EVICTED_AT, _NFREE = (
    _H.index(name) for name in ("n_ids", "size", "tail", "clock", "evicted_at", "nfree")
)
# a node's record (C's Node): 16 int64 fields; then the free stack, max_ids entries
_FIELDS = ("parent", "token", "count", "stamp", "ostamp", "queued", "nxt", "died",
           "first", "last", "next", "prev", "nkids", "live")  # fmt: skip
_RECORD = 16

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>

enum { DEPTH, CAPACITY, MAX_IDS, N_IDS, SIZE, TAIL, CLOCK, EVICTED_AT, NFREE, TABLE, MASK,
       HEADER = 16 };
#define ROOT 0
#define CUT (-1)
#define GROW __GROW__
#define SECOND_CHANCES __CHANCES__

/* a node's record, two cache lines: what a token or an eviction reads first, the links */
typedef struct {
    int64_t parent, token, count, stamp, ostamp, queued, nxt, died;
    int64_t first, last, next, prev, nkids, live, pad0, pad1;
} Node;

/* a table slot: key (parent << 32 | token) -> child (0: empty) */
typedef struct {
    uint64_t key;
    int64_t child;
} Slot;

typedef struct {
    int64_t *h, *free;
    Node *n;
    Slot *table;
    uint64_t mask;
} T;

static T view(int64_t *h) {
    T t;
    t.h = h;
    t.n = (Node *)(h + HEADER);
    t.free = h + HEADER + 16 * h[MAX_IDS];
    t.table = (Slot *)(intptr_t)h[TABLE];
    t.mask = (uint64_t)h[MASK];
    return t;
}

/* tokens are vocabulary ids: 0 <= token < 2^32 (extend refuses others, lookups miss) */
static inline int token_ok(int64_t tok) { return tok >= 0 && tok <= 0xFFFFFFFFll; }
static inline uint64_t key_of(int64_t p, int64_t tok) {
    return (uint64_t)p << 32 | (uint64_t)tok;
}

static inline uint64_t slot_of(uint64_t key, uint64_t mask) {
    uint64_t x = key * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return x & mask;
}

static inline int64_t lookup(const T *t, int64_t p, int64_t tok) {
    if (!token_ok(tok)) return 0;
    uint64_t key = key_of(p, tok);
    for (uint64_t i = slot_of(key, t->mask);; i = (i + 1) & t->mask) {
        const Slot *s = &t->table[i];
        if (s->child == 0) return 0;
        if (s->key == key) return s->child;
    }
}

static inline void table_put(T *t, uint64_t key, int64_t c) {
    uint64_t i = slot_of(key, t->mask);
    while (t->table[i].child != 0) i = (i + 1) & t->mask;
    t->table[i].key = key;
    t->table[i].child = c;
}

/* the entry for c (filed under key) out; linear probing's backward shift keeps every other
   entry reachable without tombstones */
static void table_del(T *t, uint64_t key) {
    uint64_t mask = t->mask, i = slot_of(key, mask);
    while (t->table[i].key != key || t->table[i].child == 0) i = (i + 1) & mask;
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Slot e = t->table[j];
        if (e.child == 0) break;
        uint64_t home = slot_of(e.key, mask);
        /* e may fill the hole at i when its home is not cyclically in (i, j] */
        if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
            t->table[i] = e;
            i = j;
        }
    }
    t->table[i].child = 0;
}

/* a table of at least 2 x n_ids slots (load <= 1/2), its entries moved over */
static int resize_table(T *t) {
    int64_t n = t->h[N_IDS], size = 8192;
    while (size < 2 * n) size *= 2;
    if (t->table != NULL && (uint64_t)size == t->mask + 1) return 0;
    Slot *old = t->table, *table = calloc((size_t)size, sizeof(Slot));
    uint64_t old_size = old ? t->mask + 1 : 0;
    if (table == NULL) return -1;
    t->table = table;
    t->mask = (uint64_t)size - 1;
    t->h[TABLE] = (int64_t)(intptr_t)table;
    t->h[MASK] = (int64_t)t->mask;
    for (uint64_t i = 0; i < old_size; i++)
        if (old[i].child) table_put(t, old[i].key, old[i].child);
    free(old);
    return 0;
}

static int grow(T *t) {
    int64_t n = t->h[N_IDS];
    if (n + GROW > t->h[MAX_IDS]) return -1;
    for (int64_t id = n + GROW - 1; id >= n; id--) t->free[t->h[NFREE]++] = id;
    t->h[N_IDS] = n + GROW;
    return resize_table(t);
}

static void link_child(T *t, int64_t p, int64_t c) {
    Node *n = t->n;
    int64_t last = n[p].last;
    n[c].prev = last;
    n[c].next = 0;
    if (last) n[last].next = c; else n[p].first = c;
    n[p].last = c;
    n[p].nkids++;
}

static void unlink_child(T *t, int64_t p, int64_t c) {
    Node *n = t->n;
    int64_t a = n[c].prev, b = n[c].next;
    if (a) n[a].next = b; else n[p].first = b;
    if (b) n[b].prev = a; else n[p].last = a;
    n[c].prev = n[c].next = 0;
    n[p].nkids--;
}

static int64_t fresh(const T *t, const int64_t *ptrs, int64_t n, int64_t at) {
    if (t->h[EVICTED_AT] <= at) return n;
    for (int64_t i = 0; i < n; i++)
        if (t->n[ptrs[i]].died > at) return i;
    return n;
}

static int evict(T *t, int64_t count) {
    int64_t chances = SECOND_CHANCES * count, clock = t->h[CLOCK], tail = t->h[TAIL];
    Node *n = t->n;
    int touched = 0;
    int64_t evicted = 0;
    while (evicted < count) {
        int64_t x = n[ROOT].nxt;
        if (x == ROOT) break;
        if (n[x].stamp > n[x].queued && chances > 0) {
            chances--;
            n[x].queued = clock;
            if (x != tail) {
                n[ROOT].nxt = n[x].nxt;
                n[tail].nxt = x;
                n[x].nxt = ROOT;
                tail = x;
            }
            continue;
        }
        n[ROOT].nxt = n[x].nxt;
        if (x == tail) tail = ROOT;
        evicted++;
        touched |= n[x].stamp == clock;
        int64_t p = n[x].parent;
        if (p >= 0 && lookup(t, p, n[x].token) == x) {
            table_del(t, key_of(p, n[x].token));
            unlink_child(t, p, x);
        }
        for (int64_t c = n[x].first, after; c; c = after) {
            after = n[c].next;
            table_del(t, key_of(x, n[c].token));
            n[c].parent = CUT;
            n[c].prev = n[c].next = 0;
        }
        n[x].first = n[x].last = n[x].nkids = 0;
        n[x].live = 0;
        n[x].died = clock;
        t->free[t->h[NFREE]++] = x;
    }
    t->h[TAIL] = tail;
    t->h[SIZE] -= evicted;
    t->h[EVICTED_AT] = clock;
    return touched;
}

/* PyNgramTrie.extend for one token: pointers ptrs[0..n) in, the new ones to out (may not
   alias ptrs); returns their number, -1 when the ids run out */
static int64_t extend1(T *t, const int64_t *ptrs, int64_t m, int64_t tok, int gen,
                       int64_t *out) {
    int64_t clock = ++t->h[CLOCK], tail = t->h[TAIL], added = 0, k = 0;
    for (int64_t i = -1; i < m; i++) {
        int64_t node = i < 0 ? ROOT : ptrs[i];
        int64_t child = lookup(t, node, tok);
        Node *n;
        if (child == 0) {
            if (t->h[NFREE] == 0 && grow(t) != 0) return -1;
            child = t->free[--t->h[NFREE]];
            n = t->n;
            n[child].count = 1;
            n[child].ostamp = gen ? clock : 0;
            n[child].queued = clock;
            n[child].parent = node;
            n[child].token = tok;
            n[child].live = 1;
            table_put(t, key_of(node, tok), child);
            link_child(t, node, child);
            n[tail].nxt = child;
            tail = child;
            added++;
        } else {
            n = t->n;
            n[child].count++;
            if (gen) n[child].ostamp = clock;
        }
        n[child].stamp = clock;
        out[k++] = child;
    }
    if (added) {
        t->n[tail].nxt = ROOT;
        t->h[TAIL] = tail;
        t->h[SIZE] += added;
    }
    if (k >= t->h[DEPTH]) k--;
    if (t->h[SIZE] > t->h[CAPACITY] && evict(t, t->h[SIZE] - t->h[CAPACITY]))
        k = fresh(t, out, k, clock - 1);
    return k;
}

/* the node toks[0..k) lead to from `node`; 0: none (k >= 1 from the root) */
static int64_t walk(const T *t, int64_t node, const int64_t *toks, int64_t k) {
    for (int64_t i = 0; i < k; i++)
        if ((node = lookup(t, node, toks[i])) == 0) return 0;
    return node;
}

static inline int more_recent(const Node *a, const Node *b) {
    return a->ostamp > b->ostamp || (a->ostamp == b->ostamp && a->stamp > b->stamp);
}

static int64_t recent(const T *t, int64_t p, int64_t other, int generated, int64_t scan) {
    const Node *n = t->n;
    int64_t best = 0, i = 0;
    for (int64_t c = n[p].first; c && i < scan; c = n[c].next, i++) {
        if (c == other || n[c].nkids == 0 || (generated && n[c].ostamp == 0)) continue;
        if (best == 0 || more_recent(&n[c], &n[best])) best = c;
    }
    return best;
}

/* PyNgramTrie._skip_sibling: a sibling (a model's first, longest context first) of a new
   last token after a known context longer than `exact` and at least min_ctx tokens */
static int64_t skip_match(const T *t, const int64_t *ptrs, int64_t m, int64_t exact,
                          int64_t max_w, int64_t min_ctx, int64_t scan) {
    int64_t exact_node = 0 < exact && exact <= m ? ptrs[exact - 1] : 0;
    int64_t lo = exact > min_ctx - 1 ? exact : min_ctx - 1;
    int64_t top = (m < max_w ? m : max_w) - 1;
    for (int generated = 1; generated >= 0; generated--)
        for (int64_t i = top; i > lo; i--) {
            int64_t mine = ptrs[i], p = t->n[mine].parent;
            if (p == CUT || t->n[mine].nkids) continue;
            int64_t best = recent(t, p, mine, generated, scan);
            if (best) return best;
        }
    return exact_node;
}

int64_t ngt_init(int64_t *h) {
    T t = view(h);
    t.n[ROOT].parent = CUT;
    t.n[ROOT].token = -1;
    t.n[ROOT].live = 1;
    h[N_IDS] = 1;
    return resize_table(&t);
}

void ngt_free(int64_t *h) {
    free((void *)(intptr_t)h[TABLE]);
    h[TABLE] = 0;
}

/* tokens toks[0..k) one after another from pointers ptrs[0..n) (toks[i] generated when
   i >= gen_from); buf: 2 x (depth + 1) scratch; returns the final pointers' number, left
   at buf[0..), -1 (ids ran out) or -2 (a token out of range, nothing inserted) */
int64_t ngt_extend(int64_t *h, const int64_t *ptrs, int64_t n, const int64_t *toks, int64_t k,
                   int64_t gen_from, int64_t *buf) {
    T t = view(h);
    for (int64_t i = 0; i < k; i++)
        if (!token_ok(toks[i])) return -2;
    int64_t w = h[DEPTH] + 1, *a = buf, *b = buf + w;
    const int64_t *in = ptrs;
    for (int64_t i = 0; i < k; i++) {
        int64_t *out = (i % 2 == 0) == (k % 2 == 1) ? a : b;  /* the last lands in a */
        n = extend1(&t, in, n, toks[i], i >= gen_from, out);
        if (n < 0) return -1;
        in = out;
    }
    if (k == 0) for (int64_t i = 0; i < n; i++) a[i] = ptrs[i];
    return n;
}

int64_t ngt_walk(int64_t *h, int64_t node, const int64_t *toks, int64_t k) {
    T t = view(h);
    return k == 0 ? node : walk(&t, node, toks, k) ?: -1;
}

int64_t ngt_child(int64_t *h, int64_t node, int64_t tok) {
    T t = view(h);
    return lookup(&t, node, tok);
}

/* the child with the highest (ostamp, stamp) (recency) or (count, stamp), the first
   inserted among equals (Python's max over the dict); 0: none */
int64_t ngt_best(int64_t *h, int64_t node, int by_count) {
    T t = view(h);
    const Node *n = t.n;
    int64_t best = 0;
    for (int64_t c = n[node].first; c; c = n[c].next) {
        if (best == 0) { best = c; continue; }
        int64_t a = by_count ? n[c].count : n[c].ostamp, b = by_count ? n[best].count : n[best].ostamp;
        if (a > b || (a == b && n[c].stamp > n[best].stamp)) best = c;
    }
    return best;
}

/* PyNgramTrie.match (NgramDrafter._match's search), one call: the deepest window w (max_w
   down to min_w) of the request's suffix + `after` (ptrs[i]: the suffix of i + 1 tokens;
   ptrs may hold fewer than max_w) whose node has a continuation; with `skip` and no
   `after`, the skip-gram fallback (`skip_match`) from there. 0: none */
int64_t ngt_match(int64_t *h, const int64_t *ptrs, int64_t m, const int64_t *after, int64_t k,
                  int64_t min_w, int64_t max_w, int skip, int64_t min_ctx, int64_t scan) {
    T t = view(h);
    for (int64_t w = max_w; w >= min_w; w--) {
        int64_t node;
        if (w > k) {
            int64_t i = w - k - 1;
            if (i >= m) continue;
            node = walk(&t, ptrs[i], after, k);
        } else {
            node = walk(&t, ROOT, after + (k - w), w);
        }
        if (node && t.n[node].nkids)
            return k == 0 && skip ? skip_match(&t, ptrs, m, w, max_w, min_ctx, scan) : node;
    }
    return k == 0 && skip ? skip_match(&t, ptrs, m, 0, max_w, min_ctx, scan) : 0;
}

/* PyNgramTrie.deepest (NgramDrafter._rematch's search): the deepest k (n down to min_w)
   whose last k tokens lead from the root to a node with a continuation. 0: none */
int64_t ngt_deepest(int64_t *h, const int64_t *toks, int64_t n, int64_t min_w) {
    T t = view(h);
    for (int64_t k = n; k >= min_w; k--) {
        int64_t node = walk(&t, ROOT, toks + (n - k), k);
        if (node && t.n[node].nkids) return node;
    }
    return 0;
}

/* PyNgramTrie.recent_child: among the first `scan` children of p that have children (not
   `other`; with `generated`, with an ostamp), the most recent; 0: none */
int64_t ngt_recent(int64_t *h, int64_t p, int64_t other, int generated, int64_t scan) {
    T t = view(h);
    return recent(&t, p, other, generated, scan);
}

int64_t ngt_children(int64_t *h, int64_t node, int64_t *out) {
    T t = view(h);
    int64_t k = 0;
    for (int64_t c = t.n[node].first; c; c = t.n[c].next) out[k++] = c;
    return k;
}

/* what the fields alone cannot show the tests: every linked child is in the table under
   its parent and token, the table holds nothing else, sibling links run both ways and
   nkids counts them. 0: consistent, else the failed check's number */
int64_t ngt_check(int64_t *h) {
    T t = view(h);
    const Node *n = t.n;
    int64_t linked = 0, used = 0;
    for (int64_t x = 0; x < h[N_IDS]; x++) {
        if (!n[x].live) {
            if (n[x].first || n[x].nkids) return 1;
            continue;
        }
        int64_t k = 0, prev = 0;
        for (int64_t c = n[x].first; c; prev = c, c = n[c].next) {
            if (n[c].prev != prev || n[c].parent != x || !n[c].live) return 2;
            if (lookup(&t, x, n[c].token) != c) return 3;
            k++;
        }
        if (n[x].last != prev || n[x].nkids != k) return 4;
        linked += k;
    }
    for (uint64_t i = 0; i <= t.mask; i++) used += t.table[i].child != 0;
    return used == linked ? 0 : 5;
}
"""


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, args in (
        ("ngt_init", [p]),
        ("ngt_extend", [p, p, i64, p, i64, i64, p]),
        ("ngt_walk", [p, i64, p, i64]),
        ("ngt_child", [p, i64, i64]),
        ("ngt_best", [p, i64, i32]),
        ("ngt_recent", [p, i64, i64, i32, i64]),
        ("ngt_children", [p, i64, p]),
        ("ngt_match", [p, p, i64, p, i64, i64, i64, i32, i64, i64]),
        ("ngt_deepest", [p, p, i64, i64]),
        ("ngt_check", [p]),
    ):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i64
    lib.ngt_free.argtypes, lib.ngt_free.restype = [p], None


def load() -> ctypes.CDLL | None:
    """The compiled store (built on first use); None without a C compiler."""
    source = SOURCE.replace("__GROW__", str(_GROW)).replace("__CHANCES__", str(SECOND_CHANCES))
    return cpu_kernels.build_or_none(source, "loom_ngram_store", _declare)


class CNgramTrie:
    """`PyNgramTrie`'s interface and semantics over the C store (`load()` must not be None)."""

    def __init__(self, depth: int, capacity: int):
        self._lib = lib = load()
        self.depth = depth
        self.capacity = capacity
        self.root = ROOT
        # every id a trie can hold: the root, `capacity` nodes, the `depth` one extend adds
        # before it evicts, rounded up to the next _GROW
        max_ids = 1 + capacity + depth + _GROW
        if capacity >= 1 << 31:
            raise ValueError("capacity: at most 2^31 - 1 nodes (a table key holds an id)")
        self._map = mmap.mmap(-1, 8 * (_HEADER + (_RECORD + 1) * max_ids))
        words = memoryview(self._map).cast("q")
        self._h = words[:_HEADER]
        self._h[_H.index("depth")], self._h[_H.index("capacity")] = depth, capacity
        self._h[_H.index("max_ids")] = max_ids
        nodes = _HEADER + _RECORD * max_ids
        for i, name in enumerate(_FIELDS):  # strided views: field i of every record
            setattr(self, name, words[_HEADER + i : nodes : _RECORD])
        self.free = words[nodes : nodes + max_ids]
        self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        if lib.ngt_init(self._addr) != 0:
            raise MemoryError("the n-gram store's table")
        self._buf = array("q", bytes(16 * (depth + 1)))
        self._buf_addr = self._buf.buffer_info()[0]
        stamp, ostamp, count = self.stamp, self.ostamp, self.count
        self.recency = lambda c: (ostamp[c], stamp[c])
        self.frequency = lambda c: (count[c], stamp[c])

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is not None and hasattr(self, "_addr"):
            lib.ngt_free(self._addr)

    def __len__(self) -> int:
        return self._h[_SIZE]

    size = property(lambda self: self._h[_SIZE], doc="nodes in the queue (all but the root)")
    clock = property(lambda self: self._h[_CLOCK])
    evicted_at = property(lambda self: self._h[_EVICTED_AT])
    tail = property(lambda self: self._h[_TAIL])
    n_ids = property(lambda self: self._h[_N_IDS], doc="ids made so far (root, queued and free)")

    def free_ids(self) -> list[int]:
        return self.free[: self._h[_NFREE]].tolist()

    def alive(self, node: int) -> bool:
        return self.live[node] != 0

    def extend(self, pointers: list[int], token: int, generated: bool = False) -> list[int]:
        return self.extend_many(pointers, (token,), 0 if generated else 1)

    def extend_many(
        self, pointers: list[int], tokens: Sequence[int], generated_from: int
    ) -> list[int]:
        """`extend` for each of `tokens` in turn, tokens[i] generated when i >=
        generated_from; returns the last pointers."""
        if len(pointers) >= self.depth:
            raise ValueError("more pointers than the trie's depth")
        ptrs, toks = array("q", pointers), array("q", tokens)
        n = self._lib.ngt_extend(
            self._addr,
            ptrs.buffer_info()[0],
            len(ptrs),
            toks.buffer_info()[0],
            len(toks),
            generated_from,
            self._buf_addr,
        )
        if n == -2:
            raise ValueError("a token out of [0, 2^32)")
        if n < 0:
            raise MemoryError("the n-gram store ran out of ids")
        return self._buf[:n].tolist()

    def fresh(self, pointers: list[int], at: int) -> list[int]:
        return fresh_pointers(self, pointers, at)

    def walk(self, node: int, tokens: Sequence[int]) -> int | None:
        if not tokens:
            return node
        toks = array("q", tokens)
        node = self._lib.ngt_walk(self._addr, node, toks.buffer_info()[0], len(toks))
        return None if node < 0 else node

    def child(self, node: int, token: int) -> int | None:
        return self._lib.ngt_child(self._addr, node, token) or None

    def has_kids(self, node: int) -> bool:
        return self.nkids[node] > 0

    def match(
        self,
        pointers: list[int],
        after: Sequence[int],
        windows: tuple[int, int],
        skip: bool,
        skip_min_context: int,
        skip_scan: int,
    ) -> int | None:
        """`NgramDrafter._match`'s search in one call (see there); None: no match."""
        ptrs, toks = array("q", pointers), array("q", after)
        node = self._lib.ngt_match(
            self._addr,
            ptrs.buffer_info()[0],
            len(ptrs),
            toks.buffer_info()[0],
            len(toks),
            windows[0],
            windows[1],
            skip,
            skip_min_context,
            skip_scan,
        )
        return node or None

    def deepest(self, tokens: Sequence[int], min_window: int) -> int | None:
        """The node of the longest suffix of `tokens` (at least min_window long) that the
        trie holds with a continuation (None: none)."""
        toks = array("q", tokens)
        return (
            self._lib.ngt_deepest(self._addr, toks.buffer_info()[0], len(toks), min_window) or None
        )

    def children(self, node: int) -> list[int]:
        out = array("q", bytes(8 * self.nkids[node]))
        n = self._lib.ngt_children(self._addr, node, out.buffer_info()[0])
        return out[:n].tolist()

    def best_child(self, node: int, by_count: bool = False) -> int | None:
        return self._lib.ngt_best(self._addr, node, by_count) or None

    def recent_child(
        self, parent: int, other_than: int = -1, generated: bool = False, scan: int = 1 << 62
    ) -> int | None:
        return self._lib.ngt_recent(self._addr, parent, other_than, generated, scan) or None

    def queue(self) -> Iterator[int]:
        return store_queue(self)

    def check(self) -> None:
        assert self._lib.ngt_check(self._addr) == 0, self._lib.ngt_check(self._addr)
        check_store(self)


__all__ = ["CNgramTrie", "CUT", "load"]
