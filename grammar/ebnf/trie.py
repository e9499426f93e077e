"""A prefix tree over the vocabulary's token byte strings.

Masks are computed by walking it against the matcher state, so a byte that kills every branch
prunes all the tokens below it at once. It is stored breadth-first, as numpy arrays for the
vectorised walk: `levels[d - 1]` holds the nodes at depth d, each one's parent (as a position
in the level above) and edge byte; `token_node[t]` is the node where token t ends. One trie is
built per vocabulary object and shared by every grammar compiled against it.
"""

from __future__ import annotations

import threading

import numpy as np

ROOT = 0
_CACHE: dict[int, tuple[object, TokenTrie]] = {}
_LOCK = threading.Lock()


class TokenTrie:
    def __init__(self, vocab):
        self.vocab_size = int(vocab.vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in vocab.eos_token_ids)
        self.n_words = (self.vocab_size + 31) // 32
        token_bytes = vocab.token_bytes
        items = sorted(
            (data, tid)
            for tid, data in enumerate(token_bytes[: self.vocab_size])
            # None: never allowed; b"": would let generation stall forever
            if data and tid not in self.eos_token_ids
        )
        # Sorted tokens share their prefix with the previous one: only the rest is new nodes.
        parent, edge, depth = [ROOT], [0], [0]
        path, prev = [ROOT], b""  # path[d]: the node at depth d on the previous token
        ids, ends = [], []
        for data, tid in items:
            if data != prev:
                common, limit = 0, min(len(prev), len(data))
                while common < limit and prev[common] == data[common]:
                    common += 1
                del path[common + 1 :]
                for d in range(common, len(data)):
                    path.append(len(parent))
                    parent.append(path[d])
                    edge.append(data[d])
                    depth.append(d + 1)
                prev = data
            ids.append(tid)
            ends.append(path[len(data)])
        self._size = len(parent)
        self._build_levels(np.array(parent), np.array(edge), np.array(depth))
        # token id -> its node (a never-alive sentinel node for ids outside the trie)
        self.token_node = np.full(self.n_words * 32, self._size, dtype=np.int64)
        self.token_node[np.array(ids, dtype=np.int64)] = np.array(ends, dtype=np.int64)
        self.eos_bits = self.to_bits(sorted(t for t in self.eos_token_ids if t < self.vocab_size))

    def _build_levels(self, parent: np.ndarray, edge: np.ndarray, depth: np.ndarray) -> None:
        """Breadth-first arrays for the vectorised walk from the root: for each depth d >= 1,
        the nodes at d, the position of each one's parent in level d-1, and the edge byte."""
        self.levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        order = np.argsort(depth, kind="stable")
        bounds = np.searchsorted(depth[order], np.arange(depth.max() + 2))
        position = np.zeros(len(depth), dtype=np.int64)  # index of a node within its level
        for d in range(len(bounds) - 1):
            nodes = order[bounds[d] : bounds[d + 1]]
            position[nodes] = np.arange(len(nodes))
            if d:
                self.levels.append((nodes, position[parent[nodes]], edge[nodes]))

    def bits_of_nodes(self, alive: np.ndarray) -> int:
        """Bits of the tokens ending at nodes flagged in `alive` (length len(trie) + 1)."""
        flags = alive[self.token_node]
        return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")

    def to_bits(self, token_ids) -> int:
        """A Python int with bit t set for each token id t (the mask's working form)."""
        if len(token_ids) < 64:  # shifting beats numpy's fixed cost for a few ids
            bits = 0
            for tid in token_ids:
                bits |= 1 << tid
            return bits
        ids = np.fromiter(token_ids, dtype=np.int64)
        flags = np.zeros(self.n_words * 32, dtype=bool)
        flags[ids] = True
        return int.from_bytes(np.packbits(flags, bitorder="little").tobytes(), "little")

    def __len__(self) -> int:
        return self._size


def get_trie(vocab) -> TokenTrie:
    """The (cached) trie of `vocab`; the vocabulary object is kept alive with it."""
    key = id(vocab)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None and hit[0] is vocab:
            return hit[1]
    trie = TokenTrie(vocab)
    with _LOCK:
        _CACHE[key] = (vocab, trie)
    return trie
