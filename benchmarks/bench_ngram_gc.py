"""What the n-gram trie costs the cyclic garbage collector in a long-running scheduler.

A serving process freezes its start-up heap out of the collector's sight; what it builds
afterwards, the NGRAM trie (up to `--speculative-ngram-capacity` nodes) among it, is scanned by
every full collection. Per trie (this tree's, and with `--baseline REV` that revision's
`runtime/spec/ngram.py` trie, each in its own process so the heaps do not mix), after
`gc.collect(); gc.freeze()`:

1. fill: `NgramTrie(depth, capacity)` extended over --fill random tokens (vocabulary
   --vocab, seed 0; at depth 19 the trie reaches 1 M nodes after ~60 k of them and then evicts
   a node per node created): the automatic collections by generation (count, longest, total
   ms), the GC-tracked objects the trie added, the fill's thread time;
2. at capacity: --churn more tokens: the automatic full collections and their ms;
3. manual collections at capacity: `gc.collect(0)` and `gc.collect(2)`, twice each, in ms.

    python benchmarks/bench_ngram_gc.py [--baseline 367b78f] [--fill 300000] [--churn 300000]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import subprocess
import sys
import time

from bench_ngram_trie import load_ngram, new_store  # this tree's or a revision's ngram


def measure(rev: str | None, depth: int, capacity: int, fill: int, churn: int, vocab: int):
    NgramTrie = new_store(load_ngram(rev))
    # a serving process builds its first trie at start-up: the C store's library (and the
    # kernels module it is built by, with torch) load before the heap is frozen, not inside
    # the fill's figures
    NgramTrie(2, 16)
    gc.collect()
    gc.freeze()
    times: dict[int, list[float]] = {0: [], 1: [], 2: []}
    start = {}

    def on_gc(phase, info):
        if phase == "start":
            start["t"] = time.perf_counter()
        else:
            times[info["generation"]].append(time.perf_counter() - start["t"])

    tracked0 = len(gc.get_objects())
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    gc.callbacks.append(on_gc)
    trie = NgramTrie(depth, capacity)
    rng = random.Random(0)
    pointers = []
    t0 = time.thread_time()
    for _ in range(fill):
        pointers = trie.extend(pointers, rng.randrange(vocab))
    fill_s = time.thread_time() - t0
    fill_gc = {g: list(v) for g, v in times.items()}
    tracked = len(gc.get_objects()) - tracked0
    for v in times.values():
        v.clear()
    t0 = time.thread_time()
    for _ in range(churn):
        pointers = trie.extend(pointers, rng.randrange(vocab))
    churn_s = time.thread_time() - t0
    churn_full = list(times[2])
    gc.callbacks.clear()
    manual = {}
    for gen in (0, 2, 0, 2):
        t = time.perf_counter()
        gc.collect(gen)
        manual.setdefault(gen, []).append(round((time.perf_counter() - t) * 1e3, 1))
    ms = lambda v: [round(x * 1e3) for x in v]  # noqa: E731
    return {
        "trie": rev or "this tree",
        "nodes": len(trie),
        "tracked objects added by the fill": tracked,
        "fill thread s": round(fill_s, 1),
        "fill auto collections (gen: count, max ms, total ms)": {
            g: (len(v), round(max(v, default=0) * 1e3, 1), round(sum(v) * 1e3))
            for g, v in fill_gc.items()
        },
        "churn thread s": round(churn_s, 1),
        "churn auto full collections ms": ms(churn_full),
        "manual collect ms (gen 0, gen 2)": (manual[0], manual[2]),
        "max rss MB (added)": round(
            (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
        ),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", default=None, help="a revision whose trie to measure too")
    p.add_argument("--depth", type=int, default=19)
    p.add_argument("--capacity", type=int, default=1_000_000)
    p.add_argument("--fill", type=int, default=300_000)
    p.add_argument("--churn", type=int, default=300_000)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one trie
    args = p.parse_args()
    sizes = (args.depth, args.capacity, args.fill, args.churn, args.vocab)
    if args.one is not None:
        print(json.dumps(measure(args.one or None, *sizes)))
        return
    for rev in ([args.baseline] if args.baseline else []) + [""]:
        cmd = [sys.executable, __file__, "--one", rev]
        cmd += ["--depth", str(args.depth), "--capacity", str(args.capacity)]
        cmd += ["--fill", str(args.fill), "--churn", str(args.churn), "--vocab", str(args.vocab)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        for k, v in json.loads(out).items():
            print(f"{k}: {v}")
        print()


if __name__ == "__main__":
    main()
