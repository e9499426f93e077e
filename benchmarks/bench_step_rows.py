"""CPU time of one batched prefill step, whole against in parts (forward.c's loom_step_rows).

A scheduler in this process (a GGUF model, the C forward, the default bfloat16 pool) takes
B prompts of --pp random tokens in one prefill step; the step runs with loom_step_rows 0
(whole) and --rows (parts), alternating, --rounds times each, the radix cache flushed between.
Printed per step: the process's CPU seconds (time.process_time, one thread: the load of other
processes does not enter it, their cache traffic does), the step's peak resident growth, and
whether the sampled tokens and their logprobs equal the whole step's.

    python benchmarks/bench_step_rows.py [--gguf smollm2] [--batch 32] [--pp 128] [--rows 512]
        [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time
from pathlib import Path

# this bench reads the torch runner's CpuForward (its library, knobs, timers): a GGUF model
# would otherwise get the torch-free ArrayRunner (runtime/runner_choice.py)
os.environ.setdefault("LOOM_TORCH_RUNNER", "1")


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--rows", type=int, default=512, help="loom_step_rows of the parts side")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    from loom.runtime.gguf.named import resolve_model_name
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    path = a.gguf if a.gguf.endswith(".gguf") else resolve_model_name(a.gguf)
    sched = Scheduler(ServerArgs(
        model_path=path, quantization="gguf", max_running_requests=a.batch,
        max_total_tokens=a.batch * (a.pp + 8) + 64, random_seed=0, cpu_threads=1,
        log_level="warning", chunked_prefill_size=a.batch * a.pp,
    ))  # fmt: skip
    knob = ctypes.c_int.in_dll(sched.runner.cpu_forward.lib, "loom_step_rows")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(a.pp)] for _ in range(a.batch)]
    cpu: dict[int, list[float]] = {0: [], a.rows: []}
    ref = None
    for r in range(a.rounds):
        for rows in (0, a.rows) if r % 2 == 0 else (a.rows, 0):
            knob.value = rows
            sched.flush_cache()
            for i, ids in enumerate(prompts):
                params = {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True}
                sched.add_request(TokenizedGenerateReq(
                    rid=f"{r}-{rows}-{i}", input_ids=ids, seed=0, return_logprob=True,
                    sampling_params=make_sampling_params(params),
                ))  # fmt: skip
            Path("/proc/self/clear_refs").write_text("5")
            before = peak_mb()
            t = time.process_time()
            outs = sched.step()
            cpu[rows].append(time.process_time() - t)
            grow = peak_mb() - before
            while not sched.is_idle:
                outs += sched.step()
            got = sorted(
                (o.rid.split("-")[-1], o.new_ids, o.output_token_logprobs)
                for o in outs
                if o.new_ids
            )
            got = [(i, ids, lp) for i, ids, lp in got]
            ref = ref or got
            print(f"round {r} rows {rows:4d}: step CPU {cpu[rows][-1]:.3f} s, peak +{grow:.1f} MB,"
                  f" tokens+logprobs equal to the first whole step: {got == ref},"
                  f" load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    for rows, v in cpu.items():
        print(f"rows {rows}: CPU median {statistics.median(v):.3f} s [{min(v):.3f}, {max(v):.3f}]")
    knob.value = 512


if __name__ == "__main__":
    main()
