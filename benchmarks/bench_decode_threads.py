"""Batch-1 (or batch-B) decode steps on one and on two threads, interleaved step by step in one
process, so that both thread counts see the same load: the compiled forward's wall time per
step (ModelRunner.last_model_seconds) for each --threads value, median / min / quartiles, and
the ratio of the medians.

The C forward reads its thread count per call (torch.get_num_threads()), so one scheduler
serves every value: decode step i runs on the i-th (threads, pool) pair in turn, where --pool
also interleaves kernels/cpu/pool.c (1) against OpenMP's `parallel for` (0). libgomp's spin is the
server's (runtime/process.py bound_openmp_spin: GOMP_SPINCOUNT=1000) unless GOMP_SPINCOUNT or
OMP_WAIT_POLICY is set in the environment. Run it under another tree's venv to A/B that tree
(the script imports loom from the interpreter's install).

--pool-tail 0,1 interleaves pool.c's loom_pool_tail (a loop's last chunks in quarters) and
--spin-ns 20000,200000 its loom_pool_spin_ns (a helper's spin before it sleeps), --bi-avx2 2,3
quant_bi_avx2.c's loom_q_bi_avx2 (its row decoders); the table also gives the process's CPU
time per step (all threads: a helper's spinning counts).

    python benchmarks/bench_decode_threads.py [--model smollm2] [--threads 1,2] [--batch 1]
        [--pp 128] [--steps 400] [--pool 1,0] [--pool-tail 0,1] [--spin-ns 20000] [--bi-avx2 3]
"""

from __future__ import annotations

import argparse
import ctypes
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--threads", default="1,2", help="comma list, interleaved step by step")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--steps", type=int, default=400, help="decode steps in all")
    p.add_argument(
        "--pool",
        default="1",
        help="comma list of loom_pool values interleaved too (1: kernels/cpu/pool.c, 0: OpenMP)",
    )
    p.add_argument("--pool-tail", default="1", help="comma list of loom_pool_tail values (1: the default)")
    p.add_argument("--spin-ns", default="20000", help="comma list of loom_pool_spin_ns values")
    p.add_argument(
        "--bi-avx2", default="", help="comma list of loom_q_bi_avx2 values (AVX2 builds)"
    )
    a = p.parse_args()
    from loom.runtime.process import bound_openmp_spin

    bound_openmp_spin()  # before torch loads libgomp, as the server's processes do
    import torch
    from bench_step_overhead import model_path

    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    counts = [int(v) for v in a.threads.split(",")]
    pools = [int(v) for v in a.pool.split(",")]
    tails = [int(v) for v in a.pool_tail.split(",")]
    spins = [int(v) for v in a.spin_ns.split(",")]
    # (threads, pool, tail, spin) in turn; a tree without pool.c runs pool value 0 only
    decoders = [int(v) for v in a.bi_avx2.split(",")] if a.bi_avx2 else [-1]  # -1: as built
    configs = [
        (c, q, t, sp, d)
        for d in decoders
        for sp in spins
        for t in tails
        for q in pools
        for c in counts
    ]
    b, tg = a.batch, a.steps + 2
    sched = Scheduler(
        ServerArgs(
            model_path=model_path(a.model),
            quantization=a.quantization or None,
            cpu_threads=max(counts),
            max_running_requests=b,
            max_total_tokens=b * (a.pp + tg) + 64,
            disable_radix_cache=True,
            log_level="warning",
        )
    )
    if sched.runner.cpu_forward is None:
        raise SystemExit("the compiled CPU forward is off for this model")
    rng = random.Random(0)
    params = make_sampling_params({"max_new_tokens": tg, "temperature": 0, "ignore_eos": True})
    for i in range(b):
        ids = [rng.randrange(100, 40000) for _ in range(a.pp)]
        sched.add_request(
            TokenizedGenerateReq(
                rid=f"r{i}", input_ids=ids, sampling_params=params, seed=i, stream=False
            )
        )
    load0 = os.getloadavg()
    lib = sched.runner.cpu_forward.lib
    try:
        knob = ctypes.c_int.in_dll(lib, "loom_pool")
    except ValueError:
        knob = None
        configs = [(c, 0, 0, 20000, -1) for c in counts]
    try:
        tail = ctypes.c_int.in_dll(lib, "loom_pool_tail")
        spin = ctypes.c_int64.in_dll(lib, "loom_pool_spin_ns")
    except ValueError:  # a tree before these knobs
        tail = spin = None
        configs = list(dict.fromkeys((c, q, 0, 20000, d) for c, q, _, _, d in configs))
    decoder = ctypes.c_int.in_dll(lib, "loom_q_bi_avx2") if a.bi_avx2 else None
    walls: dict[tuple, list[float]] = {k: [] for k in configs}
    cpus: dict[tuple, list[float]] = {k: [] for k in configs}
    step = 0
    while not sched.is_idle:
        decode = len(sched.decode.running) == b
        cfg = configs[step % len(configs)] if decode else configs[0]
        torch.set_num_threads(cfg[0])
        if knob is not None:
            knob.value = cfg[1]
        if tail is not None:
            tail.value, spin.value = cfg[2], cfg[3]
        if decoder is not None:
            decoder.value = cfg[4]
        c0 = time.process_time()
        sched.step()
        if decode:
            walls[cfg].append(sched.runner.last_model_seconds)
            cpus[cfg].append(time.process_time() - c0)
            step += 1
    print(
        f"{model_path(a.model)} ({a.quantization}), B {b}, pp {a.pp}, {step} decode steps, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')} OMP_WAIT_POLICY="
        f"{os.environ.get('OMP_WAIT_POLICY')}, load before {load0}, after {os.getloadavg()}"
    )
    print(
        "threads pool tail   spin ns bi_avx2  forward ms: median    min    p25    p75  tok/s (median)"
        "  step CPU ms (median)"
    )
    meds = {}
    for k in configs:
        w = sorted(walls[k][2:])  # the first steps of each config warm its threads
        qs = statistics.quantiles(w, n=4)
        meds[k] = statistics.median(w)
        print(
            f"{k[0]:7} {k[1]:4} {k[2]:4} {k[3]:9} {k[4]:7}  {meds[k] * 1e3:17.3f} {w[0] * 1e3:6.3f}"
            f" {qs[0] * 1e3:6.3f} {qs[2] * 1e3:6.3f} {b / meds[k]:8.1f}"
            f"  {statistics.median(cpus[k][2:]) * 1e3:20.3f}"
        )
    base = configs[0]
    for k in configs[1:]:
        print(f"speed of {k} over {base} (medians): {meds[base] / meds[k]:.3f}x")


if __name__ == "__main__":
    main()
