"""One batch's prefill step and its decode steps, split: wall and CPU time of the scheduler's
thread, and of that the compiled forward's matmuls and attention (CpuForward.profile); the
wall time of the C forward call itself (ModelRunner.last_model_seconds) and of the rest of the
step (the scheduler's Python, the sampler, output processing).

B requests of --pp random tokens, --tg new tokens each, greedy, in one in-process scheduler on
--threads threads (the radix cache off, the KV pool sized as bench_real's). Prints the prefill
step(s) and the median full-batch decode step, with os.getloadavg(). With --threads > 1 the
CPU columns are the calling thread's only (the OpenMP workers' share is not in them).

    python benchmarks/bench_batch_step.py [--model smollm2] [--quantization gguf] [--batch 32]
        [--pp 128] [--tg 32] [--threads 1] [--attn-avx2 0,1] [--rounds 1]

--attn-avx2 0,1: an A/B of the AVX2 one-token attention (kernels/cpu/attn_avx2.c, the knob
loom_attn_avx2; 0: attn_items' per-token loop, the same bits), the values alternating per
round in the same scheduler.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

# this bench reads the torch runner's CpuForward (its library, knobs, timers): a GGUF model
# would otherwise get the torch-free ArrayRunner (runtime/runner_choice.py)
os.environ.setdefault("LOOM_TORCH_RUNNER", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step_overhead import model_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto", help="loom's --kv-cache-dtype (auto, bf16)")
    p.add_argument("--attn-avx2", default="", help="comma list of loom_attn_avx2 values (A/B)")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the measured batch")
    a = p.parse_args()
    import torch

    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    torch.set_num_threads(a.threads)
    b = a.batch
    sched = Scheduler(
        ServerArgs(
            model_path=model_path(a.model),
            quantization=a.quantization or None,
            cpu_threads=a.threads,
            max_running_requests=b,
            max_total_tokens=b * (a.pp + a.tg) + 64,
            disable_radix_cache=True,
            kv_cache_dtype=a.kv_cache_dtype,
            log_level="warning",
        )
    )
    if sched.runner.cpu_forward is None:
        raise SystemExit("the compiled CPU forward is off for this model")
    prof = sched.runner.cpu_forward.profile = torch.zeros(2, dtype=torch.float64)
    rng = random.Random(0)

    def run(tag: str, tg: int) -> list[tuple[float, ...]]:
        params = make_sampling_params({"max_new_tokens": tg, "temperature": 0, "ignore_eos": True})
        for i in range(b):
            ids = [rng.randrange(100, 40000) for _ in range(a.pp)]
            req = TokenizedGenerateReq(
                rid=f"{tag}{i}", input_ids=ids, sampling_params=params, seed=i, stream=False
            )
            sched.add_request(req)
        rows = []
        while not sched.is_idle:
            running = len(sched.decode.running)  # b before a decode step, fewer before prefill
            p0, t, c = prof.tolist(), time.perf_counter(), time.thread_time()
            sched.step()
            mm, attn = (x - y for x, y in zip(prof.tolist(), p0))
            wall, cpu = time.perf_counter() - t, time.thread_time() - c
            fwd = sched.runner.last_model_seconds
            rows.append((wall, cpu, mm, attn, fwd, running))
        return rows

    import ctypes

    knob = ctypes.c_int.in_dll(sched.runner.cpu_forward.lib, "loom_attn_avx2")
    values = [int(v) for v in a.attn_avx2.split(",")] if a.attn_avx2 else [knob.value]
    run("warm", 2)
    print(
        f"{model_path(a.model)} ({a.quantization}), B {b}, pp {a.pp}, tg {a.tg}, "
        f"threads {a.threads}"
    )
    print(
        "step            wall ms   CPU ms  matmul ms  attention ms  rest ms"
        "  forward wall ms  outside ms  loom_attn_avx2  load"
    )
    for rnd in range(a.rounds):
        for v in values:
            knob.value = v
            rows = run(f"r{rnd}.{v}.", a.tg)
            shown = [("prefill", r) for r in rows if r[5] < b]
            decode = [r for r in rows if r[5] == b]
            if decode:
                med = [statistics.median(x[i] for x in decode) for i in range(5)]
                shown.append(("decode median", med))
            for name, r in shown:
                wall, cpu, mm, attn, fwd = (x * 1e3 for x in r[:5])
                print(
                    f"{name:14} {wall:9.1f} {cpu:8.1f} {mm:10.1f} {attn:13.1f} "
                    f"{cpu - mm - attn:8.1f} {fwd:16.1f} {wall - fwd:11.1f}  {v:14d}"
                    f"  {os.getloadavg()[0]:.1f}"
                )


if __name__ == "__main__":
    main()
