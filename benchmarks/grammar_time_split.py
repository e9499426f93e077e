"""Where loom's grammar time goes, on the same schemas as bench_grammar.py (no peer engines).

Compile: per regex-path schema, the schema -> regex translation and the outlines-core `Index`
build timed apart. Masks: every fill_mask + accept_token walking the valid instances, split by
engine (regex path: outlines-core rows; CFG path: lark + interegular + token trie).

    python benchmarks/grammar_time_split.py [--stride 40] [--timeout 10]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grammar import Loom, load_cases, pct  # noqa: E402


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stride", type=int, default=40)
    ap.add_argument("--timeout", type=int, default=10, help="seconds per schema")
    args = ap.parse_args()
    from outlines_core import Index
    from transformers import AutoTokenizer

    from loom.grammar.base import GrammarError
    from loom.grammar.json_schema import JsonSchemaOptions, NeedsCFG, _to_regex, normalize_schema
    from loom.grammar.vocab import SENTINEL
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_PATH)
    engine = Loom(tok, len(tok))
    vocabulary = engine.backend.vocab.outlines_vocabulary()
    signal.signal(signal.SIGALRM, _alarm)
    translate_ms, index_ms, steps, timeouts = [], [], {}, 0
    for _, schema, instances in load_cases(args.stride):
        signal.alarm(args.timeout)
        try:
            try:
                t = time.perf_counter()
                regex, _ = _to_regex(normalize_schema(schema), JsonSchemaOptions())
                translate_ms.append(1e3 * (time.perf_counter() - t))
                t = time.perf_counter()
                Index(f"{SENTINEL}(?:{regex}){SENTINEL}", vocabulary)
                index_ms.append(1e3 * (time.perf_counter() - t))
            except (NeedsCFG, GrammarError, ValueError):
                pass
            try:
                grammar = engine.compile(schema)
            except GrammarError:
                continue
            kind = type(grammar).__name__
            for inst in instances:
                step = engine.walker(grammar)
                for token in tok.encode(json.dumps(inst), add_special_tokens=False):
                    t = time.perf_counter()
                    ok = step(token)
                    steps.setdefault(kind, []).append(1e6 * (time.perf_counter() - t))
                    if not ok:
                        break
        except _Timeout:
            timeouts += 1
        finally:
            signal.alarm(0)
    share = [i / (i + t) for i, t in zip(index_ms, translate_ms)]
    print(f"regex-path compiles: {len(index_ms)}; translation p50 {pct(translate_ms, 0.5):.2f} ms "
          f"p99 {pct(translate_ms, 0.99):.2f} ms; Index build p50 {pct(index_ms, 0.5):.2f} ms "
          f"p99 {pct(index_ms, 0.99):.1f} ms; Index share of the two p50 "
          f"{100 * pct(share, 0.5):.0f}%, min {100 * min(share, default=0):.0f}%")  # fmt: skip
    every = [x for v in steps.values() for x in v]
    print(f"mask steps: {len(every)}, p50 {pct(every, 0.5):.1f} us, p99 {pct(every, 0.99):.1f} us")
    for kind, xs in sorted(steps.items()):
        print(f"  {kind:14s} {len(xs):6d} steps  p50 {pct(xs, 0.5):7.1f} us  "
              f"p90 {pct(xs, 0.9):7.1f} us  p99 {pct(xs, 0.99):7.1f} us")  # fmt: skip
    print(f"schemas past the {args.timeout} s timeout: {timeouts}")


if __name__ == "__main__":
    main()
