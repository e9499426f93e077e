"""llguidance as loom's mask engine: lazy, so a compile costs milliseconds at any vocabulary.

llguidance parses a Lark grammar (or a regex) with an Earley parser over lexemes whose regexes
are matched by derivatives, and computes a mask by walking the tokenizer's trie against that
state: nothing is precomputed per (state, token), so compile time does not grow with the
vocabulary. Every step is bounded by its `LLParserLimits` (lexer fuel, Earley items, lexer
states, grammar size): a grammar that exceeds them fails with llguidance's message instead of
running on.

The engine's tokenizer view (`LLTokenizer`) is built once per backend: from a fast Hugging Face
tokenizer by llguidance itself (`llguidance.hf`; its masks measured ~1.8x faster at 128k than
the same bytes handed over one by one), otherwise from loom's `TokenVocabulary`, with ids
without bytes (special tokens, padding past the tokenizer) marked special. Either way a
grammar's text never matches a special token or a padding id; the soundness suite checks it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..base import Bitmask, Grammar, GrammarError, allocate_bitmask, bitmask_row
from ..forms import Form
from . import Engine, MatcherGrammar

log = logging.getLogger(__name__)


class LLGuidanceEngine(Engine):
    """JSON schemas come as one regex while that regex is short (`json_form = "regex"`): the
    whole document is then one lexeme, matched exactly, and masks are a little cheaper at the
    median. Past `json_regex_limit` characters they come as Lark rules whose terminals are
    single JSON tokens (keys, separators, leaf values; `fuse=False`): llguidance builds one
    huge regex lexeme far more slowly than many small ones (on MaskBench, every 40th schema:
    build p99 101 ms as one regex, 15 ms as rules), and at that size the one-regex form also
    refused valid documents that the rules accept (13 of 1,537 walks of forms over 10k
    characters, none the other way). Recursive schemas always take the Lark form."""

    name = "llguidance"
    json_form = "regex"
    json_regex_limit = 10_000

    def __init__(self, tokenizer: Any, vocab):
        import llguidance

        self.vocab = vocab
        self.eos = sorted(vocab.eos_token_ids)
        if _fast_hf(tokenizer):  # llguidance reads the tokenizer itself: masks ~1.8x faster
            self.tokenizer = _from_fast_tokenizer(tokenizer, vocab.vocab_size, self.eos or None)
        else:
            self.tokenizer = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_Wrapper(tokenizer, vocab)),
                n_vocab=vocab.vocab_size,
                eos_token=self.eos or None,
            )
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def build(self, form: Form) -> Grammar:
        import llguidance

        if form.syntax == "regex":
            text = llguidance.LLMatcher.grammar_from_regex(form.text)
        else:
            text = llguidance.LLMatcher.grammar_from_lark(form.text)
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=self.limits)
        if matcher.is_error():
            raise GrammarError(f"cannot compile {form.syntax}: {_first_line(matcher.get_error())}")
        first = allocate_bitmask(1, self.vocab.vocab_size)
        matcher.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        if matcher.is_error():
            raise GrammarError(f"cannot compile {form.syntax}: {_first_line(matcher.get_error())}")
        return LLGuidanceGrammar(self, matcher, first[0])


class LLGuidanceGrammar(MatcherGrammar):
    """One request's llguidance matcher. `_n` counts accepted tokens (the rollback bound);
    `_first` is the mask at the start, computed once at compile time and shared by copies."""

    def __init__(self, engine: LLGuidanceEngine, matcher, first: np.ndarray):
        self.engine = engine
        self.matcher = matcher
        self._first = first
        self._n = 0

    def fill_mask(self, bitmask: Bitmask, row: int) -> None:
        if not isinstance(bitmask, np.ndarray) and bitmask.device.type != "cpu":
            raise GrammarError("llguidance fills a contiguous CPU int32 bitmask row")
        target = bitmask_row(bitmask, row)  # numpy: the mask's own memory
        if self._n == 0:
            target[:] = self._first
            return
        if not target.flags.c_contiguous or target.dtype != np.int32:
            raise GrammarError("llguidance fills a contiguous CPU int32 bitmask row")
        self.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
        if self.matcher.is_error():
            # a step past llguidance's limits: end the output rather than let it run free
            log.warning("grammar step failed, only EOS allowed: %s", self.matcher.get_error())
            target[:] = 0
            for t in self.engine.eos:
                target[t // 32] |= _bit(t)

    def accept_token(self, token_id: int) -> None:
        if token_id in self.engine.vocab.eos_token_ids and not self.matcher.is_accepting():
            raise GrammarError(f"EOS token {token_id} before the grammar is complete")
        if self.matcher.try_consume_tokens([token_id]) != 1:
            raise GrammarError(f"token {token_id} is not allowed here")
        self._n += 1

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def is_forced(self) -> bool:
        # the forced bytes themselves: an incomplete character counts (jump_forward cuts it)
        return not self.matcher.is_stopped() and bool(self.matcher.compute_ff_bytes())

    def forced_token(self) -> int | None:
        # the forced bytes' canonical tokenization, which is what the mask allows there (every
        # forced state of 375 MaskBench walks, bundled and Llama 3 tokenizers: 21,858 of
        # 21,858; tests/test_grammar_backends.py keeps checking it)
        if self.matcher.is_stopped():
            return None
        ff = self.matcher.compute_ff_tokens()
        return ff[0] if ff else None

    def jump_forward(self) -> str | None:
        if self.matcher.is_stopped():
            return None
        forced = self.matcher.compute_ff_bytes()
        try:
            text = forced.decode("utf-8")
        except UnicodeDecodeError as e:  # cut before a character the forced bytes only start
            text = forced[: e.start].decode("utf-8")
        return text or None

    def copy(self) -> LLGuidanceGrammar:
        g = LLGuidanceGrammar(self.engine, self.matcher.deep_copy(), self._first)
        g._n = self._n
        return g


class _Wrapper:
    """What `llguidance.TokenizerWrapper` reads: the bytes of every id (loom's, so every engine
    sees the same vocabulary), the special ids, and an encoder for forced text."""

    def __init__(self, tokenizer: Any, vocab):
        self.eos_token_id = min(vocab.eos_token_ids) if vocab.eos_token_ids else None
        self.bos_token_id = None
        self.tokens = [
            b if b is not None else f"<[loom-special-{i}]>".encode()
            for i, b in enumerate(vocab.token_bytes)
        ]
        self.special_token_ids = [i for i, b in enumerate(vocab.token_bytes) if b is None]
        self._encode = _encoder(tokenizer)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


def _from_fast_tokenizer(tokenizer: Any, n_vocab: int, eos: list[int] | None):
    """llguidance's tokenizer view of a fast HF tokenizer, as `llguidance.hf.from_tokenizer`
    builds it, without its copy of the Rust tokenizer when that copy would serialize the same
    (no padding or truncation to turn off): the copy is a JSON round trip, a second tokenizer
    alive at once (Gemma 3's 262k tokens: ~85 MB more at the scheduler's peak)."""
    import llguidance
    import llguidance.hf

    backend = tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
    if eos is None:
        eos = tokenizer.eos_token_id
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)


def _fast_hf(tokenizer: Any) -> bool:
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(tokenizer, PreTrainedTokenizerFast)


def _encoder(tokenizer: Any):
    if hasattr(tokenizer, "backend_tokenizer") or not hasattr(tokenizer, "encode_batch"):
        return lambda s: list(tokenizer.encode(s, add_special_tokens=False))
    return lambda s: tokenizer.encode(s, add_special_tokens=False).ids  # tokenizers.Tokenizer


def _bit(t: int) -> int:
    b = 1 << (t % 32)
    return b - (1 << 32) if b >= 1 << 31 else b  # int32 two's complement


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "unknown error"
