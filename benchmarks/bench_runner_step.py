"""A/B of the scheduler's whole decode step on one GGUF model: the torch-free ArrayRunner
(runtime/array_runner.py) against ModelRunner + CpuForward (the torch runner), both built in
this process with the same flags and driven by their own in-process Scheduler.

Each round submits --batch greedy requests (a --context-token prompt each, --steps new tokens)
to one scheduler, then the other (the order swapped every round), and times the decode steps
by CPU time (time.process_time: every thread of this process; the machine's load does not
inflate it as it does wall time) and by wall time. Prints per round and the medians and ranges,
with the load average.

    python benchmarks/bench_runner_step.py [--gguf smollm2] [--batch 1] [--context 64]
        [--steps 32] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from loom.runtime.array_runner import ArrayRunner
from loom.runtime.gguf.named import resolve_model_name
from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.model_runner import ModelRunner
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs


def _round(sched: Scheduler, a, tag: int) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, decode steps) of one batch's decode."""
    params = {"max_new_tokens": a.steps, "temperature": 0, "ignore_eos": True}
    for i in range(a.batch):
        ids = [1 + (37 * (i + 1) * (j + tag) + j) % 4000 for j in range(a.context)]
        sched.add_request(TokenizedGenerateReq(rid=f"{tag}-{i}", input_ids=ids,
                                               sampling_params=make_sampling_params(params),
                                               seed=0))  # fmt: skip
    sched.step()  # the prefill
    cpu = wall = 0.0
    steps = 0
    while not (sched.is_idle and not sched.pending_outputs):
        c0, w0 = time.process_time(), time.perf_counter()
        sched.step()
        cpu += time.process_time() - c0
        wall += time.perf_counter() - w0
        steps += 1
    sched.flush_cache()
    return cpu, wall, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    path = a.gguf if a.gguf.endswith(".gguf") else resolve_model_name(a.gguf)
    torch.set_num_threads(a.threads)
    args = ServerArgs(model_path=path, max_total_tokens=a.batch * (a.context + a.steps) + 64,
                      cpu_threads=a.threads)  # fmt: skip
    array = ArrayRunner(args)
    scheds = {"torch": Scheduler(args, model_runner=ModelRunner(args)),
              "array": Scheduler(args, model_runner=array)}  # fmt: skip
    print(f"{path}: batch {a.batch}, context {a.context}, {a.steps} steps, {a.threads} thread(s)")
    print(f"load before: {os.getloadavg()}")
    for s in scheds.values():  # warm both
        _round(s, a, 0)
    ms: dict[str, list[tuple[float, float]]] = {k: [] for k in scheds}
    for r in range(a.rounds):
        order = list(scheds) if r % 2 == 0 else list(reversed(scheds))
        for name in order:
            cpu, wall, steps = _round(scheds[name], a, r + 1)
            ms[name].append((1e3 * cpu / steps, 1e3 * wall / steps))
        print(f"round {r}: " + "  ".join(
            f"{k} cpu {ms[k][-1][0]:.3f} wall {ms[k][-1][1]:.3f} ms/step" for k in scheds))  # fmt: skip
    for k, v in ms.items():
        cpu, wall = [x[0] for x in v], [x[1] for x in v]
        print(f"{k}: cpu median {statistics.median(cpu):.3f} ms/step [{min(cpu):.3f}, "
              f"{max(cpu):.3f}], wall median {statistics.median(wall):.3f} [{min(wall):.3f}, "
              f"{max(wall):.3f}]")  # fmt: skip
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
