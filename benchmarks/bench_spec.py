"""Speculative decoding (NGRAM) against plain decoding on the bundled model.

Workloads (greedy, chat template): JSON extraction with a schema (forced keys and punctuation
arrive as drafts), free text that copies from its prompt (few-shot fact blocks whose answer
repeats the prompt's sentences), and free chat (stories, greetings, tool traces). Each runs at
batch 1 (requests one after another) and batch 16 (all at once), speculation off (the default
runtime: jump-forward on) and on, in one process, each round on fresh schedulers with the
side that runs first alternating, the jobs repeated (fresh schedulers again) until the off side
ran --min-seconds (2 s: a batch-1 row's jobs take ~0.3 s); the ratio is tokens/s on / off per
round, median and range printed, wall time and process CPU time (the second is steadier on a
shared machine), and the scheduler steps each side took per repeat (the work itself,
independent of the load). Prints accepted tokens per verify and acceptance by
draft position, and writes docs/img/spec_acceptance.png. Before each repeat's timed runs the
process's objects are frozen out of the garbage collector's sight, as a serving scheduler's
start-up heap is (`process.freeze_startup_heap`): unfrozen, a full collection scanned them
all (~0.2 s, several times a row) inside whichever side's timed run it fell.

    python benchmarks/bench_spec.py [--rounds 5] [--no-plot] [--ngram-breadth 4]
        [--algorithms NGRAM,EAGLE,EAGLE3] [--one-process]

Each row (algorithm, workload, batch) runs in a fresh process of its own, one after another
(`--one-process`: all in this one, as before session 11): in one process a row's figures
depended on how many schedulers had run before it.

`--algorithms`: one row per algorithm (default NGRAM); a model-based drafter's rows also split
the on side's wall time into target forwards, the head's own work (`spec_draft_seconds`) and
everything else, then the decode (verify) steps alone, prefills aside: each side's step time,
the on side's as target forward + head + outside, and what an on-side step may cost for issue
14's ratio (1.8x chat / 2.0x JSON at batch 1, 0.95x at batch 16).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.process import freeze_startup_heap
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs

PEOPLE = [
    ("Alice", 31, "Paris"),
    ("Bob", 45, "Berlin"),
    ("Carla", 27, "Madrid"),
    ("Daniel", 52, "Rome"),
    ("Emma", 19, "Vienna"),
    ("Farid", 38, "Cairo"),
    ("Grace", 64, "Tokyo"),
    ("Hugo", 23, "Lisbon"),
    ("Ines", 35, "Dublin"),
    ("Jonas", 41, "Oslo"),
]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
COUNTRIES = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Portugal", "Lisbon"),
    ("Austria", "Vienna"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
]
CHAT = [
    "Write a short story about a brave fox.",
    "Hello!",
    "What's the weather in Tokyo?",
    "Write a short story about a clever cat.",
    "What is the capital of France?",
    "Tell me a story about a lost robot.",
    "What's the weather in Paris?",
    "Hi there!",
    "Write a short story about a kind bear.",
    "What's the weather in Berlin?",
]


def _chat(tok, text: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def workloads(tok) -> dict[str, list[tuple[str, dict]]]:
    json_jobs = [
        (
            _chat(tok, f"Extract the name, age and city as JSON: {n} is {a} and lives in {c}."),
            {"max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)},
        )
        for n, a, c in PEOPLE
    ]
    copy_jobs = []
    for i in range(len(COUNTRIES)):
        shots = (COUNTRIES[i:] + COUNTRIES[:i])[:8]
        text = "".join(
            f"Q: What is the capital of {c}?\nA: The capital of {c} is {cap}.\n"
            for c, cap in shots[:-1]
        )
        copy_jobs.append(
            (text + f"Q: What is the capital of {shots[-1][0]}?\nA:", {"max_new_tokens": 96})
        )
    chat_jobs = [(_chat(tok, t), {"max_new_tokens": 96}) for t in CHAT]
    # the last two of each list warm the schedulers up; the first eight are measured
    return {"json": json_jobs, "copy": copy_jobs, "chat": chat_jobs}


def run_once(sched: Scheduler, jobs, batch: int) -> tuple[int, float, float]:
    """(output tokens, wall seconds, CPU seconds) for the jobs, `batch` at a time; the
    scheduler steps they took and the target model's forward seconds are left in
    `sched.bench_steps` and `sched.bench_model_seconds`."""
    tok = sched.tokenizer
    total = 0
    steps0 = sched.stats["steps"]
    model_seconds = 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for start in range(0, len(jobs), batch):
        group = jobs[start : start + batch]
        for i, (prompt, params) in enumerate(group):
            sched.add_request(
                TokenizedGenerateReq(
                    rid=f"r{start + i}",
                    input_ids=tok.encode(prompt),
                    sampling_params=make_sampling_params({"temperature": 0, **params}),
                    seed=0,
                )
            )
        while not sched.is_idle:
            before = sched.stats["steps"]
            for out in sched.step():
                total += len(out.new_ids)
            if sched.stats["steps"] > before:  # the step ran a forward
                model_seconds += sched.runner.last_model_seconds
    sched.bench_steps = sched.stats["steps"] - steps0
    sched.bench_model_seconds = model_seconds
    return total, time.perf_counter() - wall0, time.process_time() - cpu0


def decode_totals(sched: Scheduler) -> list[float]:
    """[steps, step seconds, forward seconds] of the scheduler's decode (verify) steps so far,
    prefill steps aside (`Scheduler.decode_timing`, every batch size)."""
    return [sum(e[i] for e in sched.decode_timing.values()) for i in range(3)]


# issue 14's targets for the head drafters' rows: tokens/s on / off by workload at batch 1, and
# at batch 16 (any workload)
TARGETS_B1 = {"chat": 1.8, "json": 2.0}
TARGET_B16 = 0.95


def make(spec: bool, breadth: int = 1, algorithm: str = "NGRAM", eagle=None, **kw) -> Scheduler:
    """`eagle`: EAGLE / EAGLE3 shape flags (speculative_num_steps, ...; None = defaults)."""
    extra = {}
    if spec:
        extra = {"speculative_algorithm": algorithm}
        if algorithm == "NGRAM":
            extra["speculative_ngram_max_bfs_breadth"] = breadth
        if algorithm in ("EAGLE", "EAGLE3"):
            extra.update({k: v for k, v in (eagle or {}).items() if v is not None})
    return Scheduler(ServerArgs(model_path=BUNDLED_MODEL_PATH, dtype="float32", **extra, **kw))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--workloads", default="json,copy,chat")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument(
        "--ngram-breadth", type=int, default=1, help="--speculative-ngram-max-bfs-breadth (trees)"
    )
    ap.add_argument(
        "--algorithms",
        default="NGRAM",
        help="comma-separated: NGRAM, EAGLE, EAGLE3, MEDUSA (one row each)",
    )
    for name in ("steps", "topk", "draft-tokens"):  # EAGLE / EAGLE3 rows: the tree's shape
        ap.add_argument(f"--eagle-{name}", type=int, default=None)
    ap.add_argument("--plot-path", default="docs/img/spec_acceptance.png")
    ap.add_argument(
        "--one-process",
        action="store_true",
        help="run every row in this process (default: each row in a fresh one)",
    )
    ap.add_argument("--curves-json", default=None, help=argparse.SUPPRESS)  # a child's curve
    ap.add_argument(
        "--min-seconds",
        type=float,
        default=2.0,
        help="a round repeats the jobs (fresh schedulers) until the off side ran this long",
    )
    args = ap.parse_args()
    eagle = {
        "speculative_num_steps": args.eagle_steps,
        "speculative_eagle_topk": args.eagle_topk,
        "speculative_num_draft_tokens": args.eagle_draft_tokens,
    }
    torch.set_num_threads(ServerArgs().effective_cpu_threads)
    first = make(False)
    tok = first.tokenizer
    first.close()
    loads = workloads(tok)
    print(
        f"bundled model, torch threads {torch.get_num_threads()}, ngram breadth "
        f"{args.ngram_breadth}, EAGLE {eagle}, loadavg {os.getloadavg()}"
    )
    curves = {}
    rows = [
        (algo.upper(), batch, name)
        for algo in args.algorithms.split(",")
        for batch in [int(b) for b in args.batches.split(",")]
        for name in args.workloads.split(",")
    ]
    if not args.one_process and len(rows) > 1:
        curves = run_isolated(args, rows)
        if not args.no_plot and curves:
            plot(curves, Path(__file__).resolve().parents[1] / args.plot_path)
        return
    for algo, batch, name in rows:
        all_jobs = loads[name]
        warm, base_jobs = all_jobs[-2:], all_jobs[:-2]
        jobs = base_jobs * (2 if batch == 16 else 1)  # 16 at once
        ratios_wall, ratios_cpu, st = [], [], {}
        steps = {}
        for rnd in range(args.rounds):
            # each side runs the jobs `reps` times a round (fresh schedulers each time, so a
            # repeat's trie never holds the same jobs' answers): at least --min-seconds of the
            # off side's wall time, so one round is not one ~0.3 s sample; same work both sides
            tot = {"w_on": 0.0, "w_off": 0.0, "c_on": 0.0, "c_off": 0.0}
            reps = 0
            while reps == 0 or tot["w_off"] < args.min_seconds:
                off, on = make(False), make(True, args.ngram_breadth, algo, eagle)
                run_once(off, warm, 2)  # compiles the grammar, teaches the trie other jobs
                run_once(on, warm, 2)
                # as a serving scheduler does after start-up (process.freeze_startup_heap): the
                # two schedulers' and the process's objects leave the collector's sight, so a
                # full collection (~0.2 s here) does not land in one side's timed run
                freeze_startup_heap()
                draft0 = on.decode.drafter.summary().get("spec_draft_seconds", 0.0)
                levels0 = on.decode.drafter.summary().get("spec_draft_split_seconds", [0.0, 0.0])
                head0 = on.decode.drafter.summary().get("spec_draft_decode_seconds", 0.0)
                dec0 = {"off": decode_totals(off), "on": decode_totals(on)}
                # alternate which side runs first, so a load change within a round does not
                # always favour the same side
                if (rnd + reps) % 2:
                    n_on, w_on, c_on = run_once(on, jobs, batch)
                    n_off, w_off, c_off = run_once(off, jobs, batch)
                else:
                    n_off, w_off, c_off = run_once(off, jobs, batch)
                    n_on, w_on, c_on = run_once(on, jobs, batch)
                assert n_on == n_off, (name, n_on, n_off)
                for k, v in (("w_on", w_on), ("w_off", w_off), ("c_on", c_on), ("c_off", c_off)):
                    tot[k] += v
                reps += 1
                off.close()  # the grammar backend's worker processes (state stays readable)
                on.close()
                gc.unfreeze()  # this repeat's schedulers are collected before the next one
            ratios_wall.append(tot["w_off"] / tot["w_on"])
            ratios_cpu.append(tot["c_off"] / tot["c_on"])
            st = on.get_state()
            steps = {"off": off.bench_steps, "on": on.bench_steps}
            # the on side's wall time (its last repeat): target forwards, the drafter's own
            # device work (a model-based head), everything else
            split = (on.bench_model_seconds, st.get("spec_draft_seconds", 0.0) - draft0, w_on)
            # a compiled EAGLE round's own split: catch-up / draft loop (its num_steps - 1 levels)
            levels = [
                b - a for a, b in zip(levels0, st.get("spec_draft_split_seconds", [0.0, 0.0]))
            ]
            # decode / verify steps only (a prefill's forward and head catch-up aside): the
            # step, its target forward, the head's work after it, the rest
            dec = {k: [b - a for a, b in zip(dec0[k], decode_totals(s))] for k, s in (("off", off), ("on", on))}  # fmt: skip
            head_dec = st.get("spec_draft_decode_seconds", 0.0) - head0
        by_pos = [
            a / p if p else 0.0
            for a, p in zip(st["spec_accepted_by_position"], st["spec_proposed_by_position"])
        ]
        if batch == 1:
            curves[name if algo == "NGRAM" else f"{algo} {name}"] = by_pos
        head = ""
        if algo != "NGRAM":
            per = 1e3 / max(1, steps["on"])  # ms per on-side step
            head = (
                f" | on side: target {split[0]:.2f} s, head {split[1]:.2f} s, "
                f"outside {split[2] - split[0] - split[1]:.2f} s = per step (off "
                f"{w_off * 1e3 / max(1, steps['off']):.2f} ms) target "
                f"{split[0] * per:.2f} ms, head {split[1] * per:.2f} ms, outside "
                f"{(split[2] - split[0] - split[1]) * per:.2f} ms"
            )
            if levels[1] > 0:
                n_levels = on.decode.drafter.steps - 1
                head += (  # the gate's cut may run fewer levels (HeadGate.levels)
                    f" (head: catch-up {levels[0] * per:.2f} ms, draft loop "
                    f"{levels[1] * per:.2f} ms, up to {n_levels} levels)"
                )
            (n_off, s_off, f_off), (n_dec, s_dec, f_dec) = dec["off"], dec["on"]
            if n_off and n_dec:
                want = TARGETS_B1.get(name) if batch == 1 else TARGET_B16
                head += (
                    f" | decode steps: off {n_off:.0f} x {s_off / n_off * 1e3:.2f} ms (forward "
                    f"{f_off / n_off * 1e3:.2f}), on {n_dec:.0f} x {s_dec / n_dec * 1e3:.2f} ms = "
                    f"target {f_dec / n_dec * 1e3:.2f} + head {head_dec / n_dec * 1e3:.2f} + "
                    f"outside {(s_dec - f_dec - head_dec) / n_dec * 1e3:.2f}"
                )
                if want:  # what an on-side decode step may cost for the target ratio
                    head += f"; {want}x needs <= {s_off / want / n_dec * 1e3:.2f} ms"
        print(
            f"{'' if algo == 'NGRAM' else algo + ' '}{name:5s} batch {batch:2d}: tokens/s on/off wall {statistics.median(ratios_wall):.2f}x "
            f"[{min(ratios_wall):.2f}-{max(ratios_wall):.2f}], CPU {statistics.median(ratios_cpu):.2f}x "
            f"[{min(ratios_cpu):.2f}-{max(ratios_cpu):.2f}] | {n_on} tokens, "
            f"{st['spec_accept_length']:.2f} tokens/verify over {st['spec_verify_ct']} verifies, "
            f"forced {st.get('spec_forced_accepted', 0)}/{st.get('spec_forced_proposed', 0)}, "
            f"no-draft request-steps {st.get('spec_skipped', 0)}, steps off/on {steps['off']}/{steps['on']} "
            f"(x{reps} a round) "
            f"| acceptance by position "
            f"[{' '.join(f'{r:.2f}' for r in by_pos)}]{head} | loadavg "
            f"{os.getloadavg()[0]:.1f}",
            flush=True,
        )
    if args.curves_json:
        Path(args.curves_json).write_text(json.dumps(curves))
    if not args.no_plot and curves:
        plot(curves, Path(__file__).resolve().parents[1] / args.plot_path)


def run_isolated(args, rows) -> dict[str, list[float]]:
    """Each row in a fresh process (this script, that row alone, the same options), its line
    printed as it ends; returns the rows' acceptance curves. In one process a row's figures
    depended on its place: the same model's decode forward ran 0.40-0.54 ms a step in the
    first schedulers and 0.62-0.79 ms after a dozen (docs/benchmarks.md, session 10), so late
    rows' ratios moved."""
    import subprocess
    import sys
    import tempfile

    curves: dict[str, list[float]] = {}
    passed = ["--rounds", str(args.rounds), "--min-seconds", str(args.min_seconds)]
    passed += ["--ngram-breadth", str(args.ngram_breadth), "--no-plot", "--one-process"]
    for name in ("steps", "topk", "draft_tokens"):
        value = getattr(args, f"eagle_{name}")
        if value is not None:
            passed += [f"--eagle-{name.replace('_', '-')}", str(value)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, (algo, batch, name) in enumerate(rows):
            out = Path(tmp) / f"row{i}.json"
            cmd = [sys.executable, __file__, "--algorithms", algo, "--workloads", name]
            cmd += ["--batches", str(batch), "--curves-json", str(out), *passed]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"row {algo} {name} batch {batch} failed:\n{res.stderr[-3000:]}")
            for line in res.stdout.splitlines()[1:]:  # its header repeats this process's
                print(line, flush=True)
            curves.update(json.loads(out.read_text()))
    return curves


def plot(curves: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, rates in curves.items():
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / proposed")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position (bundled model, batch 1)")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
