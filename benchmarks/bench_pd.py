"""Prefill/decode disaggregation: decode inter-token latency with and without long prefills in
the same batch.

Workload (one fixed seed): --chat chat requests (a ~40-token prompt, --chat-len new tokens)
arriving every --chat-gap seconds, and --long long-prompt requests (~--long-tokens tokens,
--long-len new tokens) arriving among them; all streaming /generate, greedy.

Two set-ups of the same total size (2 CPU threads, 2 x --max-total-tokens KV):
- PD: `loom router --pd-disaggregation` over one prefill and one decode server, 1 thread each;
- colocated (--colocated dp, the default): one server with --dp-size 2 (two 1-thread replicas
  behind its in-process round-robin router), each prefilling and decoding in the same batches;
  or (--colocated single) one server with 2 threads and the whole KV, where every long
  prefill stalls every decoding request.
They alternate for --rounds rounds. Per set-up (median over rounds): chat decode ITL p50 / p99
(gaps between a chat stream's events after its first), TTFT p50 / p99 of chat and of long
requests; the ITL p99 ratio colocated / PD; and the KV bytes the prefill server sent per
request (its `disagg_kv_bytes` / `disagg_transfers`). Writes docs/img/pd_itl.png
(pd_itl_single.png with --colocated single).

    python benchmarks/bench_pd.py [--model bundled|PATH] [--rounds 2]
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
    "region schedule service shipment support tariff ticket warranty warehouse escalate"
).split()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def text_of(tok, rng: random.Random, tokens: int) -> str:
    text = ""
    while len(tok.encode(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(16)) + ".\n"
    return text


def workload(tok, a) -> list[tuple[float, str, str, int]]:
    """[(arrival seconds, kind, prompt, new tokens)], sorted by arrival."""
    rng = random.Random(0)
    items = [
        (i * a.chat_gap, "chat", f"Question {i}: " + text_of(tok, rng, 40), a.chat_len)
        for i in range(a.chat)
    ]
    span = a.chat * a.chat_gap
    for j in range(a.long):  # spread over the chat traffic, after it has started decoding
        at = span * (j + 0.5) / a.long
        items.append(
            (at, "long", f"Document {j}:\n" + text_of(tok, rng, a.long_tokens), a.long_len)
        )
    return sorted(items)


async def one(client, url: str, at: float, kind: str, prompt: str, new: int, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    stamps, last = [], None
    async with client.stream("POST", url + "/generate", json=body) as res:
        res.raise_for_status()
        async for line in res.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            stamps.append(time.perf_counter())
            last = json.loads(line[6:])
    if last is None or "error" in last:
        raise RuntimeError(f"{kind} request failed: {last}")
    return {
        "kind": kind,
        "ttft": stamps[0] - start,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "tokens": last["meta_info"]["completion_tokens"],
    }


async def run_workload(url: str, items) -> list[dict]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(client, url, *item, t0) for item in items))


def summarize(res: list[dict]) -> dict:
    chat = [r for r in res if r["kind"] == "chat"]
    long = [r for r in res if r["kind"] == "long"]
    itl = [x for r in chat for x in r["itl"]]
    return {
        "itl_p50_ms": 1000 * pct(itl, 50),
        "itl_p99_ms": 1000 * pct(itl, 99),
        "itl_max_ms": 1000 * max(itl),
        "chat_ttft_p50_ms": 1000 * pct([r["ttft"] for r in chat], 50),
        "chat_ttft_p99_ms": 1000 * pct([r["ttft"] for r in chat], 99),
        "long_ttft_p50_ms": 1000 * pct([r["ttft"] for r in long], 50),
        "long_ttft_p99_ms": 1000 * pct([r["ttft"] for r in long], 99),
    }


def plot(rows: dict[str, dict], title: str, name: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot written")
        return
    names = list(rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.6), dpi=110)
    xs = range(len(names))
    for ax, keys, label in (
        (ax1, ("itl_p50_ms", "itl_p99_ms"), "chat decode ITL (ms)"),
        (ax2, ("chat_ttft_p50_ms", "long_ttft_p50_ms"), "TTFT p50 (ms)"),
    ):
        for key, off in zip(keys, (-0.2, 0.2)):
            ax.bar([x + off for x in xs], [rows[n][key] for n in names], 0.4, label=key[:-3])
        ax.set_xticks(list(xs), names)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.text(0.99, 0.01, f"commit {common.commit()}", fontsize=6, ha="right")
    fig.tight_layout()
    common.IMG_DIR.mkdir(parents=True, exist_ok=True)
    path = common.IMG_DIR / name
    fig.savefig(path)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--chat", type=int, default=16)
    p.add_argument("--chat-len", type=int, default=128)
    p.add_argument("--chat-gap", type=float, default=0.5)
    p.add_argument("--long", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=1500)
    p.add_argument("--long-len", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--colocated",
        choices=("dp", "single"),
        default="dp",
        help="the colocated set-up: --dp-size 2 (1 thread each), or one server with 2 threads "
        "and twice the KV",
    )
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)

    import transformers

    from loom.runtime.router.process import RouterProcess
    from loom.runtime.server.runtime_client import Runtime, free_port

    label, path = common.resolve_model(a.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    items = workload(tok, a)
    kw = dict(max_total_tokens=a.max_total_tokens, cpu_threads=1)
    prefill = Runtime(
        path, disaggregation_mode="prefill", disaggregation_bootstrap_port=free_port(), **kw
    )
    decode = Runtime(path, disaggregation_mode="decode", **kw)
    if a.colocated == "dp":
        colocated = Runtime(path, dp_size=2, **kw)
    else:  # one process with both threads and both pools' KV
        colocated = Runtime(path, max_total_tokens=2 * a.max_total_tokens, cpu_threads=2)
    router = RouterProcess(
        [], "--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url
    )
    servers = [prefill, decode, colocated]
    try:
        print(common.header(f"bench_pd ({label})"))
        print(
            f"{a.chat} chat requests (~40-token prompts, {a.chat_len} new tokens, one every "
            f"{a.chat_gap} s) + {a.long} long requests (~{a.long_tokens}-token prompts, "
            f"{a.long_len} new tokens) among them; PD: 2 processes x 1 CPU thread x "
            f"{a.max_total_tokens} KV tokens; colocated: "
            + (
                f"one process x 2 threads x {2 * a.max_total_tokens} KV tokens"
                if a.colocated == "single"
                else f"--dp-size 2, 2 processes x 1 thread x {a.max_total_tokens} KV tokens"
            )
        )
        targets = {"colocated": colocated.url, "PD": router.url}
        per_round: dict[str, list[dict]] = {name: [] for name in targets}
        kv_bytes, kv_transfers = 0, 0
        for r in range(a.rounds):
            for name, url in targets.items():
                for s in servers:
                    s.flush_cache()
                before = prefill.get_server_info()
                row = summarize(asyncio.run(run_workload(url, items)))
                if name == "PD":
                    after = prefill.get_server_info()
                    kv_bytes += after["disagg_kv_bytes"] - before["disagg_kv_bytes"]
                    kv_transfers += after["disagg_transfers"] - before["disagg_transfers"]
                per_round[name].append(row)
                print(
                    f"round {r} {name:>9}: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
                    + f"; {common.loadavg()}"
                )
        rows = {
            name: {k: statistics.median(x[k] for x in runs) for k in runs[0]}
            for name, runs in per_round.items()
        }
        print(
            f"\n{'set-up':>9} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'chat TTFT p50':>14} "
            f"{'chat TTFT p99':>14} {'long TTFT p50':>14} {'long TTFT p99':>14}  (ms)"
        )
        for name, row in rows.items():
            print(
                f"{name:>9} {row['itl_p50_ms']:>8.1f} {row['itl_p99_ms']:>8.1f} {row['itl_max_ms']:>8.1f} "
                f"{row['chat_ttft_p50_ms']:>14.1f} {row['chat_ttft_p99_ms']:>14.1f} "
                f"{row['long_ttft_p50_ms']:>14.1f} {row['long_ttft_p99_ms']:>14.1f}"
            )
        itl = [
            c["itl_p99_ms"] / d["itl_p99_ms"]
            for c, d in zip(per_round["colocated"], per_round["PD"])
        ]
        print(
            f"decode ITL p99, colocated / PD: {statistics.median(itl):.2f}x "
            f"(range {min(itl):.2f}-{max(itl):.2f}, {len(itl)} rounds)"
        )
        per_req = kv_bytes / max(1, kv_transfers)
        print(
            f"KV sent prefill -> decode: {per_req / 2**20:.2f} MiB per request on average "
            f"({kv_transfers} requests, {kv_bytes / 2**20:.1f} MiB); {common.loadavg()}"
        )
        if not a.no_plot:
            single = a.colocated == "single"
            plot(
                rows,
                f"{a.chat} chat + {a.long} x ~{a.long_tokens}-token prompts, {label}, colocated: "
                + ("one 2-thread server" if single else "--dp-size 2"),
                "pd_itl_single.png" if single else "pd_itl.png",
            )
        return {"rows": rows, "itl_p99_ratio": statistics.median(itl), "kv_bytes_per_req": per_req}
    finally:
        router.shutdown()
        for s in servers:
            s.shutdown(timeout=60)


if __name__ == "__main__":
    main()
