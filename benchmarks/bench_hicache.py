"""Hierarchical KV cache: a multi-tenant workload whose prefixes need ~4x the KV pool, served by
the one-tier server (radix cache over the pool) and by the same server with
--enable-hierarchical-cache (L2 host tier holding every tenant), alternating per round.

Workload: --tenants tenants, each with a --prefix-token prefix (a system prompt / document),
--requests requests in a seeded random tenant order, each the tenant's prefix + a 16-token
question, 8 greedy new tokens, sent --concurrency at a time. The KV pool is sized to
tenants x prefix / 4 tokens. Both engines run in this process's children at once (started and
warmed up first); before each timed run the cache is flushed (L1 and L2), so every run starts
cold. Prints per system: hit rate (cached / prompt tokens), requests/s, and the median
per-round ratios with their range; checks the greedy outputs are identical.

With --storage-dir (a file L3) each timed run starts with L1 and L2 empty and every page in
the files, so each tenant's first request reads L3; --sync-compare adds a third engine, the
same hierarchy with --hicache-sync-loads, and prints the step stall of both: the seconds the
scheduler thread spent loading lower tiers' pages (hicache_load_seconds: every running
request's step waits for them), beside the loader thread's read time (overlapped).

    python benchmarks/bench_hicache.py [--model bundled|PATH] [--rounds 3] [--tenants 8]
        [--prefix 512] [--requests 96] [--concurrency 4] [--storage-dir DIR [--sync-compare]]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import common

TIER_STATS = [f"hicache_{k}" for k in (
    "l1_hit_tokens", "l2_hit_tokens", "l3_hit_tokens", "l2_read_bytes", "l3_read_bytes",
    "l2_write_bytes", "l3_write_bytes", "loads", "load_seconds", "corrupt_pages")]  # fmt: skip


def workload(vocab: int, tenants: int, prefix: int, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(10, vocab) for _ in range(prefix)] for _ in range(tenants)]
    order = [rng.randrange(tenants) for _ in range(n)]
    return [heads[t] + [rng.randrange(10, vocab) for _ in range(16)] for t in order]


def _load_stats(engine) -> tuple[float, float]:
    info = engine.get_server_info()
    return info.get("hicache_load_seconds", 0.0), info.get("hicache_prefetch_seconds", 0.0)


def run(engine, prompts: list[list[int]], concurrency: int) -> dict:
    assert engine.flush_cache(), "flush_cache refused"
    load0, pre0 = _load_stats(engine)
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        wave = prompts[i : i + concurrency]
        out += engine.generate(input_ids=wave, sampling_params=[sp] * len(wave))
    seconds = time.perf_counter() - t0
    load1, pre1 = _load_stats(engine)
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in out)
    cached = sum(o["meta_info"]["cached_tokens"] for o in out)
    return {
        "seconds": seconds,
        "rps": len(prompts) / seconds,
        "hit": cached / prompt,
        "stall": load1 - load0,  # scheduler-thread seconds in load_back
        "overlapped": pre1 - pre0,  # loader-thread seconds reading L3
        "ids": [o["output_ids"] for o in out],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--storage-dir", default=None, help="also give the hierarchy a file L3")
    ap.add_argument("--sync-compare", action="store_true",
                    help="add the hierarchy with --hicache-sync-loads (needs --storage-dir)")  # fmt: skip
    args = ap.parse_args()

    from loom.runtime.engine import Engine

    label, path = common.resolve_model(args.model)
    pool = args.tenants * args.prefix // 4
    base = dict(max_total_tokens=pool, dtype="float32", max_running_requests=args.concurrency)
    hi = dict(base, enable_hierarchical_cache=True, hicache_ratio=6.0)
    if args.storage_dir:
        hi.update(hicache_storage_backend="file", hicache_storage_dir=args.storage_dir)
    print(common.header(f"bench_hicache: {label}"))
    print(
        f"{args.tenants} tenants x {args.prefix}-token prefixes = "
        f"{args.tenants * args.prefix} tokens; KV pool {pool} tokens (1/4); "
        f"{args.requests} requests, {args.concurrency} at a time"
    )
    engines = {"one-tier": Engine(path, **base), "hierarchical": Engine(path, **hi)}
    if args.sync_compare:
        assert args.storage_dir, "--sync-compare needs --storage-dir"
        engines["hierarchical sync-loads"] = Engine(path, **hi, hicache_sync_loads=True)
    try:
        vocab = engines["one-tier"].get_server_info()["vocab_size"]
        prompts = workload(vocab, args.tenants, args.prefix, args.requests)
        for e in engines.values():  # warm-up: compile, first-touch the pools
            run(e, prompts[: args.concurrency], args.concurrency)
        res = common.alternate(
            {k: (lambda e=e: run(e, prompts, args.concurrency)) for k, e in engines.items()},
            args.rounds,
        )
        one, two = res["one-tier"], res["hierarchical"]
        for runs in list(res.values())[1:]:
            assert all(a["ids"] == b["ids"] for a, b in zip(one, runs)), "greedy outputs differ"
        info = engines["hierarchical"].get_server_info()
        print("| system | hit rate | requests/s | step stall: load s on the scheduler thread "
              "| L3 reads on the loader thread, s | (medians per run) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for name, runs in res.items():
            med = {k: statistics.median(r[k] for r in runs) for k in
                   ("hit", "rps", "stall", "overlapped")}  # fmt: skip
            print(f"| {name} | {med['hit']:.1%} | {med['rps']:.2f} | {med['stall']:.3f} "
                  f"| {med['overlapped']:.3f} | |")  # fmt: skip
        if args.sync_compare:
            print("step stall, sync / overlapped loads: " + common.fmt_ratio(
                [r["stall"] for r in res["hierarchical sync-loads"]],
                [max(r["stall"], 1e-9) for r in two]))  # fmt: skip
        hit_ratio = [b["hit"] / max(a["hit"], 1e-9) for a, b in zip(one, two)]
        print(f"hit rate ratio: {statistics.median(hit_ratio):.2f}x "
              f"(range {min(hit_ratio):.2f}-{max(hit_ratio):.2f})")  # fmt: skip
        print("throughput ratio: " + common.fmt_ratio(
            [r["seconds"] for r in one], [r["seconds"] for r in two]))  # fmt: skip
        print(
            "hierarchical tiers (whole run): "
            + ", ".join(f"{k[8:]}={info[k]}" for k in sorted(info) if k in TIER_STATS)
        )
        print("greedy outputs identical: yes")
    finally:
        for e in engines.values():
            e.shutdown()


if __name__ == "__main__":
    main()
