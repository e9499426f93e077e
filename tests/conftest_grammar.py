"""Tokenizers for the grammar tests, built offline at test time.

`byte_bpe()` trains a small byte-level BPE (GPT-2 style) on a corpus of JSON, e-mail
addresses, dates and non-ASCII text; `sentencepiece_like()` builds a Llama-2 style
tokenizer (▁ for spaces, <0xNN> byte fallback) from a hand-written vocabulary.
"""

from __future__ import annotations

import functools
import json
import random

EOS = "<|endoftext|>"


# An arithmetic grammar in both CFG syntaxes loom reads (GBNF and Lark), for engine and
# runtime tests.
ARITH_GBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")"
"""

ARITH_LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""


def corpus() -> list[str]:
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog name value type items true false null".split()
    texts = []
    for i in range(400):
        obj = {
            rng.choice(words): rng.choice([rng.randint(-999, 99999), rng.random(), None, True]),
            "name": " ".join(rng.choices(words, k=3)),
            "list": [rng.randint(0, 100) for _ in range(3)],
        }
        texts.append(json.dumps(obj))
        texts.append(json.dumps(obj, separators=(",", ":")))
        texts.append(f"user{i}@example.com 2024-{i % 12 + 1:02d}-{i % 28 + 1:02d} 10.0.{i % 256}.1")
        texts.append(f"#{rng.randrange(16**6):06x} +1-555-{rng.randrange(10**4):04d}")
    texts += ["héllo wörld — ünïcode 日本語のテキスト 😀 emoji ñandú"] * 20
    return texts


@functools.cache
def byte_bpe(vocab_size: int = 1200):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token="<pad>")


@functools.cache
def sentencepiece_like():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "▁a", "a", "b", "c", "▁b", "ab", "▁ab", "é", "1", "2", "{", "}", '"']:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
