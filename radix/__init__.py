"""loom.radix: RadixAttention's prefix cache over KV slots.

`RadixTree` is the pure tree (token ids -> slot indices, LRU eviction, path locks);
`RadixCache` wires it to requests and the KV allocator; `ChunkCache` is the same interface
with caching disabled. Both caches implement `BasePrefixCache`.
"""

from loom.radix.base import BasePrefixCache
from loom.radix.cache import RadixCache
from loom.radix.chunk_cache import ChunkCache
from loom.radix.tree import MatchResult, RadixTree, TreeNode

__all__ = ["BasePrefixCache", "ChunkCache", "MatchResult", "RadixCache", "RadixTree", "TreeNode"]
