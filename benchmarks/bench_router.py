"""Routing policies on a multi-tenant workload, and the router's own overhead.

Workload: --tenants tenants (8), each with its own system prompt of ~--system-tokens tokens
(1,000), and --questions questions per tenant, interleaved (every tenant's question 0, then
every tenant's question 1, ...), sent by --concurrency closed-loop clients as streaming
/generate requests (greedy, --output-len new tokens). Two loom servers (the workers) each hold
--max-total-tokens KV slots: room for about half of the tenants' prompts, so a policy that
spreads every tenant over both workers makes each cache cycle through all eight prompts (LRU
thrash), while one that keeps each tenant on one worker reuses its prompt.

For each policy (round_robin, shortest_queue, cache_aware) a `loom router` runs in front of the
same two workers, and beside them SGLang's sglang-router (its wheel; `sglang:round_robin`,
`sglang:cache_aware`; --no-sglang leaves it out); the routers alternate for --rounds rounds (the order rotating each round),
the workers' caches flushed before every run. A run first sends --warmup question rounds
(every tenant's first question: a full prefill under any policy, since no worker has seen the
tenant yet), then times the --questions rounds. Measured on the timed requests, per policy:
cache hit rate (cached / prompt tokens, from meta_info), TTFT p50 / p99 (median over rounds),
and in how many rounds cache_aware was best on each; the warm-up's slowest TTFT is printed
beside them. Without the warm-up (--warmup 0) the p99 of 48 requests is the slowest of the
first wave, --concurrency cold prefills split over the two workers, which costs every policy
the same and so compares noise. Router overhead: a 1-token /generate, directly to a worker
and through the router, alternating, --overhead-requests times; the median difference in ms, for
`loom router` and for sglang-router.
Writes docs/img/router_policies.png.

    python benchmarks/bench_router.py [--model bundled|PATH] [--rounds 6] [--questions 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import common

WORDS = (
    "account billing contract customer delivery invoice order payment policy product refund "
    "region schedule service shipment support tariff ticket warranty warehouse escalate "
    "priority premium standard agent manager weekday holiday discount voucher balance"
).split()


def system_prompt(tok, tenant: int, target: int) -> str:
    rng = random.Random(tenant)
    text = f"You are the support assistant of tenant {tenant}. Follow these rules.\n"
    while len(tok.encode(text)) < target:
        text += " ".join(rng.choice(WORDS) for _ in range(12)) + ".\n"
    return text


def workload(tok, tenants: int, questions: int, target: int) -> list[tuple[int, str]]:
    systems = [system_prompt(tok, t, target) for t in range(tenants)]
    rng = random.Random(0)
    out = []
    for q in range(questions):
        order = list(range(tenants))
        rng.shuffle(order)  # interleaved, not in lockstep
        out += [(t, f"{systems[t]}\nUser question {q}: {rng.choice(WORDS)}?\n") for t in order]
    return out


LOOM_POLICIES = ("round_robin", "shortest_queue", "cache_aware")
SGLANG_POLICIES = ("sglang:round_robin", "sglang:cache_aware")


def start_router(urls: list[str], name: str):
    """`loom router --policy name`, or sglang-router for a name `sglang:policy`."""
    from loom.runtime.router.process import RouterProcess

    kind, _, policy = name.rpartition(":")
    return RouterProcess(urls, "--policy", policy, kind=kind or "loom")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one(client, url: str, prompt: str, output_len: int) -> dict:
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    ttft, last = None, None
    async with client.stream("POST", url + "/generate", json=body) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            last = json.loads(line[6:])
    if "error" in last:
        raise RuntimeError(last["error"])
    meta = last["meta_info"]
    return {"ttft": ttft, "prompt": meta["prompt_tokens"], "cached": meta["cached_tokens"]}


async def run_workload(url: str, items, concurrency: int, output_len: int) -> list[dict]:
    import httpx

    queue = list(items)
    results: list[dict] = []

    async def client_loop(client):
        while queue:
            _, prompt = queue.pop(0)
            results.append(await one(client, url, prompt, output_len))

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return results


def overhead(direct_url: str, router_url: str, n: int) -> tuple[float, float, float]:
    """(median direct ms, median through-router ms, median per-pair difference ms)."""
    import requests

    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    session = requests.Session()

    def timed(url: str) -> float:
        t = time.perf_counter()
        session.post(url + "/generate", json=body, timeout=60).raise_for_status()
        return 1000 * (time.perf_counter() - t)

    for url in (direct_url, router_url):  # warm connections
        timed(url)
    pairs = [(timed(direct_url), timed(router_url)) for _ in range(n)]
    return (
        statistics.median(d for d, _ in pairs),
        statistics.median(r for _, r in pairs),
        statistics.median(r - d for d, r in pairs),
    )


def cache_aware_best(rows: dict[str, dict], metric: str) -> bool:
    """loom's cache_aware strictly best on `metric` (highest hit rate, lowest TTFT) among
    loom's policies."""
    best = rows["cache_aware"][metric]
    others = [row[metric] for name, row in rows.items() if name in LOOM_POLICIES[:2]]
    return all(best > o if metric == "hit_rate" else best < o for o in others)


