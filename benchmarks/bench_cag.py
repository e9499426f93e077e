"""RAG vs CAG, measured: a ~6,000-token document and --questions questions about it.

The document is a seeded knowledge base of people records ("Record 12. Vorane Dalit lives in
the city of Kelmor. ..."); each question asks one person's city and the answer counts as right
when the greedy completion names it. Four ways to answer, TTFT (first streamed token) per
question, p50:

  (a) no cache: a server with --disable-radix-cache prefills document + question every time;
  (b) CAG from L1: --enable-hierarchical-cache, the document pinned (/pin_prefix), so each
      question prefills only itself;
  (c) CAG from L3 after a restart: the server is shut down and started again on the same file
      tier: the pin is restored from the files at start-up (its load time is reported), then
      the questions run as in (b);
  (d) RAG: the top-3 records by BM25 (the `rank-bm25` library) over the document's records,
      prefilled with the question (the no-cache server).

Also reported: tokens prefilled per question (prompt - cached) and accuracy. The phases run one
after the other (one model in memory at a time), not alternating: the ratios asked for are an
order of magnitude, far above this machine's noise.

    python benchmarks/bench_cag.py [--model PATH] [--questions 20] [--records 90]
        [--no-cache-questions N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import common

SMOLLM2 = Path.home() / ".cache" / "loom" / "models" / "smollm2-135m-f32"
SYL = ["ka", "lo", "mir", "ta", "ven", "dor", "sel", "ri", "no", "bar", "quel", "zan", "fi", "tor"]
JOBS = ["baker", "pilot", "teacher", "farmer", "painter", "doctor", "sailor", "miner"]
PETS = ["cat", "dog", "horse", "parrot", "goat", "rabbit"]


def knowledge_base(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """[(record text, person, city)], names and cities unique."""
    rng = random.Random(seed)
    used: set[str] = set()

    def word(k: int) -> str:
        while True:
            w = "".join(rng.choice(SYL) for _ in range(k)).capitalize()
            if w not in used:
                used.add(w)
                return w

    out = []
    for i in range(n):
        person, city = f"{word(2)} {word(3)}", word(3)
        text = (
            f"Record {i + 1}. {person} lives in the city of {city}. {person} works as a "
            f"{rng.choice(JOBS)} and keeps a {rng.choice(PETS)}. Every spring {person.split()[0]} "
            f"travels from {city} to the coast, and returns to {city} before the summer "
            f"festival. Neighbours describe {person.split()[0]} as {rng.choice(['quiet', 'kind', 'busy', 'cheerful'])}.\n"
        )
        out.append((text, person, city))
    return out


def ask(engine, prompt: str, max_new: int = 6) -> dict:
    """TTFT (first streamed chunk) and the whole answer."""
    sp = {"max_new_tokens": max_new, "temperature": 0}
    t0 = time.perf_counter()
    ttft, last = None, None
    for chunk in engine.generate(prompt, sp, stream=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        last = chunk
    meta = last["meta_info"]
    return {
        "ttft": ttft,
        "text": last["text"],
        "prefilled": meta["prompt_tokens"] - meta["cached_tokens"],
        "cached": meta["cached_tokens"],
    }


def question(person: str) -> str:
    return f"Question: In which city does {person} live?\nAnswer: {person} lives in the city of"


TIERS = ("l1", "l2", "l3")


def tier_hits(engine) -> dict[str, int]:
    info = engine.get_server_info()
    return {t: info.get(f"hicache_{t}_hit_tokens", 0) for t in TIERS}


def phase(engine, prompts: list[str], cities: list[str], name: str = "") -> dict:
    before = tier_hits(engine)
    res = [ask(engine, p) for p in prompts]
    after = tier_hits(engine)
    out = {
        "tiers": {t: (after[t] - before[t]) / len(res) for t in TIERS},
        "cached": statistics.mean(r["cached"] for r in res),
        "ttft_p50": statistics.median(r["ttft"] for r in res),
        "prefilled": statistics.mean(r["prefilled"] for r in res),
        "accuracy": sum(c in r["text"] for r, c in zip(res, cities)) / len(res),
        "answers": [r["text"] for r in res],
    }
    print(f"phase done: {name} TTFT p50 {out['ttft_p50']:.3f} s, prefilled "
          f"{out['prefilled']:.0f}, accuracy {out['accuracy']:.0%}, {common.loadavg()}",
          flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(SMOLLM2) if SMOLLM2.exists() else None)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--records", type=int, default=90)
    ap.add_argument(
        "--no-cache-questions",
        type=int,
        default=None,
        help="questions (a) runs (default: all); each is a full prefill of the document",
    )
    ap.add_argument("--storage-dir", default=None)
    args = ap.parse_args()

    from rank_bm25 import BM25Okapi

    from loom.runtime.engine import Engine
    from loom.runtime.tokenizer import load_tokenizer

    label, path = common.resolve_model(args.model)
    kb = knowledge_base(args.records)
    doc = "".join(t for t, _, _ in kb) + "\n"
    doc_tokens = len(load_tokenizer(path).encode(doc))
    rng = random.Random(1)
    picks = rng.sample(range(len(kb)), args.questions)
    cities = [kb[i][2] for i in picks]
    cag_prompts = [doc + question(kb[i][1]) for i in picks]
    bm25 = BM25Okapi([t.lower().replace(".", " ").split() for t, _, _ in kb])
    rag_prompts = []
    for i in picks:
        q = question(kb[i][1])
        top = bm25.get_top_n(q.lower().replace("?", " ").split(), [t for t, _, _ in kb], n=3)
        rag_prompts.append("".join(top) + "\n" + q)
    storage = args.storage_dir or tempfile.mkdtemp(prefix="loom-cag-")
    # the document and a question's worth of room: a bigger pool only costs memory
    common_args = dict(dtype="float32", max_total_tokens=doc_tokens + 2048, context_length=8192,
                       chunked_prefill_size=512, watchdog_timeout=1800)  # fmt: skip
    hi = dict(common_args, enable_hierarchical_cache=True, hicache_storage_backend="file",
              hicache_storage_dir=storage)  # fmt: skip
    print(common.header(f"bench_cag: {label}"))
    print(f"document: {args.records} records, {doc_tokens} tokens; {args.questions} questions"
          f" ((a): the first {args.no_cache_questions or args.questions})")  # fmt: skip

    rows = {}
    with Engine(path, disable_radix_cache=True, **common_args) as e:
        ask(e, rag_prompts[0])  # warm-up
        k = args.no_cache_questions or args.questions
        rows["(a) no cache"] = phase(e, cag_prompts[:k], cities[:k], "(a) no cache")
        rows["(d) RAG top-3 BM25"] = phase(e, rag_prompts, cities, "(d) RAG top-3 BM25")
    with Engine(path, **hi) as e:
        t0 = time.perf_counter()
        pinned = e.pin_prefix("kb", text=doc)
        pin_s = time.perf_counter() - t0
        print(f"pinned {pinned['tokens']} tokens in {pin_s:.2f} s", flush=True)
        rows["(b) CAG from L1"] = phase(e, cag_prompts, cities, "(b) CAG from L1")
    with Engine(path, **hi) as e:  # a restart: the pin comes back from the files
        info = e.get_server_info()
        restore = (info["hicache_load_seconds"], info["hicache_l3_hit_tokens"])
        rows["(c) CAG from L3 after restart"] = phase(
            e, cag_prompts, cities, "(c) CAG from L3 after restart"
        )
        e.unpin_prefix("kb")

    print(f"pin_prefix: {pinned['tokens']} tokens pinned in {pin_s:.2f} s (one full prefill)")
    print(
        f"restart: the pin restored from L3 at start-up: {restore[1]} tokens in {restore[0]:.3f} s"
    )
    print("| way | TTFT p50 (s) | tokens prefilled / question | accuracy |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['ttft_p50']:.3f} | {r['prefilled']:.0f} | {r['accuracy']:.0%} |")
    base = rows["(a) no cache"]["ttft_p50"]
    for name in list(rows)[1:]:
        print(f"TTFT (a) / {name}: {base / rows[name]['ttft_p50']:.1f}x")
    k = len(rows["(a) no cache"]["answers"])
    same = all(
        rows[name]["answers"][:k] == rows["(a) no cache"]["answers"]
        for name in ("(b) CAG from L1", "(c) CAG from L3 after restart")
    )
    print(f"greedy answers of (b) and (c) identical to (a) on its {k} questions: {same}")
    print("sample answers (c):", rows["(c) CAG from L3 after restart"]["answers"][:3])
    print("hicache hit tokens per question by tier (server counters over each phase):")
    for name, r in rows.items():
        print(f"  {name}: " + ", ".join(f"{t}={v:.0f}" for t, v in r["tiers"].items()))
    print(f"end: {common.loadavg()}")
    out = plot(rows, f"bench_cag: {label}, {doc_tokens}-token document, {common.loadavg()}")
    if out is not None:
        print(f"plot: {out}")


def plot(rows: dict, title: str) -> Path | None:
    """docs/img/cag_ttft.png: TTFT p50 per way (log scale) and the prompt tokens per question
    split into prefilled and cached."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(rows)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.bar(range(len(names)), [rows[n]["ttft_p50"] for n in names], color="tab:blue")
    a.set_yscale("log")
    a.set_ylabel("TTFT p50 (s, log)")
    for ax in (a, b):
        ax.set_xticks(range(len(names)), [n.split(" ", 1)[1] for n in names], rotation=15)
    bottom = [0.0] * len(names)
    for label_, key, color in (("prefilled", "prefilled", "tab:red"),
                               ("cached (prefix hit)", "cached", "tab:green")):  # fmt: skip
        vals = [rows[n][key] for n in names]
        b.bar(range(len(names)), vals, bottom=bottom, label=label_, color=color)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_ylabel("prompt tokens per question")
    b.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = common.IMG_DIR / "cag_ttft.png"
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    main()
