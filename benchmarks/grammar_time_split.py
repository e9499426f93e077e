"""Where loom's grammar time goes, on bench_grammar.py's schema set. Compile: loom's
translation (schema -> Lark or regex, pure Python) and the engine's build (form -> matcher +
first mask) timed apart, beside llguidance compiling the same schema with its own JSON-schema
front end. Masks (llguidance engine): each step of the first valid instance three ways, over
the instances all three walk to the end: through loom's Grammar object, through a bare
`LLMatcher` on the same form (loom's wrapper cost is the difference), and through llguidance's
own JSON grammar (the form's cost is the difference).

    python benchmarks/grammar_time_split.py [--tokenizer llama3|bundled] [--stride 20]
        [--engine llguidance|xgrammar|outlines] [--timeout 10]

One process, one thread, times in process CPU time (the machine's load does not enter); a schema whose translation or build runs past --timeout seconds
(SIGALRM; the engines' own limits bound their native steps) is counted and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_grammar import load_cases  # noqa: E402
from maskbench_coverage import load_tokenizer, pct  # noqa: E402


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default="llama3")
    ap.add_argument("--stride", type=int, default=20)
    ap.add_argument("--engine", default="llguidance")
    ap.add_argument("--timeout", type=int, default=10, help="seconds per schema")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["RAYON_NUM_THREADS"] = "1"  # one thread, as in bench_grammar's workers
    import llguidance
    import llguidance.hf
    import llguidance.torch
    import torch

    from loom.grammar.backend import GrammarBackend
    from loom.grammar.base import GrammarError, allocate_token_bitmask
    from loom.grammar.forms import translate
    from loom.grammar.json_schema import normalize_schema

    torch.set_num_threads(1)
    tok, vocab_size, label = load_tokenizer(args.tokenizer)
    backend = GrammarBackend(tok, vocab_size, engine=args.engine, max_workers=1, cache_size=1)
    engine, opts = backend.engine, backend.json_options
    llg_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    mask = allocate_token_bitmask(1, vocab_size)
    parts: dict[str, list[float]] = {"normalize": [], "translate": [], "build": [], "llg": []}
    steps: dict[str, list[float]] = {"loom": [], "bare": [], "own": []}
    sizes, syntaxes, refused, timeouts = [], [], 0, 0
    signal.signal(signal.SIGALRM, _alarm)
    for path in load_cases(args.stride):
        schema = json.load(open(path))["schema"]
        signal.alarm(args.timeout)
        try:
            t0 = time.process_time()
            norm = normalize_schema(schema)
            t1 = time.process_time()
            form = translate("json_schema", norm, opts, engine.json_form, engine.json_regex_limit)
            t2 = time.process_time()
            g = engine.build(form)
            t3 = time.process_time()
            m = llguidance.LLMatcher(llg_tok, llguidance.LLMatcher.grammar_from_json_schema(schema))
            if not m.is_error():
                llguidance.torch.fill_next_token_bitmask(m, mask, 0)
            t4 = time.process_time()
        except GrammarError:
            refused += 1
            continue
        except _Timeout:
            timeouts += 1
            continue
        finally:
            signal.alarm(0)
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            parts[key].append(1e3 * dt)
        sizes.append(len(form.text))
        syntaxes.append(form.syntax)
        valid = [t["data"] for t in json.load(open(path))["tests"] if t["valid"]]
        if args.engine == "llguidance" and valid and not m.is_error():
            ids = tok.encode(json.dumps(valid[0]), add_special_tokens=False)
            walks = _walk_three(llguidance, engine, form, g, m, ids, mask)
            if walks is not None:
                for key, xs in zip(steps, walks):
                    steps[key].extend(xs)
    load = os.getloadavg()
    print(f"tokenizer {label}; engine {args.engine}; {len(sizes)} schemas timed "
          f"({refused} refused by loom, {timeouts} over {args.timeout} s); loadavg {load[0]:.2f}")  # fmt: skip
    names = {
        "normalize": "loom: normalize the schema",
        "translate": f"loom: translate ({engine.json_form} up to {engine.json_regex_limit} chars)",
        "build": f"loom: {args.engine} build + first mask",
        "llg": "llguidance: its own JSON schema -> first mask",
    }
    for key, name in names.items():
        xs = parts[key]
        print(f"  {name:46s} p50 {pct(xs, 50):7.2f} ms  p90 {pct(xs, 90):7.2f} ms  "
              f"p99 {pct(xs, 99):8.2f} ms  total {sum(xs) / 1e3:6.2f} s")  # fmt: skip
    print(f"  form size: p50 {pct(sizes, 50):.0f} chars, p99 {pct(sizes, 99):.0f} chars; "
          f"{syntaxes.count('regex')} regex, {syntaxes.count('lark')} lark")  # fmt: skip
    if steps["loom"]:
        names = {
            "loom": "loom Grammar (fill_mask + accept_token)",
            "bare": "bare LLMatcher on loom's form",
            "own": "llguidance's own JSON grammar",
        }
        print(f"  mask steps: {len(steps['loom'])} (first valid instance, all three accept)")
        for key, name in names.items():
            xs = steps[key]
            print(f"  {name:46s} p50 {pct(xs, 50):7.1f} us  p90 {pct(xs, 90):7.1f} us  "
                  f"p99 {pct(xs, 99):8.1f} us")  # fmt: skip


def _walk_three(llguidance, engine, form, g, own, ids, mask):
    """Per-step microseconds walking `ids` through loom's grammar `g`, a bare matcher on the
    same form, and llguidance's own matcher `own`; None unless all three accept every token."""
    fill = llguidance.torch.fill_next_token_bitmask
    text = (llguidance.LLMatcher.grammar_from_regex if form.syntax == "regex"
            else llguidance.LLMatcher.grammar_from_lark)(form.text)  # fmt: skip
    bare = llguidance.LLMatcher(engine.tokenizer, text, limits=engine.limits)
    words = mask.numpy()[0]
    out = ([], [], [])
    for t in ids:
        for k, m in enumerate((g, bare, own)):
            t0 = time.process_time()
            if k == 0:
                m.fill_mask(mask, 0)
            else:
                fill(m, mask, 0)
            if not (int(words[t >> 5]) >> (t & 31)) & 1:
                return None
            if k == 0:
                m.accept_token(t)
            elif not m.consume_token(t):
                return None
            out[k].append(1e6 * (time.process_time() - t0))
    return out


if __name__ == "__main__":
    main()
