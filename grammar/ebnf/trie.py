"""A prefix tree over the vocabulary's token byte strings.

Masks are computed by walking it against the matcher state, so a byte that kills every branch
prunes all the tokens below it at once. Nodes are ints; `children[n]` maps a byte to the child
node and `tokens[n]` lists the ids whose bytes end exactly at `n`. `levels` is the same tree laid
out breadth-first as numpy arrays for the vectorised walk. One trie is built per vocabulary
object and shared by every grammar compiled against it.
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
        self.children: list[dict[int, int]] = [{}]
        self.tokens: list[list[int]] = [[]]
        token_bytes = vocab.token_bytes
        for tid in range(min(len(token_bytes), self.vocab_size)):
            data = token_bytes[tid]
            if not data or tid in self.eos_token_ids:
                continue  # None: never allowed; b"": would let generation stall forever
            node = ROOT
            for byte in data:
                child = self.children[node].get(byte)
                if child is None:
                    child = len(self.children)
                    self.children.append({})
                    self.tokens.append([])
                    self.children[node][byte] = child
                node = child
            self.tokens[node].append(tid)
        self.n_words = (self.vocab_size + 31) // 32
        self._build_levels()
        self.eos_bits = self.to_bits(sorted(t for t in self.eos_token_ids if t < self.vocab_size))

    def _build_levels(self) -> None:
        """Breadth-first arrays for the vectorised walk from the root: for each depth d >= 1,
        the nodes at d, the position of each one's parent in level d-1, and the edge byte."""
        self.levels: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        frontier = [ROOT]
        while True:
            nodes, parents, bytes_ = [], [], []
            for pos, node in enumerate(frontier):
                for byte, child in sorted(self.children[node].items()):
                    nodes.append(child)
                    parents.append(pos)
                    bytes_.append(byte)
            if not nodes:
                break
            self.levels.append(
                (np.array(nodes, np.int64), np.array(parents, np.int64), np.array(bytes_, np.int64))
            )
            frontier = nodes
        # token id -> its node (a never-alive sentinel node for ids outside the trie)
        self.token_node = np.full(self.n_words * 32, len(self.children), dtype=np.int64)
        for node, ids in enumerate(self.tokens):
            self.token_node[ids] = node

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
        return len(self.children)


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
