"""Grammar engines side by side: loom beside llguidance and xgrammar on the same tokenizer and
the same MaskBench schemas, then end-to-end JSON decoding with jump-forward on and off.

Each engine runs in its own worker process (forked after the tokenizer is loaded, so every
engine starts from the same resident set), one thread each (xgrammar `max_threads=1`, torch
and rayon 1), and the schemas go to the engines in turn, schema by schema, so a change in the
machine's load touches every engine alike. Per schema: compile = schema to first mask (the
first fill included); then the first --instances valid instances are serialized with
`json.dumps`, tokenized and walked, each on a fresh matcher at the start state (loom's
`Grammar.copy()`, llguidance's `LLMatcher.deep_copy()`, a new xgrammar `GrammarMatcher`);
each step times one mask fill plus one token accept (maskbench_coverage.py's harness), in
process CPU time by default (`--clock wall` for the wall clock; on a shared machine the wall
clock mostly measures waiting for a core).

The percentiles of every engine are taken over the same set, stated in the output:
compile over the schemas that every engine compiled (the failures of each engine are listed
by name, and a second row counts them at the timeout value over the union); masks over the
valid instances that every engine walked to the end (the same token sequences for all),
without each walk's first step: every engine computed that first mask inside its compile
(timed there), and a copied loom grammar reuses it while a fresh peer matcher recomputes it,
so counting it would time different work. Peak RSS is each engine's worker's high-water mark.

Like for like: each engine applies one JSON Schema mode (maskbench_coverage.MODES: strict --
loom, xgrammar; spec -- loom-spec, llguidance, xgrammar-nonstrict; relaxed -- llguidance's
coerce_one_of / lenient options), and the ratios printed compare each loom engine with the
peers of its own mode only (the targets are loom-spec's against llguidance's).

End to end (--only-e2e): the same documents with jump-forward on and off, alternating for
--e2e-rounds rounds in fresh Engines; each round's on/off ratio, their median and range, and
the tokens jumped per setting (a schema with nothing to jump says so).

    python benchmarks/bench_grammar.py [--tokenizers llama3,bundled] [--stride 20]
        [--instances 3] [--timeout 10] [--engines loom,loom-spec,llguidance,xgrammar,...]
        [--loom-engine llguidance|xgrammar|outlines] [--clock cpu|wall]
        [--skip-e2e | --only-e2e] [--requests 64] [--e2e-rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from maskbench_coverage import (  # noqa: E402
    DATA,
    ENGINES,
    MODES,
    Pool,
    engine_label,
    load_tokenizer,
    pct,
    preload_loom,
    use_clock,
)

TARGETS = {"compile p50": 2.0, "compile p99": 3.0, "mask p50": 1.0, "mask p99": 1.5, "RSS": 2.0}


def load_cases(stride: int) -> list[str]:
    """Every `stride`-th MaskBench file (sorted names) that has a valid instance."""
    out = []
    for path in sorted(Path(DATA).glob("*.json"))[::stride]:
        doc = json.loads(path.read_text())
        if any(t.get("valid") for t in doc.get("tests", [])):
            out.append(str(path))
    return out


def bench_tokenizer(name: str, args) -> None:
    tok, vocab_size, label = load_tokenizer(name)
    engines = args.engines.split(",")
    if any(e.startswith("loom") for e in engines):
        preload_loom()
    cases = load_cases(args.stride)
    pools = {
        e: Pool(
            1, tok, vocab_size, args.loom_engine, args.timeout, args.max_rss_gb, args.instances, [e]
        )
        for e in engines
    }
    base_mb = _rss_mb()
    recs: dict[str, dict[str, dict]] = {e: {} for e in engines}
    load0, t0 = os.getloadavg(), time.time()
    try:
        for path in cases:
            for e in engines:
                pools[e].run([(e, path)], lambda e, p, r: recs[e].__setitem__(Path(p).stem, r))
    finally:
        for pool in pools.values():
            pool.close()
    load1 = os.getloadavg()
    print(f"\ntokenizer {label}; {len(cases)} MaskBench schemas (every {args.stride}th with a "
          f"valid instance), up to {args.instances} valid instances each; one thread per engine; "
          f"{args.clock} clock")  # fmt: skip
    print(f"loadavg {load0[0]:.2f} at start, {load1[0]:.2f} at end; {time.time() - t0:.0f} s")
    rows = summarize(recs, engines, cases, args.timeout * 1e3)
    width = max(len(engine_label(e, args.loom_engine)) for e in engines)
    print(f"  {'engine':{width}s} {'compiled':>9s} {'compile p50':>11s} {'p99':>9s} "
          f"{'p99 (fails at timeout)':>22s} {'mask p50':>9s} {'p99':>8s} {'peak RSS':>9s}  "
          f"valid accepted")  # fmt: skip
    for e in engines:
        r = rows[e]
        print(f"  {engine_label(e, args.loom_engine):{width}s} {r['compiled']:4d}/{len(cases):<4d} "
              f"{r['compile p50']:8.2f} ms {r['compile p99']:6.1f} ms {r['union p99']:19.1f} ms "
              f"{r['mask p50']:6.1f} us {r['mask p99']:5.0f} us {pools[e].peak_rss_mb:6.0f} MB  "
              f"{r['accepted']}/{r['walked']}")  # fmt: skip
        rows[e]["RSS"] = pools[e].peak_rss_mb
    common = rows[engines[0]]
    print(f"  sets: compile over {common['n_common']} schemas every engine compiled; masks over "
          f"{common['n_tokens']} steps of {common['n_walks']} valid instances every engine "
          f"accepted; RSS at fork {base_mb:.0f} MB")  # fmt: skip
    for e in engines:
        if rows[e]["failed"]:
            fails = ", ".join(f"{f} ({s})" for f, s in sorted(rows[e]["failed"].items()))
            print(f"  {e} failed {len(rows[e]['failed'])}: {fails}")
    _plots(name, label, rows, engines, args)
    for e in (e for e in engines if e.startswith("loom")):
        for peer in (x for x in engines if not x.startswith("loom") and MODES[x] == MODES[e]):
            lo, ll = rows[e], rows[peer]
            targeted = (e, peer) == ("loom-spec", "llguidance")
            parts = []
            for key, target in TARGETS.items():
                ratio = lo[key] / ll[key] if ll[key] else float("nan")
                verdict = f" ({'met' if ratio <= target else 'MISSED'}, target <= {target:g}x)"
                parts.append(f"{key} {ratio:.2f}x" + (verdict if targeted else ""))
            print(f"  [{MODES[e]}] {e} / {peer}: " + "; ".join(parts))


def _plots(name: str, label: str, rows: dict, engines: list[str], args) -> None:
    """docs/img/grammar_{compile,mask}_<tokenizer>.png: each engine's distribution over the
    same sets as the table (box 25-75%, whiskers 1-99%)."""
    from common import plot

    tag = os.path.basename(name.rstrip("/"))
    labels = {engine_label(e, args.loom_engine): e for e in engines}
    common = rows[engines[0]]
    for key, unit, what, n in (
        ("compile_ms", "ms", "compile (schema to first mask)", f"{common['n_common']} schemas"),
        ("mask_us", "us", "mask step (fill + accept)", f"{common['n_tokens']} steps"),
    ):
        series = {lab: ([], rows[e][key]) for lab, e in labels.items() if rows[e][key]}
        if series:
            plot(
                f"grammar_{key.split('_')[0]}_{tag}.png",
                f"{what}, {label}\nMaskBench every {args.stride}th schema, {n}, {args.clock} time",
                "engine",
                f"{unit} per {key.split('_')[0]} ({args.clock} time, log)",
                series,
                logy=True,
                kind="box",
            )


def summarize(recs, engines, cases, timeout_ms: float) -> dict:
    names = [Path(p).stem for p in cases]
    compiled = {e: {f for f in names if "compile_ms" in recs[e].get(f, {})} for e in engines}
    common = set.intersection(*compiled.values())
    # valid instances every engine accepted to the end: (schema, instance index)
    accepted = {
        e: {(f, i) for f in common for i, ok, _ in recs[e][f]["walks"] if ok} for e in engines
    }
    walks = set.intersection(*accepted.values())
    out = {}
    for e in engines:
        comp = [recs[e][f]["compile_ms"] for f in sorted(common)]
        union = [recs[e][f].get("compile_ms", timeout_ms) for f in names]
        union = [x if f in compiled[e] else timeout_ms for f, x in zip(names, union)]
        mask = []
        for f in sorted(common):
            r, at = recs[e][f], 0
            for i, _ok, n in r["walks"]:
                if (f, i) in walks:  # the first step's mask was made (and timed) by the compile
                    mask.extend(r["mask_us"][at + 1 : at + n])
                at += n
        out[e] = {
            "compiled": len(compiled[e]),
            "compile p50": pct(comp, 50),
            "compile p99": pct(comp, 99),
            "union p99": pct(union, 99),
            "mask p50": pct(mask, 50),
            "mask p99": pct(mask, 99),
            "accepted": sum(ok for f in compiled[e] for _, ok, _ in recs[e][f]["walks"]),
            "walked": sum(len(recs[e][f]["walks"]) for f in compiled[e]),
            "failed": {f: recs[e][f]["status"] for f in names if f not in compiled[e]},
            "compile_ms": comp,
            "mask_us": mask,
            "n_common": len(common),
            "n_walks": len(walks),
            "n_tokens": len(mask),
        }
    return out


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) / 1024
    return 0.0


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


def bench_e2e(n: int, rounds: int = 3) -> dict[str, dict]:
    """Per schema: documents/s with jump-forward on and off, `rounds` rounds alternating (off
    first in even rounds, on first in odd ones), each run in a fresh Engine warmed by one
    request. Jump-forward retokenizes forced text canonically, so the same documents can take
    fewer tokens: the document rate is the fair comparison. Printed per run: docs/s, token
    rates (as generated, and "canonical": each output re-encoded, so both settings count the
    same text the same way) and the tokens jumped; per schema: each round's on/off ratio,
    their median and range, and how many documents came out identical."""
    import loom

    people = [
        ("Alice", 31, "Paris"),
        ("Bob", 42, "Rome"),
        ("Chen", 27, "Tokyo"),
        ("Dana", 55, "Lima"),
    ]
    results = {}
    for label, schema in E2E_SCHEMAS.items():
        docs: dict[bool, list[float]] = {False: [], True: []}
        jumped: dict[bool, list[int]] = {False: [], True: []}
        texts: dict[bool, list] = {}
        for r in range(rounds):
            for jf in (False, True) if r % 2 == 0 else (True, False):
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
                    canonical = sum(
                        len(engine.tokenizer.encode(o["text"], add_special_tokens=False))
                        for o in outs
                    )
                    for o in outs:
                        json.loads(o["text"])
                    texts[jf] = [o["text"] for o in outs]
                    jumps = sum(o["meta_info"]["jump_forward_tokens"] for o in outs)
                    docs[jf].append(n / elapsed)
                    jumped[jf].append(jumps)
                    print(
                        f"  {label:20s} round {r + 1} jump-forward {'on ' if jf else 'off'}: "
                        f"{n / elapsed:6.1f} docs/s {tokens / elapsed:8.1f} tok/s "
                        f"{canonical / elapsed:8.1f} canonical tok/s ({tokens} tokens, {jumps} "
                        f"jumped, {elapsed:.2f} s, load {os.getloadavg()[0]:.1f})"
                    )
        ratios = [a / b for a, b in zip(docs[True], docs[False])]
        same = sum(a == b for a, b in zip(texts[True], texts[False]))
        med = statistics.median(ratios)
        jumped_on = statistics.median(jumped[True])
        note = "" if jumped_on else " -- nothing jumped: the ratio is noise around 1"
        results[label] = {"ratio": med, "range": (min(ratios), max(ratios)), "jumped": jumped_on}
        print(
            f"  {label:20s} jump-forward on/off: {med:.2f}x documents/s (rounds "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; range {min(ratios):.2f}-{max(ratios):.2f}); "
            f"{jumped_on:.0f} tokens jumped per run (median); {same}/{n} documents identical on "
            f"and off{note}"
        )
    return results


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokenizers", default="llama3", help="comma list: llama3, bundled, folders")
    ap.add_argument("--stride", type=int, default=20, help="every Nth MaskBench schema")
    ap.add_argument("--instances", type=int, default=3, help="valid instances walked per schema")
    ap.add_argument("--timeout", type=float, default=10.0, help="CPU seconds per engine+schema")
    ap.add_argument("--max-rss-gb", type=float, default=6.0, help="kill an engine's worker above")
    ap.add_argument("--engines", default="loom,loom-spec,llguidance,xgrammar,xgrammar-nonstrict")
    ap.add_argument("--clock", default="cpu", help="cpu (process CPU time) or wall")
    ap.add_argument("--loom-engine", default=None, help="GrammarBackend(engine=...) for loom")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--only-e2e", action="store_true")
    ap.add_argument("--requests", type=int, default=64, help="requests per end-to-end run")
    ap.add_argument("--e2e-rounds", type=int, default=3, help="alternating on/off rounds")
    args = ap.parse_args()
    if args.stride < 1 or args.instances < 1 or args.timeout <= 0:
        ap.error("--stride and --instances must be >= 1, --timeout > 0")
    for e in args.engines.split(","):
        if e not in ENGINES:
            ap.error(f"--engines: unknown engine {e!r}; expected some of {ENGINES}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    use_clock(args.clock)
    if not args.only_e2e:
        for name in args.tokenizers.split(","):
            bench_tokenizer(name, args)
    if not args.skip_e2e:
        print(f"\nend-to-end JSON extraction on the bundled model ({args.requests} requests, "
              "greedy, schema-constrained, the default grammar engine)")  # fmt: skip
        bench_e2e(args.requests, args.e2e_rounds)


if __name__ == "__main__":
    main()
