"""HiRadixCache: the radix tree over three tiers of KV memory (`--enable-hierarchical-cache`).

- L1: the KV pool the model reads (the tree's slots, as in RadixCache).
- L2: host memory, `HostTier`, an LRU of pages holding `--hicache-ratio` x L1's tokens (or
  `--hicache-size` GB). By default pages are stored in the pool's own dtype: bit-exact copies,
  so a prefix served from L2 or L3 gives the very logits a recompute-free L1 hit gives, and
  greedy outputs never depend on which tier held the KV. `--hicache-l2-dtype bf16|int8`
  (pages.PageCodec) stores them compactly instead (2x / ~4x an f32 pool's tokens per GB), an
  opt-in that trades exactness for capacity (lossless when the pool is bf16 and L2 bf16).
- L3: a `StorageBackend` (radix/storage.py: files or a Redis server), shared by restarts and
  replicas; written by a background thread so the scheduler never waits on it.

Pages are content-addressed (radix/pages.py): `block` tokens, keyed by a hash chain over the
model, the KV format and every token before. Write policy (`--hicache-write-policy`):
`write_through` stores each page into L2 and L3 when the tree first caches it; `write_back`
copies a page to L2 only when L1 evicts it, and to L3 only when L2 evicts it. Either way an
evicted page is kept, never dropped (only the tail past a leaf's last whole page is).

Overlapped loads (`prefetch`, default; `--hicache-sync-loads` turns it off): a waiting
request whose prefix continues in L3 past what L1 and L2 hold gets a loader-thread job that
reads, checks and stages those pages into L2; the request waits in the queue ("loading")
while the scheduler runs other requests, and is admitted once the job is done, when
`load_back` finds the pages in L2 (a memory copy). Reading L3 on the scheduler thread (the
sync mode, and pins) stalls every running request's step for the read.

Loading (`load_back`, asked by KVManager at admission): after the L1 match, the following
pages are looked up in L2, then L3, stopping at the first miss; the hits get L1 slots (the
caller's allocator, which may evict), their KV is written there and they enter the tree, so
the match the caller makes next covers them. A stored page that is missing, truncated,
corrupt or another key's is deleted and the prefix is recomputed from there. A backend that
raises is counted, treated as a miss, and not asked again for `RETRY_S`.

Pins (CAG): `pin` locks a cached prefix for good (never evicted while pinned), writes its
pages and a record `pin:<model>:<name>` to L3; `restore_pins` reloads and re-locks every
record at start-up, so pins outlive restarts and any replica on the same L3 finds them.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from loom.radix.base import AllocatorLike, ReqLike, ReqToTokenPoolLike
from loom.radix.cache import RadixCache
from loom.radix.pages import PageCodec, decode_page, encode_page, page_keys, root_hash
from loom.radix.storage import StorageBackend
from loom.radix.tree import TreeNode

logger = logging.getLogger(__name__)

RETRY_S = 2.0  # a failed backend is not asked again for this long
WRITE_POLICIES = ("write_through", "write_back")


def block_tokens(page_size: int, target: int = 32) -> int:
    """Tokens per stored page: `target` rounded up to whole KV pages."""
    return page_size * max(1, -(-target // page_size))


class HostTier:
    """L2: page key -> kv tensor [2, layers, block, kv_heads, head_dim], least recently used
    first out; holds at most `capacity` tokens."""

    def __init__(self, capacity_tokens: int, block: int):
        self.capacity = capacity_tokens
        self.block = block
        self.pages: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def tokens(self) -> int:
        return len(self.pages) * self.block

    def get(self, key: bytes) -> torch.Tensor | None:
        kv = self.pages.get(key)
        if kv is not None:
            self.pages.move_to_end(key)
        return kv

    def put(self, key: bytes, kv: torch.Tensor) -> list[tuple[bytes, torch.Tensor]]:
        """Insert (or refresh) a page; returns the pages pushed out to make room."""
        self.pages[key] = kv
        self.pages.move_to_end(key)
        out = []
        while self.tokens > self.capacity and len(self.pages) > 1:
            out.append(self.pages.popitem(last=False))
        return out

    def clear(self) -> None:
        self.pages.clear()


class Prefetch:
    """One waiting request's L3 read, done by the loader thread: `keys` in prefix order; it
    stops at the first page missing, bad (listed in `bad`) or failing (`error`)."""

    __slots__ = ("keys", "pages", "bad", "error", "seconds", "done")

    def __init__(self, keys: list[bytes]):
        self.keys = keys
        self.pages: list[tuple[bytes, torch.Tensor, int]] = []  # (key, stored page, bytes)
        self.bad: bytes | None = None
        self.error: Exception | None = None
        self.seconds = 0.0
        self.done = threading.Event()


class HiRadixCache(RadixCache):
    """RadixCache whose evictions go to L2/L3 and whose matches can be extended from them."""

    hierarchical = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPoolLike,
        token_to_kv_pool_allocator: AllocatorLike,
        kv_pool,
        page_size: int,
        *,
        identity: str,
        host_tokens: int,
        storage: StorageBackend | None,
        write_policy: str = "write_through",
        l2_dtype: str = "exact",
        host_bytes: int = 0,
        overlap_loads: bool = True,
    ) -> None:
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)
        assert write_policy in WRITE_POLICIES, write_policy
        self.tree.on_evict = self._on_evict
        self.kv_pool = kv_pool
        self.block = block_tokens(page_size)
        k0, v0 = kv_pool.k_buffers[0], kv_pool.v_buffers[0]
        assert k0.shape[1:] == v0.shape[1:], "K and V of different shapes are not supported"
        self.page_shape = (2, len(kv_pool.k_buffers), self.block, *k0.shape[1:])
        self.dtype = k0.dtype
        self.identity = identity
        self.codec = PageCodec(l2_dtype, self.dtype, self.page_shape)
        if host_bytes > 0:  # a byte budget holds more tokens in a compact form
            host_tokens = host_bytes // self.codec.page_bytes * self.block
        self.host = HostTier(host_tokens, self.block)
        self.storage = storage
        self.write_policy = write_policy
        self.pins: dict[str, tuple[TreeNode, int]] = {}  # name -> (locked node, tokens)
        self._roots: dict[object, bytes] = {}
        self._in_l3: set[bytes] = set()  # pages this process wrote to or read from L3
        self._down_until = 0.0
        self._flushing = False
        self.stats = dict.fromkeys(
            ("l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "l2_write_bytes",
             "l3_write_bytes", "l2_read_bytes", "l3_read_bytes", "loads", "load_seconds",
             "corrupt_pages", "storage_errors", "prefetches", "prefetch_seconds"), 0)  # fmt: skip
        self._writes: queue.Queue | None = None
        self._loads: queue.Queue | None = None
        self._from_l3: set[bytes] = set()  # L2 pages a prefetch read from L3, not yet used
        if storage is not None:
            self._writes = queue.Queue()
            threading.Thread(target=self._writer, name="hicache-writer", daemon=True).start()
            if overlap_loads:
                self._loads = queue.Queue()
                threading.Thread(target=self._loader, name="hicache-loader", daemon=True).start()

    # ---------------------------------------------------------------- keys and copies
    def _root(self, extra_key) -> bytes:
        root = self._roots.get(extra_key)
        if root is None:
            fmt = f"{self.dtype}{self.codec.tag}" if self.codec.tag else self.dtype
            root = root_hash(self.identity, fmt, self.page_shape, self.block, extra_key)
            self._roots[extra_key] = root
        return root

    @staticmethod
    def _run(slots: np.ndarray) -> slice | None:
        """`slots` as a slice when they are consecutive (fresh pages usually are): a slice
        copy runs at memory speed, an indexed copy was ~10x slower on the CPU."""
        n = len(slots)
        first = int(slots[0])
        if n and int(slots[-1]) - first == n - 1 and bool((slots[1:] - slots[:-1] == 1).all()):
            return slice(first, first + n)
        return None

    def _gather(self, slots: np.ndarray) -> torch.Tensor:
        """The KV of `slots` as [2, layers, n, kv_heads, head_dim] (a copy)."""
        pool = self.kv_pool
        run = self._run(slots)
        index = torch.from_numpy(slots) if run is None else None
        out = torch.empty(
            self.page_shape[:2] + (len(slots),) + self.page_shape[3:], dtype=self.dtype
        )
        for layer, (kb, vb) in enumerate(zip(pool.k_buffers, pool.v_buffers)):
            if run is not None:
                out[0, layer].copy_(kb[run])
                out[1, layer].copy_(vb[run])
            else:
                torch.index_select(kb, 0, index, out=out[0, layer])
                torch.index_select(vb, 0, index, out=out[1, layer])
        return out

    def _scatter(self, slots: np.ndarray, kv: torch.Tensor) -> None:
        run = self._run(slots)
        index = torch.from_numpy(slots) if run is None else None
        for layer, (kb, vb) in enumerate(zip(self.kv_pool.k_buffers, self.kv_pool.v_buffers)):
            if run is not None:
                kb[run].copy_(kv[0, layer])
                vb[run].copy_(kv[1, layer])
            else:
                kb.index_copy_(0, index, kv[0, layer])
                vb.index_copy_(0, index, kv[1, layer])

    def _store_pages(self, tokens: list[int], slots: np.ndarray, first: int, extra_key,
                     to_l3: bool) -> None:  # fmt: skip
        """Copy pages `first..` of `tokens` (KV at `slots`, one per token) to L2, and to L3
        when `to_l3`; pages a tier already holds are only refreshed."""
        keys = page_keys(self._root(extra_key), tokens, self.block, start=first)
        b = self.block
        for i, key in enumerate(keys):
            in_l2 = self.host.get(key) is not None
            need_l3 = to_l3 and key not in self._in_l3
            if in_l2 and not need_l3:
                continue
            lo = (first + i) * b
            kv = self.codec.pack(self._gather(slots[lo : lo + b]))
            if not in_l2:
                self._host_put(key, kv)
            if need_l3:
                self._queue_write(key, kv)

    def _host_put(self, key: bytes, kv: torch.Tensor) -> None:
        self.stats["l2_write_bytes"] += kv.numel() * kv.element_size()
        for old, old_kv in self.host.put(key, kv):
            self._from_l3.discard(old)
            if self.write_policy == "write_back" and old not in self._in_l3:
                self._queue_write(old, old_kv)

    # ---------------------------------------------------------------- L3
    def _storage_call(self, fn: Callable, *args) -> tuple[bool, object]:
        """(ok, result) of a backend call; an error is counted and the backend is not asked
        again for RETRY_S (a miss, so the caller recomputes)."""
        if self.storage is None or time.monotonic() < self._down_until:
            return False, None
        try:
            return True, fn(*args)
        except Exception as e:  # any backend failure degrades to a recompute
            self.stats["storage_errors"] += 1
            self._down_until = time.monotonic() + RETRY_S
            logger.warning("hicache storage %s failed: %s", self.storage.name, e)
            return False, None

    def _queue_write(self, key: bytes, kv: torch.Tensor) -> None:
        if self._writes is None:
            return
        self._in_l3.add(key)
        self._writes.put((key, kv))

    def _writer(self) -> None:
        while True:
            key, kv = self._writes.get()
            try:
                data = encode_page(key, kv)
                ok, _ = self._storage_call(self.storage.put, "kv:" + key.hex(), data)
                if ok:
                    self.stats["l3_write_bytes"] += len(data)
                else:
                    self._in_l3.discard(key)  # not written: a later store tries again
            finally:
                self._writes.task_done()

    def flush_writes(self) -> None:
        """Wait until every queued L3 write is done (pins, tests, shutdown)."""
        if self._writes is not None:
            self._writes.join()

    def _l3_get(self, key: bytes) -> torch.Tensor | None:
        _, data = self._storage_call(self.storage.get, "kv:" + key.hex())
        if data is None:
            return None
        kv = decode_page(key, data, self.codec.stored_shape, self.codec.stored_dtype)
        if kv is None:  # truncated, corrupt or not this page: never used, recomputed
            self._drop_bad(key)
            return None
        self.stats["l3_read_bytes"] += len(data)
        self._in_l3.add(key)
        return kv

    def _drop_bad(self, key: bytes) -> None:
        self.stats["corrupt_pages"] += 1
        self._storage_call(self.storage.delete, "kv:" + key.hex())
        self._in_l3.discard(key)

    # ---------------------------------------------------------------- overlapped loads
    def prefetch(self, key: Sequence[int], extra_key) -> Prefetch | None:
        """Start reading, on the loader thread, the L3 pages of `key` past what L1 and L2
        hold; None when there is nothing to read (or loads are not overlapped)."""
        if self._loads is None or time.monotonic() < self._down_until:
            return None
        key = list(key)
        n1 = len(self.tree.match_prefix(key, extra_key).indices)
        usable = len(key) // self.block * self.block
        keys = page_keys(self._root(extra_key), key[:usable], self.block, start=n1 // self.block)
        i = 0
        while i < len(keys) and keys[i] in self.host:
            i += 1
        if i == len(keys):
            return None
        job = Prefetch(keys[i:])
        self.stats["prefetches"] += 1
        self._loads.put(job)
        return job

    def _loader(self) -> None:
        """Reads and checks pages only: every cache structure is the scheduler thread's."""
        while True:
            job = self._loads.get()
            t0 = time.perf_counter()
            for k in job.keys:
                try:
                    data = self.storage.get("kv:" + k.hex())
                except Exception as e:  # reported by finish_prefetch, a miss here
                    job.error = e
                    break
                if data is None:
                    break
                stored = decode_page(k, data, self.codec.stored_shape, self.codec.stored_dtype)
                if stored is None:
                    job.bad = k
                    break
                job.pages.append((k, stored, len(data)))
            job.seconds = time.perf_counter() - t0
            job.done.set()

    def finish_prefetch(self, job: Prefetch) -> None:
        """On the scheduler thread, once `job.done`: its pages enter L2 (load_back counts
        them as L3 hits), a bad page is deleted, an error pauses the backend."""
        self.stats["prefetch_seconds"] += job.seconds
        for k, stored, n in job.pages:
            self.stats["l3_read_bytes"] += n
            self._in_l3.add(k)
            self._from_l3.add(k)
            self._host_put(k, stored)
        if job.bad is not None:
            self._drop_bad(job.bad)
        if job.error is not None:
            self.stats["storage_errors"] += 1
            self._down_until = time.monotonic() + RETRY_S
            logger.warning("hicache storage %s failed: %s", self.storage.name, job.error)

    # ---------------------------------------------------------------- tree hooks
    def _path(self, node: TreeNode) -> tuple[list[int], np.ndarray]:
        """Tokens and slots from the root to the end of `node`."""
        keys, values = [], []
        while node is not self.tree.root:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = [t for k in reversed(keys) for t in k]
        return tokens, np.concatenate(values[::-1])

    def _on_evict(self, node: TreeNode) -> None:
        """Keep the evicted node's whole pages (a page straddling its start reads the head
        from its still-attached parent) in L2; the tail past its last whole page is lost."""
        if self._flushing:
            return
        tokens, slots = self._path(node)
        depth = len(tokens) - len(node.key)
        end = len(tokens) // self.block * self.block
        first = depth // self.block
        if end > first * self.block:
            self._store_pages(tokens[:end], slots, first, node.extra_key, to_l3=False)

    def _insert_computed(self, req: ReqLike):
        if self.write_policy == "write_through":
            n_borrowed = len(req.prefix_indices)
            end = req.kv_len // self.block * self.block
            if end > n_borrowed // self.block * self.block:
                self._store_pages(
                    list(req.fill_ids[:end]),
                    self._row(req)[:end],
                    n_borrowed // self.block,
                    getattr(req, "extra_key", None),
                    to_l3=self.storage is not None,
                )
        return super()._insert_computed(req)

    # ---------------------------------------------------------------- loading
    def load_back(
        self,
        key: Sequence[int],
        extra_key: str | None,
        alloc: Callable[[int], np.ndarray | None],
    ) -> int:
        """Extend the L1 match of `key` with the pages L2/L3 hold (see the module docstring);
        returns the tokens loaded into L1. `alloc(n)` gives n fresh slots (or None)."""
        t0 = time.perf_counter()
        key = list(key)
        usable = len(key) // self.block * self.block
        match = self.tree.match_prefix(key, extra_key)
        n1 = len(match.indices)
        self.stats["l1_hit_tokens"] += n1
        first = n1 // self.block
        if (first + 1) * self.block > usable:
            return 0
        found: list[torch.Tensor] = []
        tiers: list[int] = []
        for k in page_keys(self._root(extra_key), key[:usable], self.block, start=first):
            kv, tier = self.host.get(k), 2
            if kv is not None and k in self._from_l3:
                self._from_l3.discard(k)
                tier = 3
            if kv is None and self.storage is not None:
                kv, tier = self._l3_get(k), 3
            if kv is None:
                break
            found.append(kv)
            tiers.append(tier)
        if not found:
            return 0
        end = (first + len(found)) * self.block
        n = end - n1
        self.tree.inc_lock_ref(match.last_node)  # the L1 part must survive alloc's eviction
        slots = alloc(n)
        self.tree.dec_lock_ref(match.last_node)
        if slots is None:
            return 0
        kv = torch.cat([self.codec.unpack(f) for f in found], dim=2)
        kv = kv[:, :, n1 - first * self.block :]
        self._scatter(slots, kv)
        present = self.tree.insert(key[:end], np.concatenate([match.indices, slots]), extra_key)
        if present > n1:  # cannot happen single-threaded; keep the ownership rule anyway
            self.token_to_kv_pool_allocator.free(slots[: present - n1])
        page_bytes = self.codec.page_bytes
        self.stats["l2_read_bytes"] += tiers.count(2) * page_bytes
        for i, tier in enumerate(tiers):  # the first page may be partly in L1 already
            got = self.block - (n1 - first * self.block if i == 0 else 0)
            self.stats[f"l{tier}_hit_tokens"] += got
        self.stats["loads"] += 1
        self.stats["load_seconds"] += time.perf_counter() - t0
        return n

    # ---------------------------------------------------------------- pins (CAG)
    def _pin_key(self, name: str) -> str:
        return f"pin:{self.identity[:16]}:{name}"

    def pin(self, name: str, tokens: list[int], text: str | None, extra_key=None,
            persist: bool = True) -> int:  # fmt: skip
        """Lock the cached prefix `tokens` (it must be in L1 already) under `name`, store its
        pages and record in L3; returns the tokens pinned. ValueError if not cached.
        `persist=False` (restoring a stored record) locks whatever part is cached."""
        match = self.tree.match_prefix(tokens, extra_key)
        n = len(match.indices)
        want = len(tokens) // self.page_size * self.page_size if persist else 1
        if n < want or n == 0:
            raise ValueError(f"input_ids: only {n} of the prefix's {want} tokens are cached")
        if name in self.pins:
            self.unpin(name, forget=False)
        self.tree.inc_lock_ref(match.last_node)
        self.pins[name] = (match.last_node, n)
        if self.storage is not None and persist:
            end = n // self.block * self.block
            if end:
                self._store_pages(tokens[:end], match.indices, 0, extra_key, to_l3=True)
            record = {"name": name, "input_ids": tokens[:n], "text": text,
                      "extra_key": extra_key, "tokens": n, "created": time.time()}  # fmt: skip
            self.flush_writes()
            self._storage_call(self.storage.put, self._pin_key(name), json.dumps(record).encode())
        return n

    def unpin(self, name: str, forget: bool = True) -> bool:
        """Release a pin (its KV becomes ordinary cache); `forget` also drops its L3 record."""
        entry = self.pins.pop(name, None)
        if entry is not None:
            self.tree.dec_lock_ref(entry[0])
        if forget and self.storage is not None:
            self._storage_call(self.storage.delete, self._pin_key(name))
        return entry is not None

    def stored_pins(self) -> list[dict]:
        """The pin records in L3 (this model's), whichever replica or run wrote them."""
        if self.storage is None:
            return []
        out = []
        for k in self._storage_call(self.storage.keys, self._pin_key(""))[1] or []:
            data = self._storage_call(self.storage.get, k)[1]
            try:
                out.append(json.loads(data))
            except (TypeError, ValueError):
                continue
        return out

    def list_pinned(self) -> list[dict]:
        seen = {}
        for rec in self.stored_pins():
            seen[rec["name"]] = {"name": rec["name"], "tokens": rec["tokens"],
                                 "text": rec.get("text"), "resident": False}  # fmt: skip
        for name, (_, n) in self.pins.items():
            seen.setdefault(name, {"name": name, "tokens": n, "text": None})["resident"] = True
        return sorted(seen.values(), key=lambda r: r["name"])

    # ---------------------------------------------------------------- state
    def reset(self) -> None:
        """Flush L1 and L2 (L3 is shared and persistent: kept). Pins stay locked."""
        self._flushing = True
        try:
            self.tree.evict(self.tree.total_size())
        finally:
            self._flushing = False
        self.host.clear()
        pinned = sum(n for _, n in self.pins.values())
        assert self.tree.evictable_size() == 0, "reset with unlocked tokens left"
        if not self.pins:
            assert self.tree.total_size() == 0, "reset with tokens still locked by live requests"
            self.tree.reset()
        else:
            assert self.tree.protected_size() >= pinned

    def summary(self) -> dict:
        s = {f"hicache_{k}": v for k, v in self.stats.items()}
        s["hicache_l2_tokens"] = self.host.tokens
        s["hicache_l2_capacity_tokens"] = self.host.capacity
        s["hicache_pinned_tokens"] = sum(n for _, n in self.pins.values())
        s["hicache_storage_backend"] = self.storage.name if self.storage is not None else None
        s["hicache_l2_dtype"] = self.codec.name
        s["hicache_overlap_loads"] = self._loads is not None
        if self.storage is not None and getattr(self.storage, "max_bytes", 0) > 0:
            s["hicache_storage_bytes"] = self.storage.stored_bytes
            s["hicache_storage_evicted_pages"] = self.storage.evicted
        return s
