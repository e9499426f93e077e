"""Where a batch's CPU goes across loom's processes: B requests of --pp random tokens, --tg
new tokens each (greedy), through loom.Engine on --threads scheduler threads; prints the
batch's wall time and each process's CPU (utime + stime from /proc: the owner, where the
tokenizer manager runs, the scheduler, the detokenizer, ...), with os.getloadavg().

    python benchmarks/bench_process_cpu.py [--gguf smollm2] [--threads 1] [--batch 8]
        [--pp 128] [--tg 32] [--idle 5]

--idle S: after the batch, each process's CPU over S seconds with no request (an idle
server's threads must sleep: the OpenMP workers after GOMP_SPINCOUNT, kernels/cpu/pool.c's
helpers after their 20 us spin).

Set GOMP_SPINCOUNT / OMP_WAIT_POLICY in the environment to compare libgomp wait policies
(runtime/process.py, bound_openmp_spin: loom's children get GOMP_SPINCOUNT=1000 otherwise).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def tree_cpu(root: int) -> dict[int, tuple[str, float]]:
    """pid -> (command line, CPU seconds: user + system) for `root` and every process under it
    (psutil, as bench_real.py reads its peers; a process that exits meanwhile is left out)."""
    import psutil

    me = psutil.Process(root)
    out = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.cmdline())[:70], t.user + t.system)
        except psutil.Error:
            continue
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--idle", type=float, default=0.0, help="seconds of idle CPU to measure after")
    a = p.parse_args()
    import loom
    from loom.runtime.process import OPENMP_SPIN_COUNT

    path = a.gguf
    if not path.endswith(".gguf"):
        from loom.runtime.gguf.named import resolve_model_name

        path = resolve_model_name(path)
    b = a.batch
    engine = loom.Engine(
        path,
        quantization="gguf",
        max_running_requests=b,
        max_total_tokens=b * (a.pp + a.tg) + 64,
        random_seed=0,
        cpu_threads=a.threads,
        log_level="warning",
    )
    try:
        engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4})
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 40000) for _ in range(a.pp)] for _ in range(b)]
        policy = {k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        if not any(policy.values()):
            policy = {"GOMP_SPINCOUNT": f"{OPENMP_SPIN_COUNT} (loom's bound)"}
        print(f"{path}: B {b}, pp {a.pp}, tg {a.tg}, threads {a.threads}, {policy}")
        print(f"load {os.getloadavg()}")
        engine.flush_cache()
        before, t = tree_cpu(os.getpid()), time.perf_counter()
        params = {"max_new_tokens": a.tg, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=prompts, sampling_params=params)
        wall, after = time.perf_counter() - t, tree_cpu(os.getpid())
        print(f"batch wall {wall:.2f} s, load {os.getloadavg()}")
        for pid, (cmd, cpu) in after.items():
            used = cpu - before.get(pid, ("", 0.0))[1]
            print(f"  {pid:7} {used * 1e3:8.0f} ms CPU  {cmd}")
        if a.idle > 0:
            before = tree_cpu(os.getpid())
            time.sleep(a.idle)
            after = tree_cpu(os.getpid())
            print(f"idle {a.idle:.1f} s after the batch, load {os.getloadavg()}")
            for pid, (cmd, cpu) in after.items():
                used = cpu - before.get(pid, ("", 0.0))[1]
                print(f"  {pid:7} {used * 1e3:8.0f} ms CPU ({used / a.idle:.1%} of a core)  {cmd}")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
