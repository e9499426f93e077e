"""What the scheduler takes from a GGUF model's tokenizer, without building the tokenizer.

The scheduler process keeps a tokenizer for stop strings (the decoded tail of an output), the
EOS ids, the grammar backend (built by the first constrained request), jump-forward and the
drafters. Gemma 3's tokenizer (262k tokens, 515k merges) holds ~100 MB resident for the
process's life, and a scheduler that serves plain and stop-string requests needs only two of
those things: `eos_ids` reads the ids from the file's metadata, and `VocabDecoder` decodes ids
from the vocabulary, laid out as one byte string (Gemma 3: ~3 MB), as the tokenizer's decoder
does (tests/test_gguf_vocab.py compares both on every token and on random sequences).
`LazyTokenizer` hands both out and builds the real tokenizer (runtime/tokenizer.py) the first
time anything else is asked of it: the grammar backend's build, on its own thread.
"""

from __future__ import annotations

import re
import threading

import numpy as np

from loom.runtime.gguf.file import metadata
from loom.runtime.gguf.tokenizer import _END_OF_TURN, CONTROL

_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte-fallback tokens


class VocabDecoder:
    """`decode(ids, skip_special_tokens)` equal to the tokenizer gguf_tokenizer builds:
    - byte-level BPE (`gpt2`): each token's characters mapped back to its bytes (a token
      spelled outside the byte alphabet: its own UTF-8), the whole run decoded with U+FFFD
      for each invalid sequence (the ByteLevel decoder's from_utf8_lossy);
    - sentencepiece (`llama`): '▁' read as a space, runs of byte tokens (<0xNN>) decoded
      together, each byte of a run that is not UTF-8 a U+FFFD (the ByteFallback decoder).
    Special tokens (CONTROL, added as special by gguf_tokenizer) are dropped when asked."""

    def __init__(self, path: str):
        meta = metadata(path)
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            inverse = {c: b for b, c in bytes_to_unicode().items()}

            def raw(t: str) -> tuple[bytes, bool]:
                in_alphabet = all(c in inverse for c in t)
                return (bytes(inverse[c] for c in t) if in_alphabet else t.encode()), in_alphabet

        elif kind == "llama":

            def raw(t: str) -> tuple[bytes, bool]:
                return t.replace("\u2581", " ").encode(), True

        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2, llama)")
        self.byte_level = kind == "gpt2"
        pieces, special = zip(*map(raw, tokens)) if tokens else ((), ())
        self.special = np.array(special, dtype=bool) & (np.array(types) == CONTROL)
        self.byte = np.full(len(tokens), -1, dtype=np.int16)
        if kind == "llama":
            for i, t in enumerate(tokens):
                if t.startswith("<0x") and (m := _BYTE.fullmatch(t)):
                    self.byte[i] = int(m[1], 16)
        self.offsets = np.zeros(len(tokens) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in pieces], out=self.offsets[1:])
        self.blob = b"".join(pieces)
        self.vocab_size = len(tokens)

    def _piece(self, i: int) -> bytes:
        return self.blob[self.offsets[i] : self.offsets[i + 1]]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        if skip_special_tokens:
            ids = [i for i in ids if not self.special[i]]
        if self.byte_level:
            return b"".join(self._piece(i) for i in ids).decode("utf-8", "replace")
        out, run = [], bytearray()
        for i in ids:
            if self.byte[i] >= 0:
                run.append(int(self.byte[i]))
                continue
            if run:
                out.append(_run_text(run))
                run = bytearray()
            out.append(self._piece(i).decode())
        if run:
            out.append(_run_text(run))
        return "".join(out)


def _run_text(run: bytearray) -> str:
    try:
        return run.decode()
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def eos_ids(path: str) -> set[int]:
    """The EOS ids runtime/tokenizer.eos_token_ids gives a GGUF file, from its metadata alone:
    the EOS / end-of-turn ids it names, and its family's end-of-turn tokens by text."""
    meta = metadata(path)
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = {meta[k] for k in keys if k in meta}
    texts = _END_OF_TURN.get(meta.get("general.architecture"), ())
    if texts:
        tokens = meta["tokenizer.ggml.tokens"]
        ids |= {tokens.index(t) for t in texts if t in tokens}
    return ids


class LazyTokenizer:
    """The scheduler's tokenizer of a GGUF file: `decode` from the vocabulary, anything else
    from the real tokenizer, built the first time it is asked for (once, under a lock: the
    grammar backend's build thread and the scheduler's may both ask)."""

    def __init__(self, path: str, decoder: VocabDecoder, file: str):
        self._path, self._decoder, self.file = path, decoder, file
        self._tok = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._tok is not None

    def full(self):
        with self._lock:
            if self._tok is None:
                from loom.runtime.tokenizer import load_tokenizer

                self._tok = load_tokenizer(self._path)
            return self._tok

    def decode(self, ids, skip_special_tokens: bool = False, **kw) -> str:
        if kw or self._tok is not None:
            return self.full().decode(ids, skip_special_tokens=skip_special_tokens, **kw)
        return self._decoder.decode(ids, skip_special_tokens)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_path", "_decoder", "_tok", "_lock", "file"):
            raise AttributeError(name)  # copy / pickle probes, and before __init__ set them
        return getattr(self.full(), name)


def real_tokenizer(tokenizer):
    """The tokenizer itself (built now if `tokenizer` is a LazyTokenizer not yet built)."""
    return tokenizer.full() if isinstance(tokenizer, LazyTokenizer) else tokenizer


def scheduler_tokenizer(path: str, lazy: bool = True):
    """The scheduler's tokenizer: a GGUF file's lazy (unless `lazy` is off: a drafter reads
    the vocabulary at start-up), any other the tokenizer itself."""
    from loom.runtime.gguf.file import gguf_file
    from loom.runtime.tokenizer import load_tokenizer

    file = gguf_file(path)
    if file is None or not lazy:
        return load_tokenizer(path)
    from loom.runtime.process import release_free_heap

    decoder = VocabDecoder(str(file))
    release_free_heap()  # the vocabulary's Python strings, freed
    return LazyTokenizer(path, decoder, str(file))


def scheduler_eos_ids(model_path: str, tokenizer) -> set[int]:
    """runtime/tokenizer.eos_token_ids, without building a LazyTokenizer that is not built."""
    from loom.runtime.tokenizer import eos_token_ids

    if isinstance(tokenizer, LazyTokenizer) and not tokenizer.loaded:
        return eos_ids(tokenizer.file) | eos_token_ids(model_path, None)
    return eos_token_ids(model_path, tokenizer)
