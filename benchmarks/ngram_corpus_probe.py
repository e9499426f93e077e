"""Why a datastore of the model's own answers (scripts/ngram_corpus.py) drafts little.

    python benchmarks/ngram_corpus_probe.py --outputs /tmp/heldout6.json \\
        --corpus ~/.cache/loom/ngram_corpus/corpus.jsonl --sizes 10000,40000,160000 \\
        [--orders own>trie,own>trie>corpus,corpus,oracle,oracle-gate,oracle-gate-nocorpus]

Over bench_spec_replay's fixed greedy answers (`--outputs`, held-out rows), no model:
1. overlap: the share of the rows' output n-grams (n = 1, 2, 3, 4, 6, 8) found in the
   datastore's first N answer tokens, in the earlier rows' prompts + outputs (what the live
   trie holds) and in the row's own prompt;
2. ceilings: every step drafts 7 tokens (no gate, no rates) from the sources in order (`>`:
   the first that has a match) and advances by the accepted run + 1. Per source: the share of
   steps it drafted, draft tokens accepted per draft, first position accepted; the corpus's
   by its match window. `oracle`: the source whose draft accepts most at that step (a perfect
   selector among own tokens, trie, corpus; `-nocorpus` without it); `-gate`: and no draft
   where none accepts anything (a perfect gate too). "priced": tokens per decode step of time,
   a verify of d drafts costing 1 + extra[d] (`--extra`, the f32 profile by default).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec_replay import F32_EXTRA, Replayed, accepted, load_corpus  # noqa: E402

NS = (1, 2, 3, 4, 6, 8)
SOURCES = ("own", "trie", "corpus", "none")


def _grams(seq, n: int) -> set:
    return {tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)}


def overlap(rows: list[dict], store) -> str:
    """'n:share' of the non-warm-up rows' output n-grams in store(k, n) (row k's set)."""
    outs = [r["output"] for r in rows if r["cat"] != "warmup"]
    res = []
    for n in NS:
        hit = tot = 0
        for k, o in enumerate(outs):
            s = store(k, n)
            g = [tuple(o[i : i + n]) for i in range(len(o) - n + 1)]
            hit += sum(x in s for x in g)
            tot += len(g)
        res.append(f"{n}:{hit / max(1, tot):.1%}")
    return " ".join(res)


def ceiling(rows: list[dict], corpus, order: str, extra: list[float]) -> dict[str, Counter]:
    from loom.runtime.spec.ngram import NgramLookup, NgramState

    lk = NgramLookup(1, 12, 7, 1_000_000)  # the server's defaults: windows 1-12, 7 drafts
    per: dict[str, Counter] = {}

    def draw(source: str, req, st) -> list[int]:
        if source == "own":
            return lk._own(req, st).propose(7, 1)
        if source == "trie":
            return lk.propose(req, st, 7) if lk._match(st.pointers, ()) is not None else []
        return corpus.propose(req.tokens(max(0, req.seq_len - corpus.window), req.seq_len), 7)

    for i, row in enumerate(rows):
        req = Replayed(row["prompt"], row["output"], f"r{i}")
        st = NgramState(7)
        c = per.setdefault(row["cat"], Counter())
        ans, n = req.full, len(req.full)
        req.output_ids = ans[:1]
        while len(req.output_ids) < n:
            at = len(req.output_ids)
            lk.observe(req, st)
            draft, src = [], "none"
            if order.startswith("oracle"):
                srcs = SOURCES[:2] if "nocorpus" in order else SOURCES[:3]
                got_by = {k: draw(k, req, st) for k in srcs}
                best = max(got_by, key=lambda k: accepted(got_by[k], ans, at)[1] if got_by[k] else -1)  # fmt: skip
                if got_by[best] and ("gate" not in order or accepted(got_by[best], ans, at)[1]):
                    draft, src = got_by[best], best
            else:
                for s in order.split(">"):
                    draft = draw(s, req, st)
                    if draft:
                        src = s
                        break
            got = accepted(draft, ans, at)[1] if draft else 0
            c["steps"] += 1
            c[f"n_{src}"] += 1
            c[f"acc_{src}"] += got
            c[f"first_{src}"] += got > 0
            if src == "corpus":
                w = corpus.match(req.tokens(max(0, req.seq_len - corpus.window), req.seq_len))[0]
                c[f"cw{min(w, 4)}"] += 1
                c[f"cwacc{min(w, 4)}"] += got
            c["time"] += 1 + (extra[min(len(draft), len(extra) - 1)] if draft else 0)
            req.output_ids = ans[: at + got + 1]
        c["tokens"] += n - 1
    return per


def line(c: Counter) -> str:
    s = f"tokens/step {c['tokens'] / c['steps']:.3f} priced {c['tokens'] / c['time']:.3f}x"
    for src in SOURCES:
        if c[f"n_{src}"]:
            k = c[f"n_{src}"]
            s += f" | {src} {k / c['steps']:.0%} acc {c[f'acc_{src}'] / k:.2f} first {c[f'first_{src}'] / k:.2f}"  # fmt: skip
    if any(c[f"cw{w}"] for w in (1, 2, 3, 4)):
        s += " | corpus accepted by window 1,2,3,4+: " + " ".join(
            f"{c[f'cwacc{w}'] / max(1, c[f'cw{w}']):.2f} ({c[f'cw{w}']})" for w in (1, 2, 3, 4)
        )
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", required=True, type=Path, help="bench_spec_replay's answers")
    ap.add_argument("--corpus", required=True, type=Path, help="scripts/ngram_corpus.py's corpus.jsonl")  # fmt: skip
    ap.add_argument("--sizes", default="10000,40000", help="datastore sizes (answer tokens)")
    ap.add_argument("--orders", default="own>trie,own>trie>corpus,corpus,oracle-gate-nocorpus,oracle-gate")  # fmt: skip
    ap.add_argument("--extra", default=F32_EXTRA)
    ap.add_argument("--per-category", action="store_true", help="ceilings per category too")
    args = ap.parse_args()
    from loom.runtime.spec.ngram_corpus import CorpusIndex

    rows = json.loads(args.outputs.read_text())
    extra = [float(x) for x in args.extra.split(",")]
    off = sum(r["cat"] == "warmup" for r in rows)
    hist = [r["prompt"] + r["output"] for r in rows]
    earlier: dict = {}

    def before(k: int, n: int) -> set:
        if (k, n) not in earlier:
            earlier[(k, n)] = set().union(*(_grams(h, n) for h in hist[: off + k]))
        return earlier[(k, n)]

    print(f"output n-grams found in the earlier rows (the trie): {overlap(rows, before)}")
    print(f"  in the row's own prompt: {overlap(rows, lambda k, n: _grams(rows[off + k]['prompt'], n))}")  # fmt: skip
    for size in (int(x) for x in args.sizes.split(",")):
        docs = load_corpus(args.corpus, size, 3)
        sets = {n: set().union(*(_grams(d, n) for d in docs)) for n in NS}
        corpus = CorpusIndex(docs)
        print(f"datastore {corpus.tokens} tokens ({corpus.docs} documents): output n-grams "
              f"found {overlap(rows, lambda k, n, sets=sets: sets[n])}", flush=True)  # fmt: skip
        for order in args.orders.split(","):
            per = ceiling(rows, corpus, order, extra)
            total = Counter()
            for cat, c in per.items():
                if cat != "warmup":
                    total.update(c)
            print(f"  {order:22s} {line(total)}", flush=True)
            if args.per_category:
                for cat, c in per.items():
                    if cat != "warmup":
                        print(f"      {cat:15s} {line(c)}")


if __name__ == "__main__":
    main()
