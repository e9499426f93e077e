"""The protocol every speculative-decoding benchmark follows (bench_spec, bench_specbench).

1. **Warm-ups from another source.** A scheduler (or Engine) is warmed on prompts that are not
   the timed ones and come from a different generator; after the warm-up, `leak_share` counts
   the timed outputs' 8-grams that occur in the warm-up outputs, the share is printed, and the
   run fails above `LEAK_MAX`. (Audit, issue 33: bench_spec's old warm-up jobs produced the
   timed jobs' answers, 74% of timed chat 4-grams, and the n-gram drafter's steps halved.)
2. **Every timed prompt is seen once per scheduler**: `check_distinct` refuses a job list with
   a prompt twice; repeats run on fresh schedulers.
3. **Outputs compared token by token** on / off (`compare_outputs`): a greedy run with drafts
   must emit exactly speculation-off's tokens, on every timed prompt; any difference fails.
4. **Two clocks**: the scheduler driven in this process (`run_scheduler`, no IPC) and an
   `Engine` (`run_engine`: tokenizer manager, scheduler and detokenizer processes, what a user
   of the Python API waits for).
5. **Cold and steady state**: a cold pair times the jobs on fresh schedulers with no warm-up
   (empty trie, nothing compiled); steady pairs time them after the warm-up.
6. **Gated rows labelled**: `gate_label` names rows whose batch reaches
   `--speculative-disable-by-batch-size` (drafting switched off while that many decode).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

NGRAM = 8
LEAK_MAX = 0.05  # a timed output's 8-grams found in the warm-up outputs: at most 5%


def ngrams(ids: Sequence[int], n: int = NGRAM) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def leak_share(timed: list[list[int]], warm: list[list[int]], n: int = NGRAM):
    """(share, hits, total): of all n-grams of the timed outputs (counted per output, with
    repeats), those that occur anywhere in the warm-up outputs."""
    seen: set[tuple[int, ...]] = set()
    for ids in warm:
        seen |= ngrams(ids, n)
    hits = total = 0
    for ids in timed:
        for i in range(len(ids) - n + 1):
            total += 1
            hits += tuple(ids[i : i + n]) in seen
    return (hits / total if total else 0.0), hits, total


def check_leak(timed: list[list[int]], warm: list[list[int]], what: str) -> str:
    """The printed leakage line; raises SystemExit above LEAK_MAX."""
    share, hits, total = leak_share(timed, warm)
    line = (
        f"{what}: warm-up leakage {share:.1%} of timed output {NGRAM}-grams "
        f"({hits}/{total}) occur in the warm-up outputs (limit {LEAK_MAX:.0%})"
    )
    if share > LEAK_MAX:
        raise SystemExit(line + ": FAILED, the warm-up teaches the timed answers")
    return line


def check_distinct(prompts: Sequence) -> None:
    dup = len(prompts) - len({repr(p) for p in prompts})
    if dup:
        raise SystemExit(f"timed jobs: {dup} prompt(s) appear twice; each must be seen once")


def compare_outputs(off: dict[str, list[int]], on: dict[str, list[int]], what: str) -> None:
    """Greedy outputs must be identical token by token; raises SystemExit naming the first
    request that differs and where."""
    if off.keys() != on.keys():
        raise SystemExit(f"{what}: on/off answered different requests")
    for rid in off:
        a, b = off[rid], on[rid]
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise SystemExit(
                f"{what}: request {rid} differs from speculation off at output token {at} "
                f"(off {a[at : at + 6]}, on {b[at : at + 6]}; lengths {len(a)} / {len(b)})"
            )


def run_scheduler(sched, jobs, batch: int, rid_prefix: str = "r"):
    """Drive an in-process Scheduler through `jobs` [(token ids, sampling params dict)],
    `batch` requests submitted at a time (the next group when the scheduler is idle).
    Returns (outputs {rid: ids}, wall seconds, CPU seconds, forward seconds, steps)."""
    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params

    outs: dict[str, list[int]] = {}
    steps0 = sched.stats["steps"]
    model_seconds = 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for start in range(0, len(jobs), batch):
        for i, (ids, params) in enumerate(jobs[start : start + batch]):
            rid = f"{rid_prefix}{start + i}"
            outs[rid] = []
            sched.add_request(
                TokenizedGenerateReq(
                    rid=rid,
                    input_ids=list(ids),
                    sampling_params=make_sampling_params({"temperature": 0, **params}),
                    seed=0,
                )
            )
        while not sched.is_idle:
            before = sched.stats["steps"]
            for out in sched.step():
                got = outs[out.rid]
                if out.rewind:  # jump-forward re-tokenised the tail
                    del got[len(got) - out.rewind :]
                got.extend(out.new_ids)
            if sched.stats["steps"] > before:  # the step ran a forward
                model_seconds += sched.runner.last_model_seconds
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return outs, wall, cpu, model_seconds, sched.stats["steps"] - steps0


def run_engine(engine, jobs, batch: int):
    """The same through an Engine: `batch` requests submitted together (one generate call
    with a list). Returns (outputs {index: ids}, wall seconds)."""
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for start in range(0, len(jobs), batch):
        group = jobs[start : start + batch]
        res = engine.generate(
            input_ids=[list(ids) for ids, _ in group],
            sampling_params=[{"temperature": 0, **p} for _, p in group],
        )
        for i, r in enumerate(res):
            outs[f"r{start + i}"] = list(r["output_ids"])
    return outs, time.perf_counter() - t0


def gate_label(batch: int, disable_by: int) -> str:
    """'' or the label of a row whose drafting the batch-size gate switches off."""
    if batch >= disable_by:
        return (
            f" [DRAFTING GATED: --speculative-disable-by-batch-size {disable_by}, no drafts "
            f"while >= {disable_by} requests decode]"
        )
    return ""


def spread(values: list[float]) -> str:
    import statistics

    if not values:
        return "n/a"
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"
