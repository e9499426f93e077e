"""Content-addressed KV pages: their keys and their stored form.

A page is `block` consecutive tokens of one prefix, starting at a multiple of `block` from the
prompt's first token. Its key is a hash chain:

    h_0 = blake2b(model identity | KV dtype | KV shape | block | extra_key)
    h_i = blake2b(h_{i-1} | token ids of page i)

so a key names the model (weights, config), the storage format and every token before and in
the page: a page can never be served to another model, another format or another prefix, and
two replicas (or a restarted server) computing the same prefix find each other's pages.

How L2 and L3 hold a page (`PageCodec`, `--hicache-l2-dtype`): `exact`, the pool's own dtype
(bit-exact: greedy outputs never depend on the tier); `bf16` (half of an f32 pool's bytes;
lossless, hence `exact`, when the pool is bf16 already); `int8` with one float32 scale per
(K or V, layer, kv head) of each page (a quarter of f32). The lossy forms are opt-in: a prefix
loaded from them gives slightly different logits (measured in benchmarks/bench_hicache_l2.py).
The stored form is part of the root hash, so an exact page and a bf16 one never share a key.

Stored form: a fixed header (magic, key, dtype, shape, payload length, payload checksum) and
the payload, K then V of every layer, `[2, layers, block, kv_heads, head_dim]`. `decode_page`
rejects a page whose header, key, length or checksum is wrong: the caller recomputes it.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

MAGIC = b"LOOMKV01"
_HEADER = struct.Struct("<8s16sB5IQ16s")  # magic, key, dtype, 5 dims, payload bytes, checksum
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.uint8]  # codes: append only
DIGEST = 16


def model_identity(model_path: str, config_json: str) -> str:
    """A model's identity for page keys: its config and each weight file's name, size and the
    hashes of its first and last 64 KiB (reading whole checkpoints at start-up costs seconds;
    two checkpoints that differ only in their middle bytes are not a case loom serves)."""
    h = hashlib.blake2b(config_json.encode(), digest_size=DIGEST)
    folder = Path(model_path)
    for f in sorted(folder.iterdir()) if folder.is_dir() else []:
        if f.suffix not in (".safetensors", ".bin", ".gguf", ".pt"):
            continue
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(65536))
            fh.seek(max(0, size - 65536))
            h.update(fh.read(65536))
    return h.hexdigest()


def root_hash(identity: str, dtype: torch.dtype, shape: tuple, block: int, extra_key) -> bytes:
    text = f"{identity}|{dtype}|{tuple(shape)}|{block}|{extra_key!r}"
    return hashlib.blake2b(text.encode(), digest_size=DIGEST).digest()


def page_keys(root: bytes, tokens: Sequence[int], block: int, start: int = 0) -> list[bytes]:
    """Keys of the whole pages of `tokens` (pages `start..`; the chain still covers every token
    before them)."""
    keys: list[bytes] = []
    prev = root
    buf = array("i", tokens)
    for i in range(len(tokens) // block):
        prev = hashlib.blake2b(
            prev + buf[i * block : (i + 1) * block].tobytes(), digest_size=DIGEST
        ).digest()
        if i >= start:
            keys.append(prev)
    return keys


L2_DTYPES = ("exact", "bf16", "int8")


class PageCodec:
    """Packs a page `[2, layers, block, kv_heads, head_dim]` of the pool's dtype into its
    stored form and back. `tag` enters the page keys ("" for exact: keys as before)."""

    def __init__(self, name: str, pool_dtype: torch.dtype, page_shape: tuple):
        if name not in L2_DTYPES:
            raise ValueError(f"hicache_l2_dtype: {name!r} must be one of {L2_DTYPES}")
        if name == "bf16" and pool_dtype == torch.bfloat16:
            name = "exact"  # the same bytes: share the exact pages' keys
        self.name = name
        self.pool_dtype = pool_dtype
        self.page_shape = tuple(page_shape)
        two, layers, _, heads, _ = self.page_shape
        self._scale_shape = (two, layers, 1, heads, 1)
        n = 1
        for d in self.page_shape:
            n *= d
        if name == "exact":
            self.stored_dtype, self.stored_shape = pool_dtype, self.page_shape
        elif name == "bf16":
            self.stored_dtype, self.stored_shape = torch.bfloat16, self.page_shape
        else:  # float32 scales then int8 values, as one byte row (5 dims for the header)
            self._n_scale_bytes = two * layers * heads * 4
            self.stored_dtype = torch.uint8
            self.stored_shape = (1, 1, 1, 1, self._n_scale_bytes + n)
        self.tag = "" if name == "exact" else f"->{name}"
        self.page_bytes = self.stored_dtype.itemsize
        for d in self.stored_shape:
            self.page_bytes *= d

    @property
    def lossless(self) -> bool:
        return self.name == "exact"

    def pack(self, kv: torch.Tensor) -> torch.Tensor:
        if self.name == "exact":
            return kv
        if self.name == "bf16":
            return kv.to(torch.bfloat16)
        x = kv.float()
        scale = x.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
        return torch.cat([scale.reshape(-1).view(torch.uint8), q.reshape(-1).view(torch.uint8)]
                         ).view(self.stored_shape)  # fmt: skip

    def unpack(self, stored: torch.Tensor) -> torch.Tensor:
        if self.name == "exact":
            return stored
        if self.name == "bf16":
            return stored.to(self.pool_dtype)
        flat = stored.reshape(-1)
        scale = flat[: self._n_scale_bytes].view(torch.float32).view(self._scale_shape)
        q = flat[self._n_scale_bytes :].view(torch.int8).view(self.page_shape)
        return (q.float() * scale).to(self.pool_dtype)


def encode_page(key: bytes, kv: torch.Tensor) -> bytes:
    """kv: [2, layers, block, kv_heads, head_dim] on the CPU, contiguous."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    checksum = hashlib.blake2b(payload, digest_size=DIGEST).digest()
    header = _HEADER.pack(MAGIC, key, _DTYPES.index(kv.dtype), *kv.shape, len(payload), checksum)
    return header + payload


def decode_page(key: bytes, data, shape: tuple, dtype: torch.dtype) -> torch.Tensor | None:
    """The page's kv tensor (a copy), or None when `data` is not exactly a good page for `key`
    of this shape and dtype (missing, truncated, corrupt, or another key's)."""
    if data is None or len(data) < _HEADER.size:
        return None
    magic, k, code, *rest = _HEADER.unpack_from(data, 0)
    dims, nbytes, checksum = tuple(rest[:5]), rest[5], rest[6]
    if magic != MAGIC or k != key or dims != tuple(shape) or code >= len(_DTYPES):
        return None
    if _DTYPES[code] != dtype or len(data) != _HEADER.size + nbytes:
        return None
    payload = memoryview(data)[_HEADER.size :]
    if hashlib.blake2b(payload, digest_size=DIGEST).digest() != checksum:
        return None
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).view(shape)
