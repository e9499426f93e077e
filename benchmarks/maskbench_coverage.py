"""MaskBench coverage of loom's JSON-schema grammars (no model involved).

For every schema in the corpus: compile it (time to first mask), then for every test instance
serialize it (compact `json.dumps`, UTF-8), tokenize it and walk the grammar token by token,
timing each fill_mask + accept_token. A schema *passes* when it compiles, every valid instance
is accepted to the end (and EOS is then allowed), and every invalid instance is rejected at
some token or cannot end. This is MaskBench's definition; the published figures (Llama-3.1
tokenizer, one thread) are llguidance 8,909, XGrammar 8,122, outlines-core 7,050 of 11,306.

    python benchmarks/maskbench_coverage.py [--data ../shared/data/maskbench] [--workers 2]
        [--timeout 30] [--tokenizer HF_DIR] [--limit N] [--stride K] [--lenient]
        [--spec-additional] [--files names.txt] [--out f.jsonl]

Each schema runs in a worker process that is killed past --timeout seconds of its own CPU
time (or four times that on the wall clock), counted as a failure.
Without --tokenizer the bundled tokenizer is used when present, else a byte-level BPE trained
on the fly (tests/conftest_grammar.py).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from collections import Counter
from multiprocessing.connection import wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_tokenizer(path: str | None, vocab_size: int):
    from transformers import AutoTokenizer

    bundled = os.path.join(ROOT, "runtime", "bundled")
    if path is None and os.path.exists(os.path.join(bundled, "tokenizer.json")):
        path = bundled
    if path:
        return AutoTokenizer.from_pretrained(path), path
    sys.path.insert(0, ROOT)
    from tests.conftest_grammar import byte_bpe

    return byte_bpe(vocab_size), f"byte-level BPE trained on the fly ({vocab_size})"


def check_schema(path: str, tok, vocab, opts) -> dict:
    from loom.grammar.base import GrammarError
    from loom.grammar.json_schema import compile_json_schema

    with open(path) as f:
        d = json.load(f)
    rec = {"file": os.path.basename(path), "status": "pass", "mask_us": []}
    t0 = time.perf_counter()
    try:
        grammar = compile_json_schema(d["schema"], vocab, opts)
        bitmask = _first_mask(grammar, vocab)
    except GrammarError as e:
        return {**rec, "status": "compile_error", "reason": str(e)[:300]}
    except Exception as e:  # an engine bug: report it, keep going
        return {**rec, "status": "crash", "reason": f"{type(e).__name__}: {e}"[:300]}
    rec["compile_s"] = time.perf_counter() - t0
    for i, test in enumerate(d.get("tests", [])):
        text = json.dumps(test["data"], ensure_ascii=False, separators=(",", ":"))
        ok = walk(
            grammar.copy(),
            tok.encode(text, add_special_tokens=False),
            vocab,
            bitmask,
            rec["mask_us"],
        )
        if ok != test["valid"]:
            rec["status"] = "wrong_valid" if test["valid"] else "wrong_invalid"
            rec["reason"] = f"test {i}: {text[:200]}"
            break
    return rec


def _first_mask(grammar, vocab):
    from loom.grammar.base import allocate_token_bitmask

    bitmask = allocate_token_bitmask(1, vocab.vocab_size)
    grammar.fill_mask(bitmask, 0)
    return bitmask


def _allowed(bitmask, t: int) -> bool:
    return (int(bitmask[0, t // 32]) >> (t % 32)) & 1 == 1


def walk(g, ids, vocab, bitmask, mask_us) -> bool:
    for t in ids:
        t0 = time.perf_counter()
        g.fill_mask(bitmask, 0)
        ok = _allowed(bitmask, t)
        if ok:
            g.accept_token(t)
        mask_us.append((time.perf_counter() - t0) * 1e6)
        if not ok:
            return False
    g.fill_mask(bitmask, 0)
    return any(_allowed(bitmask, e) for e in vocab.eos_token_ids)


def worker(conn, args):
    from loom.grammar.json_schema import JsonSchemaOptions
    from loom.grammar.vocab import TokenVocabulary

    tok, _ = load_tokenizer(args.tokenizer, args.vocab_size)
    vocab = TokenVocabulary.from_tokenizer(tok)
    opts = JsonSchemaOptions(
        lenient=args.lenient, additional_properties_default=args.spec_additional
    )
    conn.send("ready")
    while True:
        path = conn.recv()
        if path is None:
            return
        conn.send(check_schema(path, tok, vocab, opts))


def run(files: list[str], args, sink=None) -> list[dict]:
    ctx = mp.get_context("fork")
    todo, results, busy, busy_cpu = list(reversed(files)), [], {}, {}

    def spawn():
        parent, child = ctx.Pipe()
        p = ctx.Process(target=worker, args=(child, args), daemon=True)
        p.start()
        assert parent.recv() == "ready"
        return parent, p

    workers = [spawn() for _ in range(args.workers)]
    idle = list(range(len(workers)))
    while todo or busy:
        while idle and todo:
            w = idle.pop()
            path = todo.pop()
            workers[w][0].send(path)
            busy[w] = (path, time.monotonic())
            busy_cpu[w] = _cpu_seconds(workers[w][1].pid)
        ready = wait([workers[w][0] for w in busy], timeout=1.0)
        now = time.monotonic()
        for w in list(busy):
            conn, proc = workers[w]
            path, started = busy[w]
            if conn in ready:
                try:
                    rec = conn.recv()
                except EOFError:
                    rec = {"file": os.path.basename(path), "status": "crash", "mask_us": []}
            elif (
                _cpu_seconds(proc.pid) - busy_cpu[w] > args.timeout
                or now - started > 4 * args.timeout
                or not proc.is_alive()
            ):
                status = "timeout" if proc.is_alive() else "crash"
                proc.kill()
                proc.join()
                workers[w] = spawn()
                rec = {"file": os.path.basename(path), "status": status, "mask_us": []}
            else:
                continue
            del busy[w]
            idle.append(w)
            results.append(rec)
            if sink is not None:
                rec["mask_us"] = [round(x, 1) for x in rec["mask_us"]]
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
            if len(results) % 200 == 0:
                n_pass = sum(r["status"] == "pass" for r in results)
                print(f"[{len(results)}/{len(files)}] pass {n_pass}", flush=True)
    for conn, p in workers:
        conn.send(None)
        p.join(timeout=5)
    return results


def _cpu_seconds(pid: int) -> float:
    """CPU time a worker has used: the timeout counts the schema's own work, so a run that
    shares the machine does not time out schemas it merely starved."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return time.monotonic()  # no /proc: fall back to the wall clock


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def report(results, total, tok_name) -> str:
    status = Counter(r["status"] for r in results)
    compile_s = [r["compile_s"] for r in results if "compile_s" in r]
    mask_us = [x for r in results for x in r["mask_us"]]
    n_pass = status["pass"]
    lines = [
        f"tokenizer: {tok_name}",
        f"schemas passing: {n_pass} / {total} ({100 * n_pass / max(total, 1):.1f}%)"
        + (
            f"; {len(results)} of {total} run, {100 * n_pass / max(len(results), 1):.1f}% of those"
            if len(results) < total
            else ""
        ),
        "by status: " + ", ".join(f"{k} {v}" for k, v in status.most_common()),
        f"compile (to first mask) p50 {pct(compile_s, 50) * 1e3:.1f} ms, "
        f"p99 {pct(compile_s, 99) * 1e3:.1f} ms",
        f"mask (fill_mask + accept) p50 {pct(mask_us, 50):.1f} us, p99 {pct(mask_us, 99):.1f} us"
        f" over {len(mask_us)} tokens",
    ]
    by_subset: dict[str, Counter] = {}
    for r in results:
        sub = r["file"].split("---")[0].split("_")[0]
        by_subset.setdefault(sub, Counter())[r["status"] == "pass"] += 1
    for sub, c in sorted(by_subset.items()):
        lines.append(f"  {sub:16s} {c[True]:5d} / {c[True] + c[False]:5d}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "..", "shared", "data", "maskbench"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--stride", type=int, default=1)
    ap.add_argument("--lenient", action="store_true", help="warn on unenforceable keywords")
    ap.add_argument(
        "--spec-additional",
        action="store_true",
        help="a missing additionalProperties allows unlisted keys (JSON Schema's rule)",
    )
    ap.add_argument("--out", default=None, help="write one JSON line per schema here")
    ap.add_argument(
        "--files", default=None, help="only the schema files named in this file (one per line)"
    )
    args = ap.parse_args()
    files = sorted(os.path.join(args.data, f) for f in os.listdir(args.data) if f.endswith(".json"))
    if args.files:
        wanted = {line.strip() for line in open(args.files) if line.strip()}
        files = [f for f in files if os.path.basename(f) in wanted]
    files = files[:: args.stride][: args.limit]
    # interleave the subsets, so a run cut short is still a fair sample
    files = [f for i in range(50) for f in files[i::50]]
    _, tok_name = load_tokenizer(args.tokenizer, args.vocab_size)
    # every grammar module is loaded before forking, so one run measures one code version
    # even if the files change while it runs
    import importlib
    import pkgutil

    import loom.grammar

    for m in pkgutil.walk_packages(loom.grammar.__path__, "loom.grammar."):
        importlib.import_module(m.name)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t0 = time.time()
    results: list[dict] = []
    sink = open(args.out, "w") if args.out else None
    try:
        results = run(files, args, sink)
    except KeyboardInterrupt:
        print("interrupted: reporting the schemas done so far", flush=True)
        if args.out:
            sink.close()
            results = [json.loads(line) for line in open(args.out)]
    print(report(results, len(files), tok_name))
    print(f"schemas done: {len(results)} of {len(files)}")
    print(f"wall {time.time() - t0:.0f} s, {args.workers} workers, timeout {args.timeout} s")


if __name__ == "__main__":
    main()
