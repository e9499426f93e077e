"""A GGUF Engine on default flags started while an Engine on the torch runner (a speculative
one) runs in the same process: start-up time and each child's peak RSS, by how its torch-free children start.

    fork-own     runtime/process.py: the torch-free preload's own fork server (what loom does)
    fork-torch   the torch runner's fork server (what loom did before session 24: a fork
                 server kept the preload it started with); set_preload made a no-op here
    spawn        a fresh interpreter per child (multiprocessing's spawn), no preload

Per round (--rounds, variants alternating): Engine(...) wall time until ready, one request
(--pp random tokens, --tg new), then the scheduler's and the detokenizer's VmHWM and the sum
of their PSS (/proc/PID/smaps_rollup), and the fork server's own PSS where one started for it.
Every variant's Engine is shut down before the next starts, so fork-own starts its fork server
each round (a second Engine on it while the first runs would fork a warm one).

    python benchmarks/bench_fork_servers.py [--gguf smollm2] [--rounds 3] [--variants ...]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from pathlib import Path


def status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


class _SpawnProcess(mp.context.SpawnProcess):
    preload = "spawn"


def run_variant(variant: str, gguf: str, prompt: list[int], tg: int) -> dict:
    import loom
    from loom.runtime import process

    saved = (process._Process, process.set_preload, list(process._PRELOAD))
    if variant == "fork-torch":  # the running (torch) server's preload, whatever the runner
        process._PRELOAD[:] = ["loom.runtime.preload_torch"]
        process.set_preload = lambda with_torch: None
    elif variant == "spawn":
        process._Process = _SpawnProcess
    try:
        t = time.perf_counter()
        eng = loom.Engine(gguf, max_total_tokens=1024, log_level="warning")
        start = time.perf_counter() - t
    finally:
        process._Process, process.set_preload, process._PRELOAD[:] = saved
    try:
        params = {"max_new_tokens": tg, "temperature": 0, "ignore_eos": True}
        eng.generate(input_ids=[prompt], sampling_params=params)
        pids = [p.pid for p in eng._procs]  # the scheduler, the detokenizer
        server = process._servers.get("loom.runtime.preload")
        server_pid = server._forkserver_pid if server is not None and variant == "fork-own" else 0
        return {
            "start": start,
            "hwm": [status_mb(p, "VmHWM") for p in pids],
            "pss": sum(pss_mb(p) for p in pids),
            "server_pss": pss_mb(server_pid) if server_pid else 0.0,
            "torch": [maps_torch(p) for p in pids],
        }
    finally:
        eng.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="fork-own,fork-torch,spawn")
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    a = p.parse_args()
    import loom
    from loom.runtime.gguf.named import resolve_model_name

    gguf = a.gguf if a.gguf.endswith(".gguf") else resolve_model_name(a.gguf)
    variants = a.variants.split(",")
    rng = random.Random(0)
    prompt = [rng.randrange(100, 40000) for _ in range(a.pp)]
    print(f"model {gguf}, rounds {a.rounds}, pp {a.pp}, tg {a.tg}; load {os.getloadavg()}")
    # a speculative Engine needs the torch runner (runtime/runner_choice.py); not
    # LOOM_TORCH_RUNNER=1, which the torch fork server's children would inherit from its
    # environment and then run the torch runner themselves (fork-torch's scheduler would not
    # be a torch-free one)
    torch_engine = loom.Engine(
        gguf, max_total_tokens=1024, speculative_algorithm="ngram", log_level="warning"
    )
    got: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for _ in range(a.rounds):
            for v in variants:
                got[v].append(run_variant(v, gguf, prompt, a.tg))
    finally:
        torch_engine.shutdown()
    for v, rows in got.items():
        starts = [r["start"] for r in rows]
        hwm = [max(r["hwm"]) for r in rows]
        print(
            f"{v:10} start {statistics.median(starts):5.2f} s [{min(starts):.2f}, "
            f"{max(starts):.2f}]  VmHWM scheduler / detokenizer "
            f"{statistics.median(r['hwm'][0] for r in rows):.0f} / "
            f"{statistics.median(r['hwm'][1] for r in rows):.0f} MB (max {max(hwm):.0f})  "
            f"PSS both {statistics.median(r['pss'] for r in rows):.0f} MB, its fork server "
            f"{statistics.median(r['server_pss'] for r in rows):.0f} MB  "
            f"torch mapped {rows[-1]['torch']}"
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
