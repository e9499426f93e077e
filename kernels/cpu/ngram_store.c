/* The n-gram trie's node store (runtime/spec/ngram_store_c.py: the reasons and the semantics,
   field for field those of the Python store, ngram_store.PyNgramTrie). The mapping's layout,
   the Node record and the constants shared with Python are in loom_cpu.h. */
#include "loom_cpu.h"

/* a table slot: key (parent << 32 | token) -> child (0: empty) */
typedef struct {
    uint64_t key;
    int64_t child;
} Slot;

typedef struct {
    int64_t *h, *free;
    Node* n;
    Slot* table;
    uint64_t mask;
} T;

static T view(int64_t* h) {
    T t;
    t.h = h;
    t.n = (Node*)(h + NGT_HEADER);
    t.free = h + NGT_HEADER + (int64_t)(sizeof(Node) / sizeof(int64_t)) * h[NGT_MAX_IDS];
    t.table = (Slot*)(intptr_t)h[NGT_TABLE];
    t.mask = (uint64_t)h[NGT_MASK];
    return t;
}

/* tokens are vocabulary ids: 0 <= token < 2^32 (extend refuses others, lookups miss) */
static inline int token_ok(int64_t tok) { return tok >= 0 && tok <= 0xFFFFFFFFll; }
static inline uint64_t key_of(int64_t p, int64_t tok) { return (uint64_t)p << 32 | (uint64_t)tok; }

static inline uint64_t slot_of(uint64_t key, uint64_t mask) {
    uint64_t x = key * 0x9E3779B97F4A7C15ull;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return x & mask;
}

static inline int64_t lookup(const T* t, int64_t p, int64_t tok) {
    if (!token_ok(tok)) return 0;
    uint64_t key = key_of(p, tok);
    for (uint64_t i = slot_of(key, t->mask);; i = (i + 1) & t->mask) {
        const Slot* s = &t->table[i];
        if (s->child == 0) return 0;
        if (s->key == key) return s->child;
    }
}

static inline void table_put(T* t, uint64_t key, int64_t c) {
    uint64_t i = slot_of(key, t->mask);
    while (t->table[i].child != 0) i = (i + 1) & t->mask;
    t->table[i].key = key;
    t->table[i].child = c;
}

/* the entry for c (filed under key) out; linear probing's backward shift keeps every other
   entry reachable without tombstones */
static void table_del(T* t, uint64_t key) {
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
static int resize_table(T* t) {
    int64_t n = t->h[NGT_N_IDS], size = 8192;
    while (size < 2 * n) size *= 2;
    if (t->table != NULL && (uint64_t)size == t->mask + 1) return 0;
    Slot *old = t->table, *table = calloc((size_t)size, sizeof(Slot));
    uint64_t old_size = old ? t->mask + 1 : 0;
    if (table == NULL) return -1;
    t->table = table;
    t->mask = (uint64_t)size - 1;
    t->h[NGT_TABLE] = (int64_t)(intptr_t)table;
    t->h[NGT_MASK] = (int64_t)t->mask;
    for (uint64_t i = 0; i < old_size; i++)
        if (old[i].child) table_put(t, old[i].key, old[i].child);
    free(old);
    return 0;
}

static int grow(T* t) {
    int64_t n = t->h[NGT_N_IDS];
    if (n + NGT_GROW > t->h[NGT_MAX_IDS]) return -1;
    for (int64_t id = n + NGT_GROW - 1; id >= n; id--) t->free[t->h[NGT_NFREE]++] = id;
    t->h[NGT_N_IDS] = n + NGT_GROW;
    return resize_table(t);
}

static void link_child(T* t, int64_t p, int64_t c) {
    Node* n = t->n;
    int64_t last = n[p].last;
    n[c].prev = last;
    n[c].next = 0;
    if (last)
        n[last].next = c;
    else
        n[p].first = c;
    n[p].last = c;
    n[p].nkids++;
}

static void unlink_child(T* t, int64_t p, int64_t c) {
    Node* n = t->n;
    int64_t a = n[c].prev, b = n[c].next;
    if (a)
        n[a].next = b;
    else
        n[p].first = b;
    if (b)
        n[b].prev = a;
    else
        n[p].last = a;
    n[c].prev = n[c].next = 0;
    n[p].nkids--;
}

static int64_t fresh(const T* t, const int64_t* ptrs, int64_t n, int64_t at) {
    if (t->h[NGT_EVICTED_AT] <= at) return n;
    for (int64_t i = 0; i < n; i++)
        if (t->n[ptrs[i]].died > at) return i;
    return n;
}

static int evict(T* t, int64_t count) {
    int64_t chances = NGT_SECOND_CHANCES * count, clock = t->h[NGT_CLOCK], tail = t->h[NGT_TAIL];
    Node* n = t->n;
    int touched = 0;
    int64_t evicted = 0;
    while (evicted < count) {
        int64_t x = n[NGT_ROOT].nxt;
        if (x == NGT_ROOT) break;
        if (n[x].stamp > n[x].queued && chances > 0) {
            chances--;
            n[x].queued = clock;
            if (x != tail) {
                n[NGT_ROOT].nxt = n[x].nxt;
                n[tail].nxt = x;
                n[x].nxt = NGT_ROOT;
                tail = x;
            }
            continue;
        }
        n[NGT_ROOT].nxt = n[x].nxt;
        if (x == tail) tail = NGT_ROOT;
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
            n[c].parent = NGT_CUT;
            n[c].prev = n[c].next = 0;
        }
        n[x].first = n[x].last = n[x].nkids = 0;
        n[x].live = 0;
        n[x].died = clock;
        t->free[t->h[NGT_NFREE]++] = x;
    }
    t->h[NGT_TAIL] = tail;
    t->h[NGT_SIZE] -= evicted;
    t->h[NGT_EVICTED_AT] = clock;
    return touched;
}

