"""First constrained requests at a real vocabulary: the extra time to first token a new JSON
schema costs end to end, against llguidance's own compile of the same schema.

Model: a random one-layer Llama whose vocabulary is Llama 3's tokenizer (128,256 ids;
tests/tiny_models.build_llama3_vocab_model), so the forward costs little and the grammar's
share shows. One Engine, started with --grammar-backend-eager (the grammar backend's tokenizer
tables built at start-up, before the Engine returns; --lazy: loom's default, the first
constrained request builds them, and its extra TTFT is that build's cost). Then, for each of --schemas new schemas
(distinct key names: none hits the compile cache), alternately: a plain request and a
constrained one with the same prompt, each max_new_tokens 1, so their wall time is their time
to first token. Extra TTFT = constrained - the median of the plain requests around it. Beside
each schema: llguidance's compile of the same schema at the same tokenizer (`LLMatcher` from
the JSON schema to its first mask, in this process). The check: the first request's and the
worst request's extra TTFT within 3x llguidance's compile of that schema + 50 ms.

    python benchmarks/bench_grammar_first_request.py [--schemas 20] [--lazy]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402

SLACK_MS, FACTOR = 50.0, 3.0


def schema(i: int) -> dict:
    """A new schema per i: distinct key names, a few kinds of values."""
    return {
        "type": "object",
        "properties": {
            f"name_{i}": {"type": "string", "maxLength": 16},
            f"age_{i}": {"type": "integer", "minimum": 0, "maximum": 120},
            f"tags_{i}": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
            f"kind_{i}": {"enum": ["a", "b", f"c{i}"]},
        },
        "required": [f"name_{i}", f"age_{i}"],
        "additionalProperties": False,
    }


def llguidance_compile_ms(tok, vocab_size: int, schemas: list[dict]) -> list[float]:
    """llguidance alone: schema -> LLMatcher -> first mask, per schema (ms, wall)."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab_size)
    mask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    out = []
    for s in schemas:
        t = time.perf_counter()
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(s))
        llguidance.torch.fill_next_token_bitmask(m, mask, 0)
        out.append(1e3 * (time.perf_counter() - t))
        assert not m.is_error(), m.get_error()
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--schemas", type=int, default=20, help="new schemas, one request each")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lazy", action="store_true", help="loom's default (the first constrained "
                   "request builds the grammar backend) instead of --grammar-backend-eager; the "
                   "first request's extra TTFT then includes the build, and no bound applies to it")  # fmt: skip
    args = p.parse_args(argv)
    import loom
    from tests.tiny_models import build_llama3_vocab_model

    print(common.header("first constrained request at 128k"))
    folder = Path(tempfile.mkdtemp(prefix="loom-llama3-vocab-"))
    path = build_llama3_vocab_model(folder)
    schemas = [schema(i) for i in range(args.schemas)]
    t = time.perf_counter()
    engine = loom.Engine(path, max_total_tokens=4096, cpu_threads=args.threads,
                         log_level="warning", grammar_backend_eager=not args.lazy)  # fmt: skip
    start_s = time.perf_counter() - t
    prompt = "Give the record as JSON:"
    plain = {"max_new_tokens": 1, "temperature": 0}

    def ttft(params: dict) -> float:
        t = time.perf_counter()
        engine.generate(prompt, params)
        return 1e3 * (time.perf_counter() - t)

    try:
        ready = engine.get_server_info()["grammar_engine_ready"]
        base = [ttft(plain) for _ in range(3)]  # the plain path warmed first
        extra, plains = [], []
        for s in schemas:
            before = ttft(plain)
            constrained = ttft({**plain, "json_schema": json.dumps(s)})
            after = ttft(plain)
            around = statistics.median([before, after, *base[-1:]])
            extra.append(constrained - around)
            plains.append(around)
            base.append(after)
        tok = engine.tokenizer
        vocab = engine.get_server_info()["vocab_size"]
    finally:
        engine.shutdown()
    llg = llguidance_compile_ms(tok, vocab, schemas)
    bound = [FACTOR * c + SLACK_MS for c in llg]
    worst = max(range(len(extra)), key=lambda i: extra[i])
    if args.lazy:  # the first request built the backend: the bound holds for the others
        worst = 1 + max(range(len(extra) - 1), key=lambda i: extra[1 + i])
    ok_first, ok_worst = args.lazy or extra[0] <= bound[0], extra[worst] <= bound[worst]
    print(
        f"Engine start {start_s:.1f} s (grammar tables ready at start: {ready}); plain TTFT "
        f"median {statistics.median(plains):.1f} ms; {len(schemas)} new schemas"
    )
    print(
        f"extra TTFT per new schema: first {extra[0]:.1f} ms, p50 "
        f"{statistics.median(extra):.1f} ms, worst {extra[worst]:.1f} ms (schema {worst}); "
        f"llguidance compile p50 {statistics.median(llg):.2f} ms, worst {max(llg):.2f} ms"
    )
    print(
        f"bound {FACTOR:g}x llguidance's compile + {SLACK_MS:g} ms: first {extra[0]:.1f} "
        + (
            "(--lazy: builds the backend, no bound)"
            if args.lazy
            else f"<= {bound[0]:.1f} {'met' if ok_first else 'MISSED'}"
        )
        + f"; worst {'after the first ' if args.lazy else ''}{extra[worst]:.1f} <= "
        f"{bound[worst]:.1f} {'met' if ok_worst else 'MISSED'}"
    )
    print(common.loadavg())
    return {"extra_ms": extra, "llguidance_ms": llg, "met": ok_first and ok_worst}


if __name__ == "__main__":
    main()