def plot(rows: dict[str, dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.6), dpi=110)
    ax1.bar(names, [100 * rows[n]["hit_rate"] for n in names], color="#4c72b0")
    ax1.set_ylabel("cache hit rate (%)")
    ax1.set_ylim(0, 100)
    xs = range(len(names))
    ax2.bar([x - 0.2 for x in xs], [rows[n]["ttft_p50_ms"] for n in names], 0.4, label="p50")
    ax2.bar([x + 0.2 for x in xs], [rows[n]["ttft_p99_ms"] for n in names], 0.4, label="p99")
    ax2.set_xticks(list(xs), names)
    ax2.set_ylabel("TTFT (ms)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("8 tenants x ~1,000-token system prompts, 2 workers", fontsize=10)
    fig.text(0.99, 0.01, f"commit {common.commit()}", fontsize=6, ha="right")
    fig.tight_layout()
    common.IMG_DIR.mkdir(parents=True, exist_ok=True)
    path = common.IMG_DIR / "router_policies.png"
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--questions", type=int, default=6)
    p.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="question rounds per tenant sent before the timed ones (the cold start)",
    )
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=6144)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--overhead-requests", type=int, default=50)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-sglang", action="store_true", help="leave sglang-router out")
    a = p.parse_args(argv)

    import transformers

    from loom.runtime.server.runtime_client import Runtime

    label, path = common.resolve_model(a.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    items = workload(tok, a.tenants, a.warmup + a.questions, a.system_tokens)
    warm, timed = items[: a.tenants * a.warmup], items[a.tenants * a.warmup :]
    policies = LOOM_POLICIES + (() if a.no_sglang else SGLANG_POLICIES)
    kw = dict(max_total_tokens=a.max_total_tokens, cpu_threads=a.cpu_threads)
    with Runtime(path, **kw) as w1, Runtime(path, **kw) as w2:
        urls = [w1.url, w2.url]
        routers = {name: start_router(urls, name) for name in policies}
        try:
            print(common.header(f"bench_router ({label})"))
            print(
                f"{a.tenants} tenants x {a.questions} questions after {a.warmup} warm-up "
                f"question(s) each, system prompts ~{a.system_tokens} tokens, {a.output_len} "
                f"new tokens, concurrency {a.concurrency}, 2 workers x {a.max_total_tokens} "
                "KV tokens"
            )
            per_round: dict[str, list[dict]] = {name: [] for name in policies}
            for r in range(a.rounds):
                # the order rotates each round: no policy always runs first (cold machine)
                # or last (after the others' load)
                k = r % len(policies)
                for name in policies[k:] + policies[:k]:
                    for w in (w1, w2):
                        w.flush_cache()
                    url = routers[name].url
                    t = time.perf_counter()
                    cold = asyncio.run(run_workload(url, warm, a.concurrency, a.output_len))
                    res = asyncio.run(run_workload(url, timed, a.concurrency, a.output_len))
                    ttfts = [x["ttft"] for x in res]
                    row = {
                        "hit_rate": sum(x["cached"] for x in res) / sum(x["prompt"] for x in res),
                        "ttft_p50_ms": 1000 * pct(ttfts, 50),
                        "ttft_p99_ms": 1000 * pct(ttfts, 99),
                        "warmup_ttft_max_ms": 1000 * max((x["ttft"] for x in cold), default=0),
                        "seconds": time.perf_counter() - t,
                    }
                    per_round[name].append(row)
                    print(
                        f"round {r} {name:>18}: "
                        + ", ".join(f"{k} {v:.3f}" for k, v in row.items())
                    )
            rows = {
                name: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
                for name, runs in per_round.items()
            }
            print(
                f"\n{'policy':>18} {'hit rate':>9} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} "
                f"{'warm-up TTFT max ms':>20}"
            )
            for name, row in rows.items():
                print(
                    f"{name:>18} {100 * row['hit_rate']:>8.1f}% {row['ttft_p50_ms']:>12.1f} "
                    f"{row['ttft_p99_ms']:>12.1f} {row['warmup_ttft_max_ms']:>20.1f}"
                )
            metrics = ("hit_rate", "ttft_p50_ms", "ttft_p99_ms")
            wins = {k: cache_aware_best(rows, k) for k in metrics}
            rounds_won = {
                k: sum(
                    cache_aware_best({n: runs[r] for n, runs in per_round.items()}, k)
                    for r in range(a.rounds)
                )
                for k in metrics
            }
            print(
                "cache_aware best on (medians; rounds won): "
                + ", ".join(
                    f"{k} {'yes' if wins[k] else 'NO'} ({rounds_won[k]}/{a.rounds})"
                    for k in metrics
                )
            )
            overheads = {}
            for name in ("round_robin",) + (() if a.no_sglang else ("sglang:round_robin",)):
                with start_router([w1.url], name) as solo:
                    d, r_ms, diff = overhead(w1.url, solo.url, a.overhead_requests)
                overheads[name] = diff
                print(
                    f"{'sglang-router' if ':' in name else 'loom router'} overhead (1-token "
                    f"/generate, {a.overhead_requests} pairs): direct {d:.2f} ms, through the "
                    f"router {r_ms:.2f} ms, median difference {diff:.2f} ms; {common.loadavg()}"
                )
            diff = overheads["round_robin"]
            if not a.no_plot:
                plot(rows)
            return {
                "rows": rows,
                "wins": wins,
                "rounds_won": rounds_won,
                "overhead_ms": diff,
                "overheads_ms": overheads,
            }
        finally:
            for router in routers.values():
                router.shutdown()


if __name__ == "__main__":
    main()
