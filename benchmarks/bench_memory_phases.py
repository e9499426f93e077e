"""Where the scheduler's resident memory goes, phase by phase, on a real GGUF model.

Builds loom's scheduler in this process the way the fork server and run_scheduler_process do
(runtime/preload.py's imports, configure_child_process, torch.set_num_threads, Scheduler(args))
and then runs bench_real's workload (a 4-token warm-up request; B prompts of --pp random tokens
prefilled; --tg tokens decoded each), KV pool sized as bench_real sizes it (B x (pp + tg) + 64).
After each phase it prints, from /proc/self: resident now (anonymous / file-backed / shmem,
status's RssAnon / RssFile / RssShmem), and the phase's own peak (VmHWM, reset before the phase
by writing 5 to /proc/self/clear_refs), so a transient shows as peak - resident.

    python benchmarks/bench_memory_phases.py [--gguf smollm2|gemma3-270m|PATH] [--batch 1]
        [--pp 128] [--tg 32] [--threads 1] [--kv-cache-dtype auto] [--tracemalloc N]
        [--grammar-backend-eager]

After the plain workload, two constrained requests (new JSON schemas, 8 tokens): the first
builds the grammar backend (loom's default: built on the first constrained request) unless
--grammar-backend-eager built it inside Scheduler(); their wall times are printed.

--tracemalloc N: also trace Python allocations and print the N largest sites alive at the end
(slows start-up several-fold; resident figures then include tracemalloc's own bookkeeping).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import time
from contextlib import contextmanager
from pathlib import Path

ROWS: list[tuple[str, dict[str, float], float, float]] = []


def status() -> dict[str, float]:
    """VmRSS / VmHWM / RssAnon / RssFile / RssShmem of this process, MB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(val.split()[0]) / 1024
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def heap_free_mb() -> float:
    """Bytes glibc's malloc holds free in its arenas (mallinfo2's fordblks), MB: freed memory
    that stays resident until malloc_trim (NaN where libc is not glibc >= 2.33)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return float("nan")
    fn.restype = _Mallinfo2
    return fn().fordblks / 2**20


def reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:  # not Linux, or not permitted: peaks then run from process start
        return False


_OPEN: list[float] = []  # peaks seen by the enclosing phases' nested ones


@contextmanager
def phase(name: str):
    """Record `name`'s resident memory after it and its peak during it (nested phases reset
    the kernel's peak, so an enclosing phase takes the max of theirs and its own)."""
    reset_peak()
    _OPEN.append(0.0)
    t = time.perf_counter()
    yield
    s = status()
    s["VmHWM"] = max(s["VmHWM"], _OPEN.pop())
    if _OPEN:
        _OPEN[-1] = max(_OPEN[-1], s["VmHWM"])
    ROWS.append((name, s, time.perf_counter() - t, os.getloadavg()[0]))
    name = "  " * len(_OPEN) + name
    print(
        f"{name:38} rss {s['VmRSS']:7.1f}  anon {s['RssAnon']:7.1f}  file {s['RssFile']:6.1f}"
        f"  peak {s['VmHWM']:7.1f}  (+{s['VmHWM'] - s['VmRSS']:6.1f} transient)"
        f"  malloc free {heap_free_mb():6.1f}  {ROWS[-1][2]:6.2f} s",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tracemalloc", type=int, default=0, metavar="N")
    p.add_argument("--grammar-backend-eager", action="store_true",
                   help="build the grammar backend at start-up (else: on the first constrained "
                   "request, the last phases here)")  # fmt: skip
    a = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    if a.tracemalloc:
        import tracemalloc

        tracemalloc.start(8)
    with phase("python"):
        pass
    with phase("import torch"):
        from loom.runtime.process import bound_openmp_spin

        bound_openmp_spin()
        import torch
    with phase("import the fork server's preload"):
        import loom.runtime.preload  # noqa: F401
    path = a.gguf
    if not path.endswith(".gguf"):
        from loom.runtime.gguf.named import resolve_model_name

        path = resolve_model_name(path)
    from loom.runtime import model_runner as mr
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.process import configure_child_process
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler import scheduler as sm
    from loom.runtime.server_args import ServerArgs

    args = ServerArgs(
        model_path=path, quantization="gguf", max_running_requests=a.batch,
        max_total_tokens=a.batch * (a.pp + a.tg) + 64, kv_cache_dtype=a.kv_cache_dtype,
        random_seed=0, cpu_threads=a.threads, log_level="warning",
        grammar_backend_eager=a.grammar_backend_eager,
    )  # fmt: skip
    configure_child_process(args, "scheduler", os.getpid())
    torch.set_num_threads(args.effective_cpu_threads)

    # each start-up phase, as Scheduler / ModelRunner call them (wrapped in place)
    def wrap(owner, attr, name):
        fn = getattr(owner, attr)

        def run(*args, **kw):
            with phase(name):
                return fn(*args, **kw)

        setattr(owner, attr, run)

    wrap(mr, "load_config", "config")
    wrap(mr, "load_model", "weights (load_model)")
    wrap(mr.ModelRunner, "_init_memory", "KV pool (_init_memory)")
    import loom.runtime.cpu_forward as cf

    wrap(cf.CpuForward, "build", "C forward (CpuForward.build)")
    wrap(sm, "_load_tokenizer", "tokenizer")
    wrap(sm, "_make_tree_cache", "radix cache")
    wrap(sm, "StepGrammar", "StepGrammar")
    import loom.grammar.backend as gb
    import loom.runtime.spec.factory as sf

    wrap(sf, "create_drafter", "drafter (none: --speculative-algorithm unset)")
    # the grammar backend builds on a thread while Scheduler() goes on; here the start waits
    # for it, so its memory is its own phase (the order differs, the sum does not)
    start = sm.GrammarQueue.start

    def start_and_wait(self):
        with phase("grammar backend (start + warm-up)"):
            start(self)
            self.wait_ready()

    # (lazily: started by the first constrained request, inside that request's phase)

    sm.GrammarQueue.start = start_and_wait
    wrap(gb.TokenVocabulary, "from_tokenizer", "token vocabulary")
    wrap(gb, "make_engine", "mask engine tables")
    wrap(gb.GrammarBackend, "warm_up", "warm-up compile (forks the translation worker)")
    reset_peak()
    t = time.perf_counter()
    sched = sm.Scheduler(args)
    sched.grammar_queue.wait_ready()
    with phase("rest of Scheduler()"):
        pass
    print(f"  (Scheduler() took {time.perf_counter() - t:.1f} s)")

    def run(prompts, n, extra=None):
        for i, ids in enumerate(prompts):
            sched.add_request(
                TokenizedGenerateReq(
                    rid=f"r{random.random()}-{i}", input_ids=ids, seed=0,
                    sampling_params=make_sampling_params(
                        {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **(extra or {})}
                    ),
                )
            )  # fmt: skip
        while not sched.is_idle:
            sched.step()

    with phase("first request (4 + 4 tokens)"):
        run([[5, 6, 7, 8]], 4)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.pp)] for _ in range(a.batch)]
    sched.flush_cache()
    with phase(f"prefill {a.batch} x {a.pp}"):
        run(prompts, 1)
    sched.flush_cache()
    with phase(f"prefill + decode {a.batch} x {a.tg}"):
        run(prompts, a.tg)
    with phase("again (steady)"):
        sched.flush_cache()
        run(prompts, a.tg)
    # a constrained request after the plain ones (wall time: what a first grammar user waits,
    # the backend's build included unless --grammar-backend-eager built it at start-up)
    for i, what in enumerate(("first", "second")):
        schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
        t = time.perf_counter()
        with phase(f"{what} constrained request (json_schema, 8 tokens)"):
            run([[5, 6, 7, 8]], 8, {"json_schema": json.dumps(schema), "ignore_eos": False})
        print(f"  ({what} constrained request: {1e3 * (time.perf_counter() - t):.0f} ms wall)")
    smaps = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, val = line.partition(":")
        smaps[key] = int(val.split()[0]) / 1024
    print(
        "smaps_rollup (MB): "
        + ", ".join(
            f"{k} {smaps[k]:.1f}"
            for k in ("Rss", "Pss", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty")
        )  # fmt: skip
    )
    maps = {}  # resident MB per mapped file (or [heap] / anon), from smaps
    cur = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        f = line.split()
        if len(f) >= 5 and "-" in f[0] and ":" not in f[0]:
            cur = f[5] if len(f) > 5 else "[anon]"
        elif f and f[0] == "Rss:":
            maps[cur] = maps.get(cur, 0) + int(f[1]) / 1024
    top = sorted(maps.items(), key=lambda kv: -kv[1])[:14]
    print("largest mappings (resident MB): " + ", ".join(f"{Path(k).name} {v:.1f}" for k, v in top))
    print(f"process peak over all phases: {max(r[1]['VmHWM'] for r in ROWS):.1f} MB")
    if a.tracemalloc:
        snap = tracemalloc.take_snapshot()
        total = sum(s.size for s in snap.statistics("filename")) / 2**20
        print(f"tracemalloc: {total:.1f} MB of Python allocations alive; largest sites:")
        for s in snap.statistics("lineno")[: a.tracemalloc]:
            print(f"  {s.size / 2**20:7.1f} MB  {s.traceback[0]}")
    sched.close()
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
