"""The sampler's numpy path against its torch path (issue 32's port, layer 3): process CPU
time per call of `greedy_rows` (temperature 0) and `sample_verify_trees` (`--sampled`'s
parameters) on the same float32 logits and the same `SamplingInfo.from_reqs` info, the two
paths alternated within every round (the torch path's `SamplingInfo.to` counted in its time,
as the runner pays it). Prints one line per (mode, batch, vocabulary, path): the median and
range over the rounds in microseconds, and the load average.

    python benchmarks/bench_sampler_numpy.py --batch 1,8,32 --vocab 49152,262144
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from loom.runtime import sampler
from loom.runtime.req import Req
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling_params import make_sampling_params

MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.7, "top_p": 0.9, "top_k": 40},
    "temperature": {"temperature": 0.8},
}


def run(path: str, mode: str, logits: np.ndarray, info: SamplingInfo, calls: int) -> float:
    """Seconds of process CPU time per call."""
    t = time.process_time()
    for _ in range(calls):
        x = logits.copy()
        if path == "torch":
            x = torch.from_numpy(x)
        if mode == "greedy":
            sampler.greedy_rows(x, info)
        else:
            sampler.sample_verify_trees(x, info)
    return (time.process_time() - t) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--vocab", default="49152,262144", help="comma-separated vocabulary sizes")
    ap.add_argument("--modes", default="greedy,sampled,temperature", help="of " + ",".join(MODES))
    ap.add_argument("--rounds", type=int, default=7, help="alternated rounds per figure")
    ap.add_argument("--calls", type=int, default=10, help="calls per round and path")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for mode in args.modes.split(","):
        for vocab in map(int, args.vocab.split(",")):
            for b in map(int, args.batch.split(",")):
                params = make_sampling_params({"max_new_tokens": 64, **MODES[mode]})
                reqs = [Req(f"r{i}", list(range(3, 40)), params, i) for i in range(b)]
                info = SamplingInfo.from_reqs(reqs, vocab)
                rng = np.random.default_rng(0)
                logits = (rng.standard_normal((b, vocab)) * 3).astype(np.float32)
                times = {"numpy": [], "torch": []}
                for path in times:
                    run(path, mode, logits, info, 2)  # warm
                for r in range(args.rounds):
                    for path in ("numpy", "torch") if r % 2 else ("torch", "numpy"):
                        times[path].append(run(path, mode, logits, info, args.calls) * 1e6)
                for path, ts in times.items():
                    print(
                        f"{mode} B={b} V={vocab} {path}: median {statistics.median(ts):.0f} us"
                        f" (range {min(ts):.0f}-{max(ts):.0f}) load {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
