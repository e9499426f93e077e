"""Prefill/decode disaggregation: decode inter-token latency of chats while long prompts are
prefilled, with PD vs one colocated server of the same total size.

The situation PD exists for: a long prefill in a batch stalls every request decoding beside it
(chunked prefill is off in every server here, loom's default; the header prints each server's
setting). A benchmark shows it only if (1) chats are decoding on EVERY replica whenever a long
prompt arrives, and (2) the stalled gaps are more than 1% of all chat gaps, or the ITL p99 the
issue asks for cannot see them. A stall is one gap per chat decoding on that replica, so its
share of the gaps is about (long prefills per second per replica) x (decode step seconds), and
less when two long prompts queue into one prefill. On this CPU engine (steps of ~10 ms for a
batch of ~10 chats, ~200 ms to prefill 1,000 tokens) a trial of this mix put 1.2% of the gaps
over 50 ms with 2 long prompts a second per replica (4 in all), which
keeps each colocated replica prefilling them about a third of the time - and PD's one
prefill server (the same total compute) twice that, plus every chat's prompt: PD's prefill
side runs near saturation here, and its queueing shows in TTFT, which is printed beside the ITL.

Default workload, one fixed seed, the same requests for both set-ups: an open-loop Poisson
mix, as SGLang's bench_serving sends, of a chat service with retrieval-augmented requests:
- --chat chats at --chat-rate a second (a ~40-token prompt, --chat-len new tokens): each lasts
  ~2 s, so about ten decode on each replica at any time;
- long-prompt requests (~--long-tokens tokens: a document and a request to summarize it,
  --long-len new tokens) at --long-rate a second, independent of the chats, arriving only
  while they run (from 1 s after the first chat to 1 s before the last).
That is ~1 long request per 3 chats and ~2x more prompt than output tokens: an input-heavy
RAG load, the kind PD is deployed for, not a worst case made up for it.

Two set-ups of the same total size (2 CPU threads, 2 x --max-total-tokens KV):
- PD: `loom router --pd-disaggregation` over one prefill and one decode server, 1 thread each;
  every request goes through the router, and the client reads the decode server's stream, so
  TTFT includes the router hop, the prefill queue, the handshake and the KV transfer;
- colocated (--colocated dp, the default): one server with --dp-size 2 (two 1-thread replicas
  behind its in-process round-robin router), each prefilling and decoding in the same batches;
  or (--colocated single) one server with 2 threads and the whole KV, where every long
  prefill stalls every decoding request.
They alternate for --rounds rounds (the first set-up of a round swaps each round). Per set-up
(median over rounds): chat decode ITL p50 / p99 / max (gaps between a chat stream's events
after its first), the share of those gaps over 50 ms and of chats that saw one, TTFT p50 / p99
of chats and of long requests; the ITL p99 ratio colocated / PD; and the KV bytes the prefill
server sent per request (its `disagg_kv_bytes` / `disagg_transfers`). Writes
docs/img/pd_itl.png (pd_itl_single.png with --colocated single).

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
STALL_S = 0.05  # a decode gap this long is a stall (~15-30 ordinary steps)
# (key, column title): the per-set-up figures, in the order the table prints them (ms or %)
COLUMNS = (
    ("itl_p50_ms", "ITL p50"),
    ("itl_p99_ms", "ITL p99"),
    ("itl_max_ms", "ITL max"),
    ("gaps_stalled_pct", "gaps >50ms %"),
    ("chats_stalled_pct", "chats >50ms %"),
    ("chat_ttft_p50_ms", "chat TTFT p50"),
    ("chat_ttft_p99_ms", "chat TTFT p99"),
    ("long_ttft_p50_ms", "long TTFT p50"),
    ("long_ttft_p99_ms", "long TTFT p99"),
)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def text_of(tok, rng: random.Random, tokens: int) -> str:
    text = ""
    while len(tok.encode(text)) < tokens:
        text += " ".join(rng.choice(WORDS) for _ in range(16)) + ".\n"
    return text


def workload(tok, a) -> list[tuple[float, str, str, int]]:
    """[(arrival seconds, kind, prompt, new tokens)], sorted by arrival: Poisson chats, and
    Poisson long prompts while the chats run (from 1 s after the first to 1 s before the last),
    so chats are decoding on every replica whenever a long prompt arrives."""
    rng = random.Random(0)
    items, at = [], 0.0
    for i in range(a.chat):
        items.append((at, "chat", f"Question {i}: " + text_of(tok, rng, 40), a.chat_len))
        at += rng.expovariate(a.chat_rate)
    end, at, j = items[-1][0] - 1.0, 1.0 + rng.expovariate(a.long_rate), 0
    while at < end:
        prompt = f"Document {j}:\n" + text_of(tok, rng, a.long_tokens) + "Summarize it."
        items.append((at, "long", prompt, a.long_len))
        at, j = at + rng.expovariate(a.long_rate), j + 1
    if j == 0:
        raise ValueError("--long-rate: no long prompt arrives while the chats run")
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
        "gaps_stalled_pct": 100 * sum(x > STALL_S for x in itl) / len(itl),
        "chats_stalled_pct": 100 * sum(max(r["itl"]) > STALL_S for r in chat) / len(chat),
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
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6), dpi=110)
    xs = range(len(names))
    panels = (
        (("itl_p50_ms", "itl_p99_ms", "itl_max_ms"), "chat decode ITL (ms, log)"),
        (("gaps_stalled_pct", "chats_stalled_pct"), "stalls > 50 ms (% of gaps, of chats)"),
        (("chat_ttft_p50_ms", "long_ttft_p50_ms"), "TTFT p50 (ms)"),
    )
    for ax, (keys, label) in zip(axes, panels):
        width = 0.8 / len(keys)
        for i, key in enumerate(keys):
            off = (i - (len(keys) - 1) / 2) * width
            ax.bar([x + off for x in xs], [rows[n][key] for n in names], width, label=key)
        ax.set_xticks(list(xs), names)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    fig.suptitle(title, fontsize=9)
    fig.text(0.99, 0.01, f"commit {common.commit()}", fontsize=6, ha="right")
    fig.tight_layout()
    common.IMG_DIR.mkdir(parents=True, exist_ok=True)
    path = common.IMG_DIR / name
    fig.savefig(path)
    print(f"wrote {path}")


def chunking(servers: dict) -> str:
    """Each server's chunked-prefill setting; the set-ups must not differ in it."""
    sizes = {n: s.server_args.effective_chunked_prefill_size for n, s in servers.items()}
    if len(set(sizes.values())) != 1:
        raise RuntimeError(f"chunked prefill differs between the servers: {sizes}")
    size = next(iter(sizes.values()))
    return "chunked prefill off in every server" if size is None else f"chunk {size} everywhere"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--chat", type=int, default=80)
    p.add_argument("--chat-rate", type=float, default=10.0, help="chats a second (Poisson)")
    p.add_argument("--chat-len", type=int, default=192)
    p.add_argument("--long-rate", type=float, default=4.0, help="long prompts a second (Poisson)")
    p.add_argument("--long-tokens", type=int, default=1000)
    p.add_argument("--long-len", type=int, default=16)
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
    for name in ("chat_rate", "long_rate"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")

    import transformers

    from loom.runtime.router.process import RouterProcess
    from loom.runtime.server.runtime_client import Runtime, free_port

    label, path = common.resolve_model(a.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    items = workload(tok, a)
    n_long = sum(kind == "long" for _, kind, _, _ in items)
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
            f"{a.chat} chats (Poisson {a.chat_rate}/s, ~40-token prompts, {a.chat_len} new "
            f"tokens) + {n_long} long requests (Poisson {a.long_rate}/s while the chats run, "
            f"~{a.long_tokens}-token prompts, {a.long_len} new tokens) over "
            f"{items[-1][0]:.1f} s; PD: 2 processes x 1 CPU thread x "
            f"{a.max_total_tokens} KV tokens; colocated: "
            + (
                f"one process x 2 threads x {2 * a.max_total_tokens} KV tokens"
                if a.colocated == "single"
                else f"--dp-size 2, 2 processes x 1 thread x {a.max_total_tokens} KV tokens"
            )
            + "; "
            + chunking({"prefill": prefill, "decode": decode, "colocated": colocated})
        )
        targets = {"colocated": colocated.url, "PD": router.url}
        per_round: dict[str, list[dict]] = {name: [] for name in targets}
        kv_bytes, kv_transfers = 0, 0
        for r in range(a.rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                for s in servers:
                    s.flush_cache()
                before = prefill.get_server_info()
                row = summarize(asyncio.run(run_workload(targets[name], items)))
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
        print(f"\n{'set-up':>9} " + " ".join(f"{t:>14}" for _, t in COLUMNS) + "  (ms, %)")
        for name, row in rows.items():
            print(f"{name:>9} " + " ".join(f"{row[k]:>14.1f}" for k, _ in COLUMNS))
        p99 = {name: [x["itl_p99_ms"] for x in runs] for name, runs in per_round.items()}
        ratio = common.ratio_summary(p99["colocated"], p99["PD"])[0]
        print("decode ITL p99, colocated / PD: " + common.fmt_ratio(p99["colocated"], p99["PD"]))
        stalled = rows["colocated"]["gaps_stalled_pct"]
        if stalled < 1.0:
            print(
                f"note: {stalled:.1f}% of the colocated chat gaps are over 50 ms, under 1%: the "
                "p99 cannot see the long-prefill stalls (raise --long-rate or --chat-rate)"
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
                f"{a.chat} chats at {a.chat_rate}/s + {n_long} x ~{a.long_tokens}-token prompts "
                f"at {a.long_rate}/s, {label}, colocated: "
                + ("one 2-thread server" if single else "--dp-size 2"),
                "pd_itl_single.png" if single else "pd_itl.png",
            )
        return {"rows": rows, "itl_p99_ratio": ratio, "kv_bytes_per_req": per_req}
    finally:
        router.shutdown()
        for s in servers:
            s.shutdown(timeout=60)


if __name__ == "__main__":
    main()