/* PyNgramTrie.extend for one token: pointers ptrs[0..n) in, the new ones to out (may not
   alias ptrs); returns their number, -1 when the ids run out */
static int64_t extend1(T* t, const int64_t* ptrs, int64_t m, int64_t tok, int gen, int64_t* out) {
    int64_t clock = ++t->h[NGT_CLOCK], tail = t->h[NGT_TAIL], added = 0, k = 0;
    for (int64_t i = -1; i < m; i++) {
        int64_t node = i < 0 ? NGT_ROOT : ptrs[i];
        int64_t child = lookup(t, node, tok);
        Node* n;
        if (child == 0) {
            if (t->h[NGT_NFREE] == 0 && grow(t) != 0) return -1;
            child = t->free[--t->h[NGT_NFREE]];
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
        t->n[tail].nxt = NGT_ROOT;
        t->h[NGT_TAIL] = tail;
        t->h[NGT_SIZE] += added;
    }
    if (k >= t->h[NGT_DEPTH]) k--;
    if (t->h[NGT_SIZE] > t->h[NGT_CAPACITY] && evict(t, t->h[NGT_SIZE] - t->h[NGT_CAPACITY]))
        k = fresh(t, out, k, clock - 1);
    return k;
}

/* the node toks[0..k) lead to from `node`; 0: none (k >= 1 from the root) */
static int64_t walk(const T* t, int64_t node, const int64_t* toks, int64_t k) {
    for (int64_t i = 0; i < k; i++)
        if ((node = lookup(t, node, toks[i])) == 0) return 0;
    return node;
}

static inline int more_recent(const Node* a, const Node* b) {
    return a->ostamp > b->ostamp || (a->ostamp == b->ostamp && a->stamp > b->stamp);
}

static int64_t recent(const T* t, int64_t p, int64_t other, int generated, int64_t scan) {
    const Node* n = t->n;
    int64_t best = 0, i = 0;
    for (int64_t c = n[p].first; c && i < scan; c = n[c].next, i++) {
        if (c == other || n[c].nkids == 0 || (generated && n[c].ostamp == 0)) continue;
        if (best == 0 || more_recent(&n[c], &n[best])) best = c;
    }
    return best;
}

/* PyNgramTrie._skip_sibling: a sibling (a model's first, longest context first) of a new
   last token after a known context longer than `exact` and at least min_ctx tokens */
static int64_t skip_match(const T* t, const int64_t* ptrs, int64_t m, int64_t exact, int64_t max_w,
                          int64_t min_ctx, int64_t scan) {
    int64_t exact_node = 0 < exact && exact <= m ? ptrs[exact - 1] : 0;
    int64_t lo = exact > min_ctx - 1 ? exact : min_ctx - 1;
    int64_t top = (m < max_w ? m : max_w) - 1;
    for (int generated = 1; generated >= 0; generated--)
        for (int64_t i = top; i > lo; i--) {
            int64_t mine = ptrs[i], p = t->n[mine].parent;
            if (p == NGT_CUT || t->n[mine].nkids) continue;
            int64_t best = recent(t, p, mine, generated, scan);
            if (best) return best;
        }
    return exact_node;
}

int64_t ngt_init(int64_t* h) {
    T t = view(h);
    t.n[NGT_ROOT].parent = NGT_CUT;
    t.n[NGT_ROOT].token = -1;
    t.n[NGT_ROOT].live = 1;
    h[NGT_N_IDS] = 1;
    return resize_table(&t);
}

void ngt_free(int64_t* h) {
    free((void*)(intptr_t)h[NGT_TABLE]);
    h[NGT_TABLE] = 0;
}

/* tokens toks[0..k) one after another from pointers ptrs[0..n) (toks[i] generated when
   i >= gen_from); buf: 2 x (depth + 1) scratch; returns the final pointers' number, left
   at buf[0..), -1 (ids ran out) or -2 (a token out of range, nothing inserted) */
int64_t ngt_extend(int64_t* h, const int64_t* ptrs, int64_t n, const int64_t* toks, int64_t k,
                   int64_t gen_from, int64_t* buf) {
    T t = view(h);
    for (int64_t i = 0; i < k; i++)
        if (!token_ok(toks[i])) return -2;
    int64_t w = h[NGT_DEPTH] + 1, *a = buf, *b = buf + w;
    const int64_t* in = ptrs;
    for (int64_t i = 0; i < k; i++) {
        int64_t* out = (i % 2 == 0) == (k % 2 == 1) ? a : b; /* the last lands in a */
        n = extend1(&t, in, n, toks[i], i >= gen_from, out);
        if (n < 0) return -1;
        in = out;
    }
    if (k == 0)
        for (int64_t i = 0; i < n; i++) a[i] = ptrs[i];
    return n;
}

int64_t ngt_walk(int64_t* h, int64_t node, const int64_t* toks, int64_t k) {
    T t = view(h);
    return k == 0 ? node : walk(&t, node, toks, k) ?: -1;
}

int64_t ngt_child(int64_t* h, int64_t node, int64_t tok) {
    T t = view(h);
    return lookup(&t, node, tok);
}

/* the child with the highest (ostamp, stamp) (recency) or (count, stamp), the first
   inserted among equals (Python's max over the dict); 0: none */
int64_t ngt_best(int64_t* h, int64_t node, int by_count) {
    T t = view(h);
    const Node* n = t.n;
    int64_t best = 0;
    for (int64_t c = n[node].first; c; c = n[c].next) {
        if (best == 0) {
            best = c;
            continue;
        }
        int64_t a = by_count ? n[c].count : n[c].ostamp,
                b = by_count ? n[best].count : n[best].ostamp;
        if (a > b || (a == b && n[c].stamp > n[best].stamp)) best = c;
    }
    return best;
}

/* PyNgramTrie.match (NgramDrafter._match's search), one call: the deepest window w (max_w
   down to min_w) of the request's suffix + `after` (ptrs[i]: the suffix of i + 1 tokens;
   ptrs may hold fewer than max_w) whose node has a continuation; with `skip` and no
   `after`, the skip-gram fallback (`skip_match`) from there. 0: none */
int64_t ngt_match(int64_t* h, const int64_t* ptrs, int64_t m, const int64_t* after, int64_t k,
                  int64_t min_w, int64_t max_w, int skip, int64_t min_ctx, int64_t scan) {
    T t = view(h);
    for (int64_t w = max_w; w >= min_w; w--) {
        int64_t node;
        if (w > k) {
            int64_t i = w - k - 1;
            if (i >= m) continue;
            node = walk(&t, ptrs[i], after, k);
        } else {
            node = walk(&t, NGT_ROOT, after + (k - w), w);
        }
        if (node && t.n[node].nkids)
            return k == 0 && skip ? skip_match(&t, ptrs, m, w, max_w, min_ctx, scan) : node;
    }
    return k == 0 && skip ? skip_match(&t, ptrs, m, 0, max_w, min_ctx, scan) : 0;
}

/* PyNgramTrie.deepest (NgramDrafter._rematch's search): the deepest k (n down to min_w)
   whose last k tokens lead from the root to a node with a continuation. 0: none */
int64_t ngt_deepest(int64_t* h, const int64_t* toks, int64_t n, int64_t min_w) {
    T t = view(h);
    for (int64_t k = n; k >= min_w; k--) {
        int64_t node = walk(&t, NGT_ROOT, toks + (n - k), k);
        if (node && t.n[node].nkids) return node;
    }
    return 0;
}

/* PyNgramTrie.recent_child: among the first `scan` children of p that have children (not
   `other`; with `generated`, with an ostamp), the most recent; 0: none */
int64_t ngt_recent(int64_t* h, int64_t p, int64_t other, int generated, int64_t scan) {
    T t = view(h);
    return recent(&t, p, other, generated, scan);
}

int64_t ngt_children(int64_t* h, int64_t node, int64_t* out) {
    T t = view(h);
    int64_t k = 0;
    for (int64_t c = t.n[node].first; c; c = t.n[c].next) out[k++] = c;
    return k;
}

/* what the fields alone cannot show the tests: every linked child is in the table under
   its parent and token, the table holds nothing else, sibling links run both ways and
   nkids counts them. 0: consistent, else the failed check's number */
int64_t ngt_check(int64_t* h) {
    T t = view(h);
    const Node* n = t.n;
    int64_t linked = 0, used = 0;
    for (int64_t x = 0; x < h[NGT_N_IDS]; x++) {
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
