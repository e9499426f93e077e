"""L3 of the hierarchical KV cache: the storage connector and its two backends.

`StorageBackend` is the interface a KV-offloading library (LMCache, Mooncake) would implement
to sit under loom's radix tree: byte values under string keys, with `keys(prefix)` for the
pinned-prefix records. Keys are `kv:<page hash hex>` (pages, see radix/pages.py) and
`pin:<model>:<name>`. Values are opaque here; integrity is checked by the reader
(`pages.decode_page`), so a backend may lose, truncate or mangle a value and the cost is a
recompute.

Backends raise on failure (a server down, a full disk); the hierarchical cache counts the
error, treats the call as a miss and stops calling the backend for a short while.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "loom", "hicache")


class StorageBackend(ABC):
    name: str

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or None when absent."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def keys(self, prefix: str) -> list[str]:
        """Every key starting with `prefix` (used for the few pin records, never for pages)."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections."""


class FileStorage(StorageBackend):
    """One file per key under a directory; written atomically (a temporary file renamed into
    place, so a reader never sees half a page from a crashed writer), read memory-mapped.

    `max_bytes` > 0 caps the page files (`kv:` keys; pin records are never deleted): past it
    the least recently used pages are deleted. Recency is this process's reads and writes,
    seeded at start-up from the files' modification times (a read touches the file, so the
    order survives restarts); replicas sharing a directory each enforce the cap on their own
    view, so the directory may briefly exceed it by what the others wrote since."""

    name = "file"

    def __init__(self, root: str | None = None, max_bytes: int = 0):
        self.root = Path(root or DEFAULT_DIR)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.evicted = 0  # page files deleted by the cap
        self._lock = threading.Lock()  # the writer and loader threads both touch the LRU
        self._lru: OrderedDict[str, int] = OrderedDict()  # kv key -> file bytes, oldest first
        self._bytes = 0
        if max_bytes > 0:
            found = []
            for p in (self.root / "kv").glob("*/*"):
                if not p.name.startswith(".tmp-"):
                    st = p.stat()
                    found.append((st.st_mtime, "kv:" + p.name, st.st_size))
            for _, key, size in sorted(found):
                self._lru[key] = size
                self._bytes += size
            self._enforce()

    def _touch(self, key: str, size: int | None) -> None:
        """Record a use of `key` (size None: a read) and delete the oldest pages past the cap."""
        if self.max_bytes <= 0 or not key.startswith("kv:"):
            return
        with self._lock:
            if size is None:
                if key in self._lru:
                    self._lru.move_to_end(key)
                    os.utime(self._path(key))
                return
            self._bytes += size - self._lru.pop(key, 0)
            self._lru[key] = size
            self._enforce()

    def _enforce(self) -> None:
        while self._bytes > self.max_bytes and len(self._lru) > 1:
            old, size = self._lru.popitem(last=False)
            self._bytes -= size
            self._path(old).unlink(missing_ok=True)
            self.evicted += 1

    @property
    def stored_bytes(self) -> int:
        """Bytes of page files this process accounts for (the cap's measure)."""
        return self._bytes

    def _path(self, key: str) -> Path:
        kind, _, rest = key.partition(":")
        if kind == "kv":  # fan out: one directory of millions of files is slow to list
            return self.root / kind / rest[:2] / rest
        return self.root / kind / rest.replace(":", "/")

    def get(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return b""
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    data = bytes(mm)
        except FileNotFoundError:
            return None
        try:
            self._touch(key, None)
        except FileNotFoundError:  # deleted by another process since: this read still stands
            pass
        return data

    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._touch(key, len(value))

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
        if key in self._lru:
            with self._lock:
                self._bytes -= self._lru.pop(key, 0)

    def keys(self, prefix: str) -> list[str]:
        kind, _, rest = prefix.partition(":")
        base = self.root / kind
        if not base.is_dir():
            return []
        out = []
        for p in base.rglob("*"):
            if p.is_file() and not p.name.startswith(".tmp-"):
                key = f"{kind}:" + ":".join(p.relative_to(base).parts)
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


class RedisStorage(StorageBackend):
    """A Redis (or Valkey) server shared by every replica. Short socket timeouts: a server that
    hangs costs a request at most one timeout before the cache stops asking it."""

    name = "redis"

    def __init__(self, url: str, namespace: str = "loom:", timeout: float = 0.5):
        try:
            import redis
        except ImportError as e:
            raise ValueError(
                "hicache_storage_backend: 'redis' needs the redis client (pip install redis)"
            ) from e

        self.ns = namespace
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def get(self, key: str) -> bytes | None:
        return self.client.get(self.ns + key)

    def put(self, key: str, value: bytes) -> None:
        self.client.set(self.ns + key, value)

    def exists(self, key: str) -> bool:
        return bool(self.client.exists(self.ns + key))

    def delete(self, key: str) -> None:
        self.client.delete(self.ns + key)

    def keys(self, prefix: str) -> list[str]:
        n = len(self.ns)
        found = self.client.scan_iter(match=self.ns + prefix + "*", count=1000)
        return sorted(k.decode()[n:] for k in found)

    def close(self) -> None:
        self.client.close()


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def create_storage(
    backend: str, directory: str | None, url: str | None, max_bytes: int = 0
) -> StorageBackend:
    if backend == "file":
        return FileStorage(directory, max_bytes)
    if backend == "redis":
        return RedisStorage(url or DEFAULT_REDIS_URL)
    raise ValueError(f"hicache_storage_backend: {backend!r} must be file or redis")
