"""Token id -> exact bytes, for any local Hugging Face tokenizer.

A grammar constrains text, but the sampler picks token ids, so every grammar engine needs the
byte string each id stands for. Tokenizers store those in three encodings:

- byte-level BPE (GPT-2, Llama-3, Qwen): every byte is shown as a printable character through
  GPT-2's byte-to-unicode table ("Ġ" is a space);
- SentencePiece (Llama-2, Mistral): "▁" is a space and "<0xNN>" pieces are raw bytes;
- added tokens: their content is plain text.

Special tokens (BOS, EOS, PAD, chat markers) have no bytes (None): a grammar never allows them,
except EOS ids once the grammar may end. So are ids past the tokenizer's size in a padded
model vocabulary.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

SENTINEL = "\U0010ffff"  # a noncharacter: ends every regex given to outlines-core
SENTINEL_BYTES = SENTINEL.encode()
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_CACHE: dict[tuple, tuple[Any, TokenVocabulary]] = {}
_CACHE_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's `bytes_to_unicode` table."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass
class TokenVocabulary:
    """The byte strings of a model's vocabulary.

    `token_bytes[i]` is the exact UTF-8 (or partial UTF-8) byte string of token i, or None when
    token i can never be produced by a grammar (special tokens, ids beyond the tokenizer).
    `len(token_bytes) == vocab_size`, the model's vocabulary size (the logits' width).
    """

    token_bytes: list[bytes | None]
    eos_token_ids: set[int]
    vocab_size: int
    _outlines: Any = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int | None = None, eos_token_ids=None
    ) -> TokenVocabulary:
        """Build (or fetch from the cache) the vocabulary of a HF tokenizer.

        `tokenizer`: a `transformers` tokenizer or a raw `tokenizers.Tokenizer`.
        `vocab_size`: the model's vocabulary size (default: the tokenizer's).
        `eos_token_ids`: ids that end generation (default: the tokenizer's eos token).
        """
        eos_key = tuple(sorted(eos_token_ids)) if eos_token_ids is not None else None
        key = (id(tokenizer), vocab_size, eos_key)
        with _CACHE_LOCK:
            hit = _CACHE.get(key)
            if hit is not None and hit[0] is tokenizer:
                return hit[1]
        vocab = cls._build(tokenizer, vocab_size, eos_token_ids)
        with _CACHE_LOCK:
            _CACHE[key] = (tokenizer, vocab)  # holding the tokenizer keeps its id unique
        return vocab

    @classmethod
    def _build(cls, tokenizer: Any, vocab_size: int | None, eos_token_ids) -> TokenVocabulary:
        pieces, special = _pieces_and_specials(tokenizer)
        n_tok = max(pieces.values()) + 1 if pieces else 0
        size = vocab_size if vocab_size is not None else n_tok
        if eos_token_ids is None:
            eos_token_ids = _default_eos(tokenizer, pieces)
        eos = {int(i) for i in eos_token_ids if 0 <= int(i) < size}
        decode = _piece_decoder(tokenizer, pieces)
        token_bytes: list[bytes | None] = [None] * size
        for piece, tid in pieces.items():
            if tid >= size or tid in special or tid in eos:
                continue
            b = decode(piece, tid)
            token_bytes[tid] = b if b else None  # an empty token could loop forever
        return cls(token_bytes=token_bytes, eos_token_ids=eos, vocab_size=size)

    @property
    def sentinel_id(self) -> int:
        """A pseudo-token (past the model's vocabulary) spelling SENTINEL; see regex_grammar."""
        return self.vocab_size + 1

    def outlines_vocabulary(self):
        """The `outlines_core.Vocabulary` over the same bytes (built once, shared), plus the
        sentinel pseudo-token."""
        with self._lock:
            if self._outlines is None:
                from outlines_core import Vocabulary

                groups: dict[bytes, list[int]] = {SENTINEL_BYTES: [self.sentinel_id]}
                for tid, b in enumerate(self.token_bytes):
                    if b is not None and SENTINEL_BYTES not in b:
                        groups.setdefault(b, []).append(tid)
                eos = min(self.eos_token_ids) if self.eos_token_ids else self.vocab_size
                self._outlines = Vocabulary(eos, groups)
            return self._outlines


def _backend(tokenizer: Any):
    """The `tokenizers.Tokenizer` behind a tokenizer, if any."""
    if hasattr(tokenizer, "backend_tokenizer"):
        return tokenizer.backend_tokenizer
    if type(tokenizer).__module__.startswith("tokenizers"):
        return tokenizer
    return None


def _pieces_and_specials(tokenizer: Any) -> tuple[dict[str, int], set[int]]:
    if _backend(tokenizer) is tokenizer:
        pieces = dict(tokenizer.get_vocab(with_added_tokens=True))
    else:
        pieces = dict(tokenizer.get_vocab())
    special: set[int] = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None and _backend(tokenizer) is tokenizer:
        added = tokenizer.get_added_tokens_decoder()
    for tid, tok in (added or {}).items():
        if getattr(tok, "special", False):
            special.add(int(tid))
    return pieces, special


def _default_eos(tokenizer: Any, pieces: dict[str, int]) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        return {eos} if isinstance(eos, int) else set(eos)
    for name in ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>"):
        if name in pieces:
            return {pieces[name]}
    return set()


def _added_contents(tokenizer: Any) -> dict[int, str]:
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if added is None and _backend(tokenizer) is tokenizer:
        added = tokenizer.get_added_tokens_decoder()
    return {int(t): getattr(tok, "content", str(tok)) for t, tok in (added or {}).items()}


def _encoding_kind(tokenizer: Any, pieces: dict[str, int]) -> str:
    """'byte_level' or 'sentencepiece', from the decoder config, else from the pieces."""
    backend = _backend(tokenizer)
    if backend is not None:
        import json

        # the decoder's own JSON (its pickle state, as tokenizer.json spells it), not the whole
        # tokenizer's: Gemma 3's is 11 MB of JSON, ~200 MB of Python objects while it is read
        decoder = backend.decoder
        cfg = json.loads(decoder.__getstate__()) if decoder is not None else {}
        text = json.dumps(cfg, ensure_ascii=False)
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"Metaspace"' in text or '"ByteFallback"' in text or "\u2581" in text:
            return "sentencepiece"
    n_g = sum(1 for p in pieces if p.startswith("\u0120"))
    n_sp = sum(1 for p in pieces if p.startswith("\u2581"))
    return "sentencepiece" if n_sp > n_g else "byte_level"


def _piece_decoder(tokenizer: Any, pieces: dict[str, int]):
    kind = _encoding_kind(tokenizer, pieces)
    added = _added_contents(tokenizer)
    table = unicode_to_bytes()

    def decode(piece: str, tid: int) -> bytes | None:
        if tid in added:
            return added[tid].encode("utf-8")
        if kind == "byte_level":
            try:
                return bytes(table[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    return decode
