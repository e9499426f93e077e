"""What a verify step costs against a decode step, by batch size and draft length (the table
`runtime/spec/speculator.extra_cost` is fit to).

Bundled model, in-process schedulers, greedy, ~100-token prompts. The off side decodes; the
on side runs a drafter that proposes a fixed token (never accepted, so every step verifies
the same number of drafts and the sequence grows by one token, like the decode side). Per
(batch, drafts): the median process CPU time of 12 whole steps (scheduling, drafting, the
forward, sampling, result processing), rounds alternating over all cells; prints ms and the
ratio to the decode step of the same batch, then the least-squares fit of the cost beyond the
decode step, a + b_ B + c d + e B d (the form of `extra_cost`), beside the model in use.

    python benchmarks/bench_verify_cost.py [--rounds 3] [--batches 1,2,4,6,8] [--drafts 3,7]
        [--model DIR]   # another model folder, e.g. SmolLM2 (the fit is the bundled model's)
        [--quantization gguf] [--write [PATH]]

`--write`: save the fit where a server with `--speculative-verify-cost auto` reads it for
this model and these settings (runtime/spec/cost.py, under ~/.cache/loom/spec_cost), or to
PATH (then `--speculative-verify-cost PATH`). A server measures its own at start-up when
there is none (a shorter measurement than this one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs
from loom.runtime.spec import cost as spec_cost
from loom.runtime.spec.cost import FixedDrafter

# this bench reads the torch runner's CpuForward (its library, knobs, timers): a GGUF model
# would otherwise get the torch-free ArrayRunner (runtime/runner_choice.py)
os.environ.setdefault("LOOM_TORCH_RUNNER", "1")


def step_ms(sched: Scheduler, batch: int, steps: int = 12) -> tuple[float, list[float]]:
    """Median CPU ms of `steps` steps once `batch` requests are decoding, and the medians of
    the C forward's [matmul, attention] CPU ms in them (zeros when the forward runs eager)."""
    tok = sched.tokenizer
    text = "the quick brown fox jumps over the lazy dog " * 10
    params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    for i in range(batch):
        sched.add_request(
            TokenizedGenerateReq(
                rid=f"q{i}",
                input_ids=tok.encode(f"Request {i}: {text}"),
                sampling_params=make_sampling_params(params),
                seed=0,
            )
        )
    while sched.prefill.waiting or sched.prefill.chunked_req is not None:
        sched.step()
    for _ in range(2):
        sched.step()
    fwd = sched.runner.cpu_forward
    prof = torch.zeros(2, dtype=torch.float64)
    if fwd is not None:
        fwd.profile = prof
    times, split = [], []
    for _ in range(steps):
        prof.zero_()
        t = time.process_time()
        sched.step()
        times.append(time.process_time() - t)
        split.append(prof.tolist())
    if fwd is not None:
        fwd.profile = None
    sched.abort("")
    while not sched.is_idle:
        sched.step()
    split_ms = [1000 * statistics.median(x[i] for x in split) for i in (0, 1)]
    return 1000 * statistics.median(times), split_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,2,4,6,8")
    ap.add_argument("--drafts", default="3,7")
    ap.add_argument("--model", default=None, help="a model folder (default: the bundled model)")
    ap.add_argument("--quantization", default=None, help="--quantization of both schedulers")
    ap.add_argument("--write", nargs="?", const="", default=None,
                    help="save the fit (no PATH: the cache `--speculative-verify-cost auto` reads)")  # fmt: skip
    args = ap.parse_args()
    model = args.model or BUNDLED_MODEL_PATH
    torch.set_num_threads(ServerArgs().effective_cpu_threads)
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [int(d) for d in args.drafts.split(",")]
    sargs = ServerArgs(model_path=model, dtype="float32", quantization=args.quantization)
    make = lambda: Scheduler(sargs)  # noqa: E731
    off, on = make(), make()
    name = "bundled model" if args.model is None else args.model
    print(f"{name}, torch threads {torch.get_num_threads()}, loadavg {os.getloadavg()}")
    ms: dict[tuple[int, int], list[float]] = {}
    split: dict[tuple[int, int], list[list[float]]] = {}
    for _ in range(args.rounds):
        for b in batches:
            for d in [0, *drafts]:
                if d:
                    on.set_drafter(FixedDrafter(d))
                step, parts = step_ms(on if d else off, b)
                ms.setdefault((b, d), []).append(step)
                split.setdefault((b, d), []).append(parts)
    for b in batches:
        decode = statistics.median(ms[(b, 0)])
        cells = " | ".join(
            f"{d} drafts {statistics.median(ms[(b, d)]):.2f} ms = "
            f"{statistics.median(ms[(b, d)]) / decode:.2f}x"
            for d in drafts
        )
        print(f"batch {b}: decode {decode:.2f} ms | {cells}")
        parts = " | ".join(
            f"{d} drafts "
            + " / ".join(f"{statistics.median(x[i] for x in split[(b, d)]):.2f}" for i in (0, 1))
            for d in [0, *drafts]
        )
        print(f"  its C forward's matmul / attention CPU ms: {parts}")
    print(f"loadavg {os.getloadavg()}")
    cells = [
        (b, d, statistics.median(ms[(b, d)]) / statistics.median(ms[(b, 0)]) - 1)
        for b in batches
        for d in drafts
    ]
    coef = fit(cells)
    if args.write is not None and coef is not None:
        path = args.write or spec_cost.cache_path(sargs)
        src = f"bench_verify_cost {args.rounds} rounds, loadavg {os.getloadavg()[0]:.1f}"
        # the cells as a table (what a server reads first: `cost.CostTable`), the fit beside
        spec_cost.save(spec_cost.VerifyCost(coef, src, cells), Path(path))
        print(f"wrote {path}")


def fit(cells: list[tuple[int, int, float]]):
    """Least-squares a + b_ B + c d + e B d over (batch, drafts, cost beyond a decode step)
    cells, printed with each cell's fit and `speculator.extra_cost`'s value; the coefficients
    (None: too few cells)."""
    from loom.runtime.spec.speculator import extra_cost

    try:
        coef = spec_cost.fit(cells)
    except ValueError as e:
        print(e)
        return None
    x = [[1.0, b, d, b * d] for b, d, _ in cells]
    terms = zip(coef, ("", " B", " d", " B d"))
    print("fit of the cost beyond a decode step: " + " + ".join(f"{v:.3f}{n}" for v, n in terms))
    for (b, d, c), row in zip(cells, x):
        f = sum(u * v for u, v in zip(row, coef))
        model = extra_cost(b, d)
        print(f"  batch {b}, {d} drafts: measured {c:.2f}, fit {f:.2f}, extra_cost {model:.2f}")
    return coef


if __name__ == "__main__":
    main()
