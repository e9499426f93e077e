"""Grammar engines side by side: loom beside xgrammar and llguidance on the same tokenizers and
MaskBench schemas, then end-to-end JSON decoding with jump-forward on and off.

For each engine and schema: compile time (schema -> first mask), then the valid instances are
serialised (`json.dumps`), tokenised and walked token by token; each step times one mask fill
plus one token accept. Reported: schemas compiled, compile p50/p99, mask p50/p99. Tokenizers:
the bundled model's (4k) and a 32k byte-level BPE trained here on the MaskBench texts.

    pip install xgrammar llguidance      # bench-only extras
    python benchmarks/bench_grammar.py [--stride 20] [--timeout 10] [--skip-e2e | --only-e2e]
        [--tokenizers bundled,bpe32k]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "maskbench"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def load_cases(stride: int) -> list[tuple[str, str, list]]:
    cases = []
    for path in sorted(DATA.glob("*.json"))[::stride]:
        doc = json.loads(path.read_text())
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        if valid:
            cases.append((path.stem, json.dumps(doc["schema"]), valid[:3]))
    return cases


def train_large_tokenizer(folder: Path, size: int = 32000) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (folder / "tokenizer.json").exists():
        return folder
    texts = []
    for path in sorted(DATA.glob("*.json")):
        doc = json.loads(path.read_text())
        texts.append(json.dumps(doc["schema"]))
        texts.extend(json.dumps(t["data"]) for t in doc.get("tests", []))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


class Loom:
    name = "loom"

    def __init__(self, tok, vocab_size):
        from loom.grammar.backend import GrammarBackend

        self.backend = GrammarBackend(tok, vocab_size, max_workers=1, cache_size=1)
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        return self.backend.compile("json_schema", schema)

    def walker(self, g):
        from loom.grammar.base import allocate_token_bitmask

        mask = allocate_token_bitmask(1, self.vocab_size)
        g = g.copy()

        def step(t: int) -> bool:
            g.fill_mask(mask, 0)
            if not (int(mask[0, t // 32]) >> (t % 32)) & 1:
                return False
            g.accept_token(t)
            return True

        return step


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size):
        import xgrammar as xgr

        self.xgr = xgr
        self.compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size), cache_enabled=False
        )
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema)

    def walker(self, compiled):
        m = self.xgr.GrammarMatcher(compiled)
        mask = self.xgr.allocate_token_bitmask(1, self.vocab_size)

        def step(t: int) -> bool:
            m.fill_next_token_bitmask(mask)
            return m.accept_token(t)

        return step


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def walker(self, grammar):
        m = self.llg.LLMatcher(self.tok, grammar)
        mask = self.llg.torch.allocate_token_bitmask(1, self.tok.vocab_size)

        def step(t: int) -> bool:
            self.llg.torch.fill_next_token_bitmask(m, mask, 0)
            return m.consume_token(t)

        return step


class SchemaTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise SchemaTimeout


def bench_engine(engine, cases, tok, timeout_s: int) -> dict:
    """Per schema, compile + walk get `timeout_s` seconds (SIGALRM); a schema that runs out is
    counted in `timeouts` and its partial timings are kept."""
    import signal

    signal.signal(signal.SIGALRM, _alarm)
    compiled, compile_ms, mask_us, accepted, walked, timeouts = 0, [], [], 0, 0, 0
    for _, schema, instances in cases:
        signal.alarm(timeout_s)
        try:
            _bench_schema(engine, schema, instances, tok, compile_ms, mask_us, counts := [0, 0, 0])
        except SchemaTimeout:
            timeouts += 1
            continue
        finally:
            signal.alarm(0)
        compiled += counts[0]
        walked += counts[1]
        accepted += counts[2]
    return {
        "compiled": compiled,
        "compile_p50": pct(compile_ms, 0.5),
        "compile_p99": pct(compile_ms, 0.99),
        "mask_p50": pct(mask_us, 0.5),
        "mask_p99": pct(mask_us, 0.99),
        "accepted": accepted,
        "walked": walked,
        "timeouts": timeouts,
    }


def _bench_schema(engine, schema, instances, tok, compile_ms, mask_us, counts) -> None:
    """counts: [compiled, walked, accepted], updated in place."""
    t = time.perf_counter()
    try:
        grammar = engine.compile(schema)
    except SchemaTimeout:
        raise
    except Exception:  # noqa: BLE001 - an engine refusing a schema is a data point
        return
    compile_ms.append(1000 * (time.perf_counter() - t))
    counts[0] += 1
    for inst in instances:
        ids = tok.encode(json.dumps(inst), add_special_tokens=False)
        step = engine.walker(grammar)
        counts[1] += 1
        ok = True
        for token in ids:
            s = time.perf_counter()
            ok = step(token)
            mask_us.append(1e6 * (time.perf_counter() - s))
            if not ok:
                break
        counts[2] += ok


E2E_SCHEMAS = {
    "3 short keys": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 20},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
    "4 long keys + const": {
        "type": "object",
        "properties": {
            "customer_full_name": {"type": "string", "maxLength": 20},
            "customer_age_in_years": {"type": "integer", "minimum": 0, "maximum": 120},
            "customer_home_city_name": {"type": "string", "maxLength": 20},
            "record_status": {"const": "verified_by_extraction_pipeline"},
        },
        "required": [
            "customer_full_name",
            "customer_age_in_years",
            "customer_home_city_name",
            "record_status",
        ],
        "additionalProperties": False,
    },
}


def bench_e2e(n: int) -> dict[str, tuple[float, float]]:
    """Per schema: (documents/s with jump-forward / without, tokens/s ratio), each setting the
    best of two runs taken alternately (the first engine of a process runs slower). Jump-forward
    retokenizes forced text canonically, so the same documents can take fewer tokens: the
    document rate is the fair comparison. Printed beside it: the token rate as generated, and
    the "canonical" token rate (each output re-encoded by the tokenizer, so both runs count
    the same text the same way), and how many documents came out identical."""
    import loom

    people = [
        ("Alice", 31, "Paris"),
        ("Bob", 42, "Rome"),
        ("Chen", 27, "Tokyo"),
        ("Dana", 55, "Lima"),
    ]
    results = {}
    for label, schema in E2E_SCHEMAS.items():
        best: dict[bool, tuple] = {}
        texts: dict[bool, list] = {}
        # off, on, off, on: each setting's best of two, so neither profits from running second
        for jf in (False, True, False, True):
            with loom.Engine(disable_jump_forward=not jf) as engine:
                prompts = []
                for i in range(n):
                    name, age, city = people[i % len(people)]
                    msg = f"Extract the name, age and city as JSON: {name} is {age} and lives in {city}."
                    prompts.append(
                        engine.tokenizer.apply_chat_template(
                            [{"role": "user", "content": msg}],
                            tokenize=False,
                            add_generation_prompt=True,
                        )
                    )
                params = {
                    "max_new_tokens": 256,
                    "temperature": 0,
                    "json_schema": json.dumps(schema),
                }
                engine.generate(prompts[:1], params)  # compile + warm-up
                t = time.perf_counter()
                outs = engine.generate(prompts, params)
                elapsed = time.perf_counter() - t
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                # the same text counted in the tokenizer's own tokens, whichever way it was made
                canonical = sum(
                    len(engine.tokenizer.encode(o["text"], add_special_tokens=False)) for o in outs
                )
                for o in outs:
                    json.loads(o["text"])
                texts[jf] = [o["text"] for o in outs]
                rate = (n / elapsed, tokens / elapsed, canonical / elapsed)
                best[jf] = max(best.get(jf, rate), rate)
                jumped = sum(o["meta_info"]["jump_forward_tokens"] for o in outs)
                print(
                    f"  {label:20s} jump-forward {'on ' if jf else 'off'}: {n / elapsed:6.1f} docs/s "
                    f"{tokens / elapsed:8.1f} tok/s {canonical / elapsed:8.1f} canonical tok/s "
                    f"({tokens} tokens, {jumped} jumped, {elapsed:.2f} s)"
                )
        (on_d, on_t, on_c), (off_d, off_t, off_c) = best[True], best[False]
        same = sum(a == b for a, b in zip(texts[True], texts[False]))
        results[label] = (on_d / off_d, on_t / off_t)
        print(f"  {label:20s} jump-forward speed-up: {on_d / off_d:.2f}x documents/s, "
              f"{on_t / off_t:.2f}x tokens/s, {on_c / off_c:.2f}x canonical tokens/s; "
              f"{same}/{n} documents identical on and off")  # fmt: skip
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stride", type=int, default=20, help="every Nth MaskBench schema")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--only-e2e", action="store_true")
    ap.add_argument("--tokenizers", default="bundled,bpe32k", help="comma list of: bundled, bpe32k")
    ap.add_argument("--timeout", type=int, default=10, help="seconds per schema (compile + walk)")
    ap.add_argument("--requests", type=int, default=64, help="requests per end-to-end run")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    if args.only_e2e:
        print(f"end-to-end JSON extraction on the bundled model ({args.requests} requests, greedy)")
        bench_e2e(args.requests)
        return
    cases = load_cases(args.stride)
    big = train_large_tokenizer(Path(tempfile.gettempdir()) / "loom-bench-bpe32k")
    print(
        f"{len(cases)} MaskBench schemas (every {args.stride}th with a valid instance), one thread"
    )
    chosen = args.tokenizers.split(",")
    for name, label, path in (
        ("bundled", "bundled 4k", BUNDLED_MODEL_PATH),
        ("bpe32k", "BPE 32k", str(big)),
    ):
        if name not in chosen:
            continue
        tok = AutoTokenizer.from_pretrained(path)
        vocab = max(len(tok), tok.vocab_size)
        vocab = (vocab + 63) // 64 * 64
        print(f"\ntokenizer {label} (model vocab {vocab})")
        print(
            f"  {'engine':11s} {'compiled':>9s} {'compile p50':>12s} {'p99':>9s} {'mask p50':>10s} {'p99':>9s}  accepted"
        )
        rows = {}
        for cls in (Loom, XGrammar, LLGuidance):
            try:
                engine = cls(tok, vocab)
            except ImportError as e:
                print(f"  {cls.name:11s} not installed ({e})")
                continue
            except BaseException as e:  # a Rust panic (pyo3 PanicException) is not an Exception
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                print(f"  {cls.name:11s} cannot load this tokenizer ({type(e).__name__}: {e})")
                continue
            r = rows[cls.name] = bench_engine(engine, cases, tok, args.timeout)
            print(
                f"  {cls.name:11s} {r['compiled']:5d}/{len(cases):<4d} {r['compile_p50']:9.2f} ms "
                f"{r['compile_p99']:7.1f} ms {r['mask_p50']:7.1f} us {r['mask_p99']:7.0f} us"
                f"  {r['accepted']}/{r['walked']}"
            )
        if "loom" in rows and "llguidance" in rows:
            lo, ll = rows["loom"], rows["llguidance"]
            print(
                f"  loom / llguidance: compile p50 {lo['compile_p50'] / ll['compile_p50']:.2f}x, "
                f"mask p50 {lo['mask_p50'] / ll['mask_p50']:.2f}x, mask p99 {lo['mask_p99'] / ll['mask_p99']:.2f}x"
            )
    if not args.skip_e2e:
        print(
            f"\nend-to-end JSON extraction on the bundled model ({args.requests} requests, greedy, "
            "schema-constrained)"
        )
        bench_e2e(args.requests)


if __name__ == "__main__":
    main()
