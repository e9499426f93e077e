"""Content-addressed KV pages: their keys and their stored form.

A page is `block` consecutive tokens of one prefix, starting at a multiple of `block` from the
prompt's first token. Its key is a hash chain:

    h_0 = blake2b(model identity | KV dtype | KV shape | block | extra_key)
    h_i = blake2b(h_{i-1} | token ids of page i)

so a key names the model (weights, config), the storage format and every token before and in
the page: a page can never be served to another model, another format or another prefix, and
two replicas (or a restarted server) computing the same prefix find each other's pages.

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
_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
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
