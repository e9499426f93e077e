"""A request's fixed cost through the Engine: a 2-token prompt, 1 new token (greedy), timed
from `generate` to its return, 30 requests per mode, on the bundled model:

- back to back: each request right after the previous one returned;
- after idle: after 50 ms with nothing to do (every process asleep);
- after flush: right after `flush_cache` (whose own time is printed beside it).

These are what a batch-1 prefill pays beside its forward (bench_engine_room flushes the cache
before each timed run), and what llama-batched-bench's single loop does not.

    python benchmarks/bench_request_latency.py [--requests 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import loom
from loom.runtime.server_args import BUNDLED_MODEL_PATH


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=30)
    args = ap.parse_args()
    print(f"bundled model, 1 thread, loadavg {os.getloadavg()}")
    engine = loom.Engine(BUNDLED_MODEL_PATH, cpu_threads=1, log_level="warning", random_seed=0)
    params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
    try:
        for mode in ("back to back", "after idle", "after flush", "back to back"):
            took, flush = [], []
            for i in range(args.requests):
                if mode == "after idle":
                    time.sleep(0.05)
                if mode == "after flush":
                    t = time.perf_counter()
                    engine.flush_cache()
                    flush.append(time.perf_counter() - t)
                t = time.perf_counter()
                engine.generate(input_ids=[[5 + i, 9 + i]], sampling_params=params)
                took.append(time.perf_counter() - t)
            extra = f", flush_cache itself {statistics.median(flush) * 1e3:.2f} ms" if flush else ""
            print(
                f"{mode:>12}: median {statistics.median(took) * 1e3:.2f} ms, min "
                f"{min(took) * 1e3:.2f} ms a request{extra}"
            )
    finally:
        engine.shutdown()
    print(f"loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()
