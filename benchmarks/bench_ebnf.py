"""Mask time of the CFG engine (grammar/ebnf) per generation step.

Grammars: arithmetic, JSON, a SQL subset, each in Lark and GBNF syntax (the test suite's).
Vocabulary: a byte-level BPE of ~8k tokens trained here on mixed JSON / SQL / arithmetic /
pseudo-word text, or `--tokenizer path/to/tokenizer.json` for a real one. Each run does random
walks (a random allowed token per step, EOS with probability 0.3 once allowed) and times
`fill_mask` per step: "cold" is the first request on a freshly compiled grammar (every lexer,
parser and mask table still empty), "warm" the requests after it (tables shared across
requests, as in the server). Also prints compile time and `accept_token` time.

    python benchmarks/bench_ebnf.py [--walks 30] [--tokenizer tokenizer.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_grammar_ebnf import GRAMMARS, FakeVocab, _pick, _unicode_to_bytes  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from loom.grammar.base import allocate_token_bitmask  # noqa: E402
from loom.grammar.ebnf import compile_gbnf, compile_lark  # noqa: E402
from loom.grammar.ebnf import compiler as ebnf_compiler  # noqa: E402
from loom.grammar.ebnf.trie import get_trie  # noqa: E402


def _corpus(seed: int = 1) -> list[str]:
    rnd = random.Random(seed)
    syl = ["ka", "to", "ri", "men", "sa", "lo", "pre", "ing", "tion", "er", "st", "qu", "ax", "ze"]
    words = ["".join(rnd.choice(syl) for _ in range(rnd.randint(1, 4))) for _ in range(4000)]
    out = []
    for _ in range(6000):
        obj = {rnd.choice(words): rnd.choice([rnd.randint(-999, 9999), rnd.choice(words), [1.5]])}
        out.append(json.dumps(obj, indent=rnd.choice([None, 2])))
        out.append(
            f"SELECT {rnd.choice(words)}, {rnd.choice(words)} FROM {rnd.choice(words)} "
            f"WHERE {rnd.choice(words)} >= {rnd.randint(0, 99)};"
        )
        out.append(" ".join(f"{rnd.randint(0, 999)}{rnd.choice('+-*/')}" for _ in range(4)) + "1")
        out.append(" ".join(rnd.choice(words) for _ in range(12)) + " Ünïcödé 日本語")
    return out


def build_vocab(tokenizer_path: str | None, size: int) -> FakeVocab:
    if tokenizer_path:
        tok = Tokenizer.from_file(tokenizer_path)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        trainer = trainers.BpeTrainer(
            vocab_size=size,
            special_tokens=["<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer)
    table = _unicode_to_bytes()
    token_bytes: list[bytes | None] = [None] * tok.get_vocab_size()
    for piece, tid in tok.get_vocab().items():
        if all(c in table for c in piece) and not piece.startswith("<"):
            token_bytes[tid] = bytes(table[c] for c in piece)
    eos = {
        tid for piece, tid in tok.get_vocab().items() if piece in ("<eos>", "</s>", "<|endoftext|>")
    }
    return FakeVocab(token_bytes, eos or {0}, len(token_bytes))


def run_walks(make, vocab, walks: int, seed: int, max_steps: int = 100):
    rnd, mask_t, accept_t = random.Random(seed), [], []
    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    for _ in range(walks):
        g = make()
        for _ in range(max_steps):
            t0 = time.perf_counter()
            g.fill_mask(bitmask, 0)
            mask_t.append(time.perf_counter() - t0)
            ids = g.allowed_token_ids()
            if set(ids) & vocab.eos_token_ids and (rnd.random() < 0.3 or len(ids) == 1):
                break
            tid = _pick(rnd, vocab, ids)
            t0 = time.perf_counter()
            g.accept_token(tid)
            accept_t.append(time.perf_counter() - t0)
    return mask_t, accept_t


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--walks", type=int, default=30)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--tokenizer", default=None)
    args = ap.parse_args()
    vocab = build_vocab(args.tokenizer, args.vocab_size)
    t0 = time.perf_counter()
    get_trie(vocab)  # built once per vocabulary, not per grammar
    print(f"token trie: {(time.perf_counter() - t0) * 1e3:.0f} ms")
    compile_lark('start: "x"', vocab)  # lark's own one-time start-up, not a grammar's cost
    n_real = sum(b is not None for b in vocab.token_bytes)
    print(f"vocab: {vocab.vocab_size} ids ({n_real} with bytes); {args.walks} warm walks/grammar")
    print(
        f"{'grammar':<12} {'compile':>8} {'cold p50':>9} {'cold p99':>9} {'warm p50':>9} "
        f"{'warm p90':>9} {'warm p99':>9} {'warm max':>9} {'accept p50':>10}  (ms)"
    )
    for name, (lark_text, gbnf_text) in GRAMMARS.items():
        for syntax, text, fn in (
            ("lark", lark_text, compile_lark),
            ("gbnf", gbnf_text, compile_gbnf),
        ):
            ebnf_compiler._CACHE.clear()
            t0 = time.perf_counter()
            fn(text, vocab)
            compile_ms = (time.perf_counter() - t0) * 1e3
            cold, _ = run_walks(lambda fn=fn, text=text: fn(text, vocab), vocab, 3, seed=0)
            warm, acc = run_walks(lambda fn=fn, text=text: fn(text, vocab), vocab, args.walks, 1)
            cells = [pct(cold, 0.5), pct(cold, 0.99), pct(warm, 0.5), pct(warm, 0.9)]
            cells += [pct(warm, 0.99), max(warm) * 1e3]
            row = " ".join(f"{c:9.3f}" for c in cells)
            print(f"{name + '/' + syntax:<12} {compile_ms:8.1f} {row} {pct(acc, 0.5):10.3f}")


if __name__ == "__main__":
    main()
