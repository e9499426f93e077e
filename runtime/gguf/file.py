"""Finding a GGUF model file and reading its metadata and tensors (runtime/gguf/reader.py: a
header reader over one memory map, with ggml's `gguf` package's type tables)."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a folder that has no
    config.json (a folder holding an HF checkpoint is loaded as one). None: not a GGUF model."""
    p = Path(path)
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(p.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"model_path: {str(path)!r} holds several GGUF files ({names}); name one")
    return found[0] if found else None


@lru_cache(maxsize=4)
def open_reader(path: str):
    """A memory-mapped reader (tensor data is read on access, not here)."""
    from loom.runtime.gguf.reader import GGUFFile

    try:
        return GGUFFile(path)
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"model_path: {path!r} is not a readable GGUF file: {e}") from e


@lru_cache(maxsize=4)
def metadata(path: str) -> Mapping[str, Any]:
    """Every key-value field of the file as Python values (lists for arrays, decoded on each
    read: reader.Fields)."""
    return open_reader(path).fields
