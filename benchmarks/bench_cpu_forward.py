"""The compiled CPU forward (runtime/cpu_forward.py) against the eager forward, in one process.

Two in-process schedulers on the same model, one thread each: `--cpu-forward auto` (the
default: steps of <= cpu_forward.MAX_TOKENS tokens, prefill included, in one C call) and
`--cpu-forward eager` (the torch modules).
Per batch size B and round, each runs B requests of --pp random prompt tokens generating --tg
tokens (greedy), the two sides alternating (radix cache off, so every round prefills). Figures are CPU time of this thread (so the other
processes' load inflates them less than wall time): the median decode step (whole step:
scheduling, forward, sampling) and its forward alone, per side; the step ratio eager / C is
per round, median and range. The prompts' prefill is timed too (its first step).

    python benchmarks/bench_cpu_forward.py [--model bundled] [--batch-sizes 1,2,4,8]
        [--pp 128] [--tg 32] [--rounds 3] [--c-max-tokens N]

--c-max-tokens raises (or lowers) the C side's step limit (cpu_forward.MAX_TOKENS) for the
run, so a prefill of --pp tokens per request can be timed in C against eager: the crossover
that sets MAX_TOKENS. --pp takes a list (one table row per pp and batch size).

--matmul 1,2,8,64 times the matmuls alone instead (one thread, the bundled model's shapes: the
QKV, gate/up, down and LM-head matrices each on its own, then all 17 of a step in order, 15.7
MB that no longer fit in L2): the row-major dot-product tiles, the packed panels, torch's
F.linear, in GMAC/s (best of 5 rounds of 20 calls, CPU time), and the packed pass in ms.
--isa avx2 times the library built without AVX-512.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from functools import partial
from pathlib import Path

# this bench reads the torch runner's CpuForward (its library, knobs, timers): a GGUF model
# would otherwise get the torch-free ArrayRunner (runtime/runner_choice.py)
os.environ.setdefault("LOOM_TORCH_RUNNER", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

MODES = ("auto", "eager")


def _timed_forward(runner, spent: dict) -> None:
    """Count the CPU time of the model forward, eager or compiled, into spent["forward"]."""
    model_forward = runner.model.forward

    def eager(*a, **kw):
        t = time.thread_time()
        out = model_forward(*a, **kw)
        spent["forward"] += time.thread_time() - t
        return out

    runner.model.forward = eager
    compiled = runner.cpu_forward
    if compiled is not None:

        class Timed:
            covers = compiled.covers

            def __call__(self, batch):
                t = time.thread_time()
                out = compiled(batch)
                spent["forward"] += time.thread_time() - t
                return out

        runner.cpu_forward = Timed()


def run_once(sched, spent: dict, prompts: list[list[int]], tg: int) -> tuple[float, float, float]:
    """(median decode step ms, median decode forward ms, prefill step ms) of one generation."""
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params

    params = make_sampling_params({"max_new_tokens": tg, "temperature": 0, "ignore_eos": True})
    for i, ids in enumerate(prompts):
        sched.add_request(
            TokenizedGenerateReq(rid=f"r{i}", input_ids=ids, sampling_params=params, seed=0)
        )
    steps = []
    while not sched.is_idle:
        spent["forward"] = 0.0
        t = time.thread_time()
        sched.step()
        steps.append((time.thread_time() - t, spent["forward"]))
    decode = steps[-(tg - 1) :]  # the last tg - 1 steps decode the whole batch
    return (
        statistics.median(s for s, _ in decode) * 1e3,
        statistics.median(f for _, f in decode) * 1e3,
        steps[0][0] * 1e3,
    )


def matmul_table(tokens: list[int], isa: str = "native") -> None:
    """GMAC/s of cpu_forward's two matmuls and torch's F.linear on the bundled shapes, each
    matrix on its own (repeated: it stays in L2 / L3), then the whole model's 17 matrices in a
    decode step's order (15.7 MB: what a step streams, out of L2), with ms per pass."""
    import torch
    import torch.nn.functional as F

    from loom.runtime import cpu_forward

    lib = cpu_forward.load(isa)
    print(f"library: {isa} ({lib.loom_isa_bits()}-bit vectors)")
    shapes = {"qkv": (512, 256), "gate/up": (1376, 256), "down": (256, 688), "lm head": (4032, 256)}
    layer = [(512, 256), (256, 256), (1376, 256), (256, 688)]  # qkv, o, gate/up, down
    model = [*layer * 4, (4032, 256)]
    print(
        "| T | matrix (N x K) | dot tiles GMAC/s | packed GMAC/s | torch GMAC/s | packed / torch |"
        " packed ms |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for t in tokens:
        cases = {name: [nk] for name, nk in shapes.items()}
        cases["whole model (17 matrices)"] = model
        for name, mats in cases.items():
            runs: dict[str, list] = {"dot": [], "packed": [], "torch": []}
            keep = []  # the tensors whose pointers the C calls hold
            for n, k in mats:
                x, w = torch.randn(t, k, generator=g), torch.randn(n, k, generator=g)
                wp, y = cpu_forward.pack(w), torch.empty(t, n)
                keep += [x, w, wp, y]
                args = (x.data_ptr(), t, k)
                runs["dot"].append(
                    partial(lib.loom_linear_f32, *args, w.data_ptr(), None, n, y.data_ptr(), 1)
                )
                runs["packed"].append(
                    partial(
                        lib.loom_linear_packed_f32, *args, wp.data_ptr(), None, n, y.data_ptr(), 1
                    )
                )
                runs["torch"].append(partial(F.linear, x, w))
            best = dict.fromkeys(runs, float("inf"))
            for _ in range(5):
                for side, fns in runs.items():
                    t0 = time.thread_time()
                    for _ in range(20):
                        for fn in fns:
                            fn()
                    best[side] = min(best[side], (time.thread_time() - t0) / 20)
            macs = t * sum(n * k for n, k in mats)
            gm = {side: macs / sec / 1e9 for side, sec in best.items()}
            dims = f" ({mats[0][0]} x {mats[0][1]})" if len(mats) == 1 else ""
            print(
                f"| {t} | {name}{dims} | {gm['dot']:.1f} | {gm['packed']:.1f} "
                f"| {gm['torch']:.1f} | {gm['packed'] / gm['torch']:.2f}x "
                f"| {best['packed'] * 1e3:.3f} |",
                flush=True,
            )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled", help=f"one of {common.MODELS}")
    p.add_argument("--batch-sizes", default="1,2,4,8")
    p.add_argument("--pp", default="128", help="prompt tokens, a comma-separated list")
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--c-max-tokens", type=int, default=0, help="the C side's step limit")
    p.add_argument("--matmul", default="", help="token counts: time the matmuls alone")
    p.add_argument("--isa", default="native", help="--matmul's library variant: native or avx2")
    args = p.parse_args(argv)
    if args.matmul:
        import torch

        torch.set_num_threads(1)
        print(common.header("cpu_forward matmuls vs F.linear (bundled shapes, 1 thread)"))
        matmul_table([int(t) for t in args.matmul.split(",")], args.isa)
        return
    pps = [int(x) for x in args.pp.split(",")]
    import torch

    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    torch.set_num_threads(1)
    label, path = common.resolve_model(args.model)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(common.header(f"compiled CPU forward vs eager ({label}, 1 thread)"))
    spent = {"forward": 0.0}
    scheds = {}
    for mode in MODES:
        sched = Scheduler(
            ServerArgs(
                model_path=path,
                cpu_threads=1,
                cpu_forward=mode,
                max_running_requests=max(sizes),
                disable_radix_cache=True,  # every round prefills its prompts again
                log_level="warning",
            )
        )
        if mode == "auto":
            fast = sched.runner.cpu_forward  # before _timed_forward wraps it
        _timed_forward(sched.runner, spent)
        scheds[mode] = sched
    if args.c_max_tokens and fast is not None:
        fast.max_tokens = scheds["auto"].decode.step_token_cap = args.c_max_tokens
    assert fast is not None, "the C forward does not cover this"
    limit = fast.max_tokens
    vocab = scheds["auto"].vocab_size
    for sched in scheds.values():  # warm-up: torch's first GEMMs, the allocator
        run_once(sched, spent, [list(range(10, 10 + max(pps)))] * max(sizes), 4)
    rng = random.Random(0)
    print(f"C forward step limit: {limit} tokens")
    print(
        "| B | pp | load | decode step, C (CPU ms) | its forward | decode step, eager"
        " | its forward | step eager / C | prefill step, C | prefill step, eager |"
        " prefill eager / C |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, pp in [(b, pp) for pp in pps for b in sizes]:
        prompts = [[rng.randrange(10, vocab) for _ in range(pp)] for _ in range(b)]
        res = common.alternate(
            {m: (lambda s=s, p=prompts: run_once(s, spent, p, args.tg)) for m, s in scheds.items()},
            args.rounds,
        )
        c, e = res["auto"], res["eager"]

        def med(xs, k):
            return statistics.median(x[k] for x in xs)

        print(
            f"| {b} | {pp} | {os.getloadavg()[0]:.1f} | {med(c, 0):.2f} | {med(c, 1):.2f} "
            f"| {med(e, 0):.2f} | {med(e, 1):.2f} "
            f"| {common.fmt_ratio([x[0] for x in e], [x[0] for x in c])} "
            f"| {med(c, 2):.1f} | {med(e, 2):.1f} "
            f"| {common.fmt_ratio([x[2] for x in e], [x[2] for x in c])} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
