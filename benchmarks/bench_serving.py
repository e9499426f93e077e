"""Online serving benchmark, in the manner of `sglang.bench_serving`.

Poisson arrivals at several request rates against the HTTP server (streaming /generate),
reporting request throughput, output token throughput, TTFT and ITL (p50 / p99); then the
server against the in-process Engine at saturation (every request at once), same prompts,
same machine, same run, and the ratio between them.

    python benchmarks/bench_serving.py --model-path PATH --num-prompts 64 --request-rates 2,8,32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field


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


def engine_saturation(server_args: dict, prompts, output_len: int) -> tuple[float, float]:
    """Every prompt at once through the in-process Engine, streaming like the HTTP clients:
    (req/s, output tok/s)."""
    from loom.runtime.engine import Engine

    engine = Engine(**server_args)
    try:
        sp = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0.0}
        engine.generate(input_ids=prompts[0], sampling_params={**sp, "max_new_tokens": 1})
        engine.flush_cache()

        async def one(ids):
            stream = await engine.async_generate(input_ids=ids, sampling_params=sp, stream=True)
            last = None
            async for chunk in stream:
                last = chunk
            return last

        async def all_at_once():
            # one streaming call per request, as the HTTP clients do (not one pre-batched call)
            return await asyncio.gather(*(one(ids) for ids in prompts))

        start = time.perf_counter()
        outs = asyncio.run(all_at_once())
        duration = time.perf_counter() - start
    finally:
        engine.shutdown()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return len(outs) / duration, tokens / duration


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the bundled model")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rates", default="2,8,32", help="requests/s, comma separated")
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip-engine", action="store_true", help="skip the in-process comparison")
    p.add_argument("--json", default=None, help="also write the results to this file")
    a = p.parse_args()

    from loom.runtime.server.runtime_client import Runtime

    server_args: dict = {"model_path": a.model_path}
    if a.max_total_tokens:
        server_args["max_total_tokens"] = a.max_total_tokens
    rates = [float(r) for r in a.request_rates.split(",")]
    rows = []
    with Runtime(**server_args) as rt:
        import requests

        info = requests.get(rt.url + "/model_info").json()
        prompts = make_prompts(a.num_prompts, a.input_len, min(info["vocab_size"], 30000), a.seed)
        asyncio.run(run_rate(rt.url, prompts[:4], 2, float("inf"), a.seed))  # warm-up
        for rate in rates + [float("inf")]:
            requests.post(rt.url + "/flush_cache")
            results, duration = asyncio.run(run_rate(rt.url, prompts, a.output_len, rate, a.seed))
            label = "saturation" if rate == float("inf") else f"{rate:g} req/s"
            rows.append(summarize(label, results, duration))
    print(f"\nmodel {a.model_path or 'bundled'}; {a.num_prompts} prompts, input <= {a.input_len}, "
          f"output {a.output_len} tokens (ignore_eos)")  # fmt: skip
    print_table(rows)
    report = {"config": vars(a), "server": rows}
    if not a.skip_engine:
        req_s, tok_s = engine_saturation(server_args, prompts, a.output_len)
        server = rows[-1]
        report["engine"] = {"req_per_s": req_s, "out_tok_per_s": tok_s}
        print(f"\nin-process Engine at saturation: {req_s:.2f} req/s, {tok_s:.1f} out tok/s")
        print(
            f"server / engine: {server['req_per_s'] / req_s:.2f}x requests, "
            f"{server['out_tok_per_s'] / tok_s:.2f}x output tokens"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
