"""Online serving benchmark, in the manner of `sglang.bench_serving`.

Poisson arrivals at several request rates against the HTTP server (streaming /generate),
reporting request throughput, output token throughput, TTFT and ITL (p50 / p99), and the
server against the in-process Engine at saturation (every request at once, one streaming call
per request on both sides), same prompts, same run. Both the server and the Engine are started
and warmed up first and stay up together; the saturation runs alternate server, Engine, server,
Engine (--rounds) before the rate sweep, so neither side runs first on a fresh process or after
the other's sweep; the ratio is the median of the per-round ratios with its range. The Engine
side runs its asyncio clients in the process that holds its TokenizerManager (that is what an
Engine is); the HTTP clients run in this process and the server's TokenizerManager in its own.
Writes docs/img/serving_latency_<model>.png (TTFT and ITL p50/p99 against request rate).

    python benchmarks/bench_serving.py [--model bundled|qwen0.5b-f32|PATH] --num-prompts 64
        --request-rates 2,8,32 [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import common


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    error: str = ""


def make_prompts(n: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # ids 3.. avoid the special tokens of the project's tokenizers
    return [
        [rng.randrange(3, vocab) for _ in range(rng.randint(input_len // 2, input_len))]
        for _ in range(n)
    ]


async def one_request(client, url: str, ids: list[int], output_len: int) -> Result:
    import httpx

    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0},
        "stream": True,
    }
    res = Result()
    start = last = time.perf_counter()
    seen = 0
    try:
        async with client.stream("POST", url + "/generate", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                out = json.loads(line[6:])
                n = len(out["output_ids"])
                now = time.perf_counter()
                if n > seen:
                    if seen == 0:
                        res.ttft = now - start
                    else:
                        res.itl.extend([(now - last) / (n - seen)] * (n - seen))
                    seen, last = n, now
        res.e2e = time.perf_counter() - start
        res.output_tokens = seen
        res.ok = True
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def run_rate(url: str, prompts, output_len: int, rate: float, seed: int):
    import httpx

    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for ids in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, ids, output_len)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(label: str, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    itl = [x for r in ok for x in r.itl]
    row = {
        "label": label,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "req_per_s": len(ok) / duration,
        "out_tok_per_s": sum(r.output_tokens for r in ok) / duration,
        "ttft_p50_ms": 1000 * pct([r.ttft for r in ok], 50),
        "ttft_p99_ms": 1000 * pct([r.ttft for r in ok], 99),
        "itl_p50_ms": 1000 * pct(itl, 50),
        "itl_p99_ms": 1000 * pct(itl, 99),
        "e2e_mean_s": statistics.fmean([r.e2e for r in ok]) if ok else float("nan"),
    }
    errors = {r.error for r in results if not r.ok}
    if errors:
        row["errors"] = sorted(errors)[:3]
    return row


class EngineSide:
    """The in-process Engine, warmed up once, driven like the HTTP clients drive the server."""

    def __init__(self, server_args: dict, prompts, output_len: int):
        from loom.runtime.engine import Engine

        self.engine = Engine(**server_args, log_level="warning")
        self.sp = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
        self.prompts = prompts
        self.saturation(prompts[:4])  # warm-up, as the server gets

    def saturation(self, prompts=None) -> tuple[float, float]:
        """Every prompt at once, one streaming call per request: (req/s, output tok/s)."""
        prompts = prompts or self.prompts
        self.engine.flush_cache()

        async def one(ids):
            stream = await self.engine.async_generate(
                input_ids=ids, sampling_params=self.sp, stream=True
            )
            last = None
            async for chunk in stream:
                last = chunk
            return last

        async def all_at_once():
            return await asyncio.gather(*(one(ids) for ids in prompts))

        start = time.perf_counter()
        outs = asyncio.run(all_at_once())
        duration = time.perf_counter() - start
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
        return len(outs) / duration, tokens / duration

    def close(self) -> None:
        self.engine.shutdown()


def print_table(rows: list[dict]) -> None:
    cols = [
        ("label", "{:>12}"),
        ("completed", "{:>9}"),
        ("req_per_s", "{:>9.2f}"),
        ("out_tok_per_s", "{:>13.1f}"),
        ("ttft_p50_ms", "{:>11.1f}"),
        ("ttft_p99_ms", "{:>11.1f}"),
        ("itl_p50_ms", "{:>10.1f}"),
        ("itl_p99_ms", "{:>10.1f}"),
    ]
    print(" ".join(f"{name:>{len(fmt.format(0) if 'f' in fmt else name)}}" for name, fmt in cols))
    for row in rows:
        print(" ".join(fmt.format(row[name]) for name, fmt in cols))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled", help=f"one of {common.MODELS} or a folder")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rates", default="2,8,32", help="requests/s, comma separated")
    p.add_argument("--rounds", type=int, default=3, help="alternating saturation rounds")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-engine", action="store_true", help="skip the in-process comparison")
    p.add_argument("--json", default=None, help="also write the results to this file")
    a = p.parse_args(argv)

    import requests

    from loom.runtime.server.runtime_client import Runtime

    label, path = common.resolve_model(a.model)
    print(common.header("bench_serving"))
    server_args: dict = {"model_path": path}
    if a.max_total_tokens:
        server_args["max_total_tokens"] = a.max_total_tokens
    rates = [float(r) for r in a.request_rates.split(",")]
    rows = []
    report: dict = {"config": vars(a), "model": label}
    with Runtime(**server_args) as rt:
        info = requests.get(rt.url + "/model_info").json()
        prompts = make_prompts(a.num_prompts, a.input_len, min(info["vocab_size"], 30000), a.seed)
        asyncio.run(run_rate(rt.url, prompts[:4], a.output_len, float("inf"), a.seed))  # warm-up
        engine = None if a.skip_engine else EngineSide(server_args, prompts, a.output_len)

        def server_saturation() -> dict:
            requests.post(rt.url + "/flush_cache")
            results, duration = asyncio.run(
                run_rate(rt.url, prompts, a.output_len, float("inf"), a.seed)
            )
            return summarize("saturation", results, duration)

        try:
            sat_rows, eng = [], []
            for _ in range(a.rounds):
                sat_rows.append(server_saturation())
                if engine is not None:
                    eng.append(engine.saturation())
        finally:
            if engine is not None:
                engine.close()
        for rate in rates:
            requests.post(rt.url + "/flush_cache")
            results, duration = asyncio.run(run_rate(rt.url, prompts, a.output_len, rate, a.seed))
            rows.append(summarize(f"{rate:g} req/s", results, duration))
    srv = [r["req_per_s"] for r in sat_rows]  # per round, in order, paired with eng
    rows.append(sorted(sat_rows, key=lambda r: r["req_per_s"])[len(sat_rows) // 2])
    print(f"\nmodel {label}; {a.num_prompts} prompts, input <= {a.input_len}, "
          f"output {a.output_len} tokens (ignore_eos); saturation row: median of {a.rounds}")  # fmt: skip
    print_table(rows)
    report["server"] = rows
    if eng:
        e_req = [x for x, _ in eng]
        report["engine"] = {"req_per_s": statistics.median(e_req)}
        report["server_vs_engine"] = common.ratio_summary(srv, e_req)
        print(
            f"\nin-process Engine at saturation: {statistics.median(e_req):.2f} req/s "
            f"({min(e_req):.2f}-{max(e_req):.2f}), "
            f"{statistics.median(t for _, t in eng):.1f} out tok/s"
        )
        print(f"server / engine (requests/s): {common.fmt_ratio(srv, e_req)}")
    finite = [r for r in rows if r["label"] != "saturation"]
    if finite:
        xs = [float(r["label"].split()[0]) for r in finite]
        common.plot(
            f"serving_latency_{label}.png",
            f"Serving latency vs request rate ({label}, {a.num_prompts} prompts)",
            "request rate (req/s)",
            "ms",
            {
                k: (xs, [r[k] for r in finite])
                for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
            },
            logy=True,
        )
    print(common.loadavg())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
