"""A fast GGUF header reader: metadata and tensor views over one memory map.

`gguf.GGUFReader` builds a numpy memmap view for every part of every field while it opens a
file, so a 262k-token vocabulary (three arrays: tokens, scores, types) costs about a million
view constructions: 9 s for SmolLM2 and 25 s for Gemma 3 270M on an idle machine, before any
weight is read. Here a numeric array is one `np.frombuffer` view and a string array one pass
of `struct.unpack_from` over the mapped bytes; the tensors are numpy views of the same map,
shaped exactly as GGUFReader shapes them (block types as uint8 [..., rows, row_bytes]), so
`gguf.quants.dequantize` and loom's QuantizedTensor read them unchanged. ggml's own package
still supplies the type tables (GGMLQuantizationType, GGML_QUANT_SIZES, GGUFValueType).

Format (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64
key count; each key: string, u32 value type, value (an array: u32 element type, u64 count,
elements); each tensor: string name, u32 n_dims, u64 dims (fastest first), u32 ggml type, u64
offset from the data start; data starts at the next multiple of general.alignment (32).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {  # GGUFValueType -> numpy dtype (little-endian)
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("?"),
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
_FLOAT_ITEMS = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, fastest first (as GGUFReader's `shape`)
    data: np.ndarray  # a read-only view of the map


@dataclass(frozen=True)
class _Array:
    """Where a one-level array's elements lie in the map: decoded when read, never kept."""

    etype: int
    count: int
    pos: int


class Fields(Mapping):
    """Every key's value, as GGUFReader's `field.contents()` gives it. Scalars and strings are
    parsed with the header; an array is decoded from the map each time it is read, into a
    fresh list, so an open file does not hold its vocabulary as Python objects: Gemma 3's
    262k tokens, scores and types were 43 MB of every process that had the file open, for the
    process's life (the reader is cached), though only the tokenizer's build reads them."""

    def __init__(self, file: GGUFFile):
        self._file = file
        self._values: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        v = self._values[key]
        return self._file._read_array(v) if isinstance(v, _Array) else v

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


class GGUFFile:
    """`fields`: every key's value as Python values (str, int, float, bool; arrays as lists),
    as GGUFReader's `field.contents()` gives them (a `Fields` mapping: arrays are decoded on
    each read); `tensors`: in file order."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self._path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        self._pos = 0
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (byte-swapped or unknown); loom reads 2 and 3")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._pos = 24
        self.fields = Fields(self)
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields._values[key] = self._value(vtype, lazy=True)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = np.frombuffer(buf, "<u8", n_dims, self._pos).copy()
            self._pos += 8 * n_dims
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, dims, GGMLQuantizationType(ggml_type), offset))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        whole = np.frombuffer(buf, np.uint8)
        self._base = whole.ctypes.data
        self.tensors: list[Tensor] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"duplicated tensor {name!r}")
            seen.add(name)
            block, type_size = GGML_QUANT_SIZES[kind]
            n = int(np.prod(dims))
            shape = tuple(int(d) for d in reversed(dims))
            raw = whole[start + offset : start + offset + n * type_size // block]
            if kind.name in _FLOAT_ITEMS:
                data = raw.view(_FLOAT_ITEMS[kind.name]).reshape(shape)
            else:  # block rows: the last dim in bytes
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(Tensor(name, kind, dims, data))

    def drop_pages(self, t: Tensor) -> None:
        """Take the pages of tensor `t` out of this process's resident set, once its bytes were
        copied out (a later read of t.data faults them back in from the page cache). Loading
        SmolLM2 otherwise kept the whole 98 MB file resident beside the copies."""
        if not hasattr(mmap, "MADV_DONTNEED") or not t.data.nbytes:
            return
        off = t.data.ctypes.data - self._base
        lo = off // mmap.PAGESIZE * mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, lo, off + t.data.nbytes - lo)

    def read_into(self, t: Tensor, out: np.ndarray) -> None:
        """Copy tensor `t`'s bytes into `out` (C-contiguous, t.data.nbytes bytes) with read(2)
        from the file, not through the map: the bytes pass through the page cache only, so
        this process never holds a weight twice (a copy out of the map faulted the map's pages
        in beside the copy: Gemma 3's 170 MB Q8_0 embedding peaked +340 MB while it loaded)."""
        if out.nbytes != t.data.nbytes or not out.flags.c_contiguous:
            raise ValueError(f"{t.name}: read_into needs {t.data.nbytes} contiguous bytes")
        view = memoryview(out.reshape(-1).view(np.uint8))
        pos = t.data.ctypes.data - self._base
        with open(self._path, "rb", buffering=0) as f:
            done = 0
            while done < len(view):  # read(2) returns at most ~2 GB at a time
                n = os.preadv(f.fileno(), [view[done:]], pos + done)
                if n <= 0:
                    raise ValueError(f"{t.name}: the file ends inside the tensor")
                done += n

    def drop_all(self) -> None:
        """Take every page of the map out of this process's resident set (the header and the
        vocabulary the tokenizer read, the float tensors copied out): later reads fault them
        back in from the page cache."""
        if hasattr(mmap, "MADV_DONTNEED") and len(self._map):
            self._map.madvise(mmap.MADV_DONTNEED)

    def _unpack(self, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return out

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._pos)
        s = self._map[self._pos + 8 : self._pos + 8 + n].decode("utf-8")
        self._pos += 8 + n
        return s

    def _value(self, vtype: int, lazy: bool = False) -> Any:
        """The value at the read position (moved past it); `lazy`: a one-level array as an
        _Array that `_read_array` decodes later."""
        if vtype in _SCALARS:
            dt = _SCALARS[vtype]
            v = np.frombuffer(self._map, dt, 1, self._pos)[0].item()
            self._pos += dt.itemsize
            return v
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, count = self._unpack("<IQ")
        if etype in _SCALARS or etype == _STRING:
            arr = _Array(etype, count, self._pos)
            self._pos = self._array_end(arr)
            return arr if lazy else self._read_array(arr)
        return [self._value(etype) for _ in range(count)]  # arrays of arrays

    def _array_end(self, arr: _Array) -> int:
        if arr.etype in _SCALARS:
            end = arr.pos + _SCALARS[arr.etype].itemsize * arr.count
        else:  # strings: walk the lengths
            buf, end = self._map, arr.pos
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(arr.count):
                end += 8 + unpack(buf, end)[0]
        if end > len(self._map):
            raise ValueError("an array runs past the end of the file")
        return end

    def _read_array(self, arr: _Array) -> list:
        if arr.etype in _SCALARS:
            return np.frombuffer(self._map, _SCALARS[arr.etype], arr.count, arr.pos).tolist()
        buf, pos, out = self._map, arr.pos, [None] * arr.count  # one pass: length, bytes, ...
        unpack = struct.Struct("<Q").unpack_from
        for i in range(arr.count):
            (n,) = unpack(buf, pos)
            out[i] = buf[pos + 8 : pos + 8 + n].decode("utf-8")
            pos += 8 + n
        return out
