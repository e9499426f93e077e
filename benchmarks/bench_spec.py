"""Speculative decoding against plain decoding on the BUNDLED model, under the protocol in
spec_protocol.py (warm-ups from another source with a printed, enforced 8-gram leakage limit;
each timed prompt once per scheduler; outputs compared token by token; in-process and Engine
clocks; cold beside steady state; gated rows labelled).

What these rows are: the workloads are the bundled 3.9M-parameter model's own training
distribution (scripts/bundled/), 16 distinct prompts each, greedy, chat template:
  bundled-json     extraction with a JSON schema (keys and punctuation arrive as forced drafts)
  bundled-fewshot  a few-shot block of capital Q/A lines and one more question (was "copy";
                   its answer is a memorised training line, not a copy of the prompt)
  bundled-chat     stories, greetings, weather questions (the toy model's stories repeat each
                   other: later timed prompts are drafted from earlier timed outputs, which is
                   real steady-state serving of such traffic, and says little about real text)
Real-model figures: benchmarks/bench_specbench.py (SmolLM2 on Spec-Bench).

Each runs at batch 1 (requests one after another) and batch 16 (all at once; at the default
--speculative-disable-by-batch-size 8 the on side does not draft while >= 8 decode: the row is
labelled DRAFTING GATED), speculation off (the default runtime: jump-forward on) and on. A
round: a cold pair (fresh schedulers, no warm-up, the jobs once), then steady pairs (fresh
schedulers warmed on WARMUP, arithmetic and currency questions, then the jobs) repeated until
the off side ran --min-seconds; the side that runs first alternates. The ratio is tokens/s on /
off per round, median and range, wall and process CPU time; then --engine-rounds rounds through
`Engine` (fresh warmed Engines a side, wall clock). Prints accepted tokens per verify and
acceptance by draft position, and writes docs/img/spec_acceptance.png. Before each repeat's
timed runs the process's objects are frozen out of the garbage collector's sight, as a serving
scheduler's start-up heap is (`process.freeze_startup_heap`).

    python benchmarks/bench_spec.py [--rounds 5] [--no-plot] [--ngram-breadth 4]
        [--algorithms NGRAM,EAGLE,EAGLE3] [--one-process] [--engine-rounds 2]

Each row (algorithm, workload, batch) runs in a fresh process of its own, one after another
(`--one-process`: all in this one): in one process a row's figures depended on how many
schedulers had run before it.

`--algorithms`: one row per algorithm (default NGRAM); a model-based drafter's rows also split
the on side's wall time into target forwards, the head's own work (`spec_draft_seconds`) and
everything else, then the decode (verify) steps alone, prefills aside. The heads shipped with
the bundled model were trained on the same generator as these prompts (issue 33's audit): their
rows are in-distribution figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

import torch
from spec_protocol import (
    check_distinct,
    check_leak,
    compare_outputs,
    gate_label,
    run_engine,
    run_scheduler,
    spread,
)

from loom.runtime.process import freeze_startup_heap
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs

# Timed jobs: 16 distinct prompts per workload (batch 1 runs them one after another, batch 16
# all at once; each prompt is seen once per scheduler). They are the BUNDLED MODEL'S OWN TRAINING
# DISTRIBUTION (scripts/bundled/: extraction, few-shot capital blocks, stories / small talk), so
# these rows say how the drafters behave on text the toy model has memorised, not on real
# traffic; benchmarks/bench_specbench.py measures a real model on Spec-Bench.
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
    ("Karin", 29, "Athens"),
    ("Leo", 57, "Warsaw"),
    ("Mara", 33, "Prague"),
    ("Nils", 48, "Helsinki"),
    ("Olga", 22, "Budapest"),
    ("Pablo", 60, "Amsterdam"),
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
    ("Greece", "Athens"),
    ("Poland", "Warsaw"),
    ("Sweden", "Stockholm"),
    ("Hungary", "Budapest"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
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
    "Write a short story about a shy owl.",
    "Good morning!",
    "What's the weather in Madrid?",
    "Tell me a story about a sleepy turtle.",
    "What is the capital of Japan?",
    "Write a short story about a tiny mouse.",
]
# Warm-up jobs: a different generator from every timed workload (arithmetic and currency
# questions), so that a warmed trie has seen the model's style but not the timed answers
# (spec_protocol.check_leak verifies it on the outputs). The JSON rows also send the timed
# schema once with max_new_tokens 1 (one "{" token: nothing to learn), so its grammar is
# compiled before the clock starts, on both sides.
WARMUP = [
    "What is 17 + 25?",
    "What currency is used in Sweden?",
    "What is 9 times 7?",
    "Which currency do people use in Japan?",
]


def _chat(tok, text: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def workloads(tok) -> dict[str, list[tuple[str, dict]]]:
    """The timed jobs by workload: (prompt text, sampling params)."""
    json_jobs = [
        (
            _chat(tok, f"Extract the name, age and city as JSON: {n} is {a} and lives in {c}."),
            {"max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)},
        )
        for n, a, c in PEOPLE
    ]
    # "fewshot" (called "copy" before issue 33): a few-shot block of capital Q/A lines and one
    # more question. The answer is a memorised training line, not a copy of the prompt (12% of
    # its output 4-grams occur in the prompt): it measures recall of the training corpus.
    fewshot_jobs = []
    for i in range(len(COUNTRIES)):
        shots = (COUNTRIES[i:] + COUNTRIES[:i])[:8]
        text = "".join(
            f"Q: What is the capital of {c}?\nA: The capital of {c} is {cap}.\n"
            for c, cap in shots[:-1]
        )
        fewshot_jobs.append(
            (text + f"Q: What is the capital of {shots[-1][0]}?\nA:", {"max_new_tokens": 96})
        )
    chat_jobs = [(_chat(tok, t), {"max_new_tokens": 96}) for t in CHAT]
    return {"json": json_jobs, "fewshot": fewshot_jobs, "chat": chat_jobs}


def warmups(tok, name: str) -> list[tuple[str, dict]]:
    jobs = [(_chat(tok, t), {"max_new_tokens": 64}) for t in WARMUP]
    if name == "json":
        jobs.append(
            (_chat(tok, WARMUP[0]), {"max_new_tokens": 1, "json_schema": json.dumps(SCHEMA)})
        )
    return jobs


def run_once(sched: Scheduler, jobs, batch: int) -> tuple[dict[str, list[int]], float, float]:
    """(outputs {rid: ids}, wall seconds, CPU seconds) for the jobs (prompt text, params),
    `batch` at a time; the scheduler steps they took and the target model's forward seconds
    are left in `sched.bench_steps` and `sched.bench_model_seconds`."""
    tok = sched.tokenizer
    ids = [(tok.encode(prompt), params) for prompt, params in jobs]
    outs, wall, cpu, model_s, steps = run_scheduler(sched, ids, batch)
    sched.bench_steps, sched.bench_model_seconds = steps, model_s
    return outs, wall, cpu


def decode_totals(sched: Scheduler) -> list[float]:
    """[steps, step seconds, forward seconds] of the scheduler's decode (verify) steps so far,
    prefill steps aside (`Scheduler.decode_timing`, every batch size)."""
    return [sum(e[i] for e in sched.decode_timing.values()) for i in range(3)]


# issue 14's targets for the head drafters' rows: tokens/s on / off by workload at batch 1, and
# at batch 16 (any workload)
TARGETS_B1 = {"chat": 1.8, "json": 2.0}
TARGET_B16 = 0.95


def spec_kwargs(spec: bool, breadth: int = 1, algorithm: str = "NGRAM", eagle=None) -> dict:
    """`eagle`: EAGLE / EAGLE3 shape flags (speculative_num_steps, ...; None = defaults)."""
    extra = {"dtype": "float32"}
    if spec:
        extra["speculative_algorithm"] = algorithm
        if algorithm == "NGRAM":
            extra["speculative_ngram_max_bfs_breadth"] = breadth
        if algorithm in ("EAGLE", "EAGLE3"):
            extra.update({k: v for k, v in (eagle or {}).items() if v is not None})
    return extra


def make(spec: bool, breadth: int = 1, algorithm: str = "NGRAM", eagle=None, **kw) -> Scheduler:
    extra = spec_kwargs(spec, breadth, algorithm, eagle)
    return Scheduler(ServerArgs(model_path=BUNDLED_MODEL_PATH, **extra, **kw))


def engine_figure(args, algo, eagle, tok, warm, jobs, batch, rounds) -> list[float]:
    """Engine wall-clock ratios (off / on), one per round: a fresh Engine a side (its own
    scheduler and detokenizer processes), warmed on the warm-up jobs, then the timed jobs once,
    the side that runs first alternating; outputs compared token by token."""
    from loom.runtime.engine import Engine

    warm_ids = [(tok.encode(p), q) for p, q in warm]
    ids = [(tok.encode(p), q) for p, q in jobs]
    ratios = []
    for rnd in range(rounds):
        engines = {
            side: Engine(
                BUNDLED_MODEL_PATH, **spec_kwargs(side == "on", args.ngram_breadth, algo, eagle)
            )
            for side in ("off", "on")
        }
        try:
            for e in engines.values():
                run_engine(e, warm_ids, len(warm_ids))
            order = ("on", "off") if rnd % 2 else ("off", "on")
            res = {side: run_engine(engines[side], ids, batch) for side in order}
        finally:
            for e in engines.values():
                e.shutdown()
        compare_outputs(res["off"][0], res["on"][0], f"Engine {algo} batch {batch}")
        ratios.append(res["off"][1] / res["on"][1])
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--workloads", default="json,fewshot,chat", help="json, fewshot, chat (bundled model's)"
    )
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
    ap.add_argument(
        "--engine-rounds",
        type=int,
        default=2,
        help="rounds of the Engine wall-clock figure (fresh Engines a side each); 0: none",
    )
    args = ap.parse_args()
    if "copy" in args.workloads.split(","):
        ap.error("--workloads: 'copy' is now 'fewshot' (its answers are recalled, not copied)")
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
        jobs = loads[name]
        warm = warmups(tok, name)
        check_distinct([p for p, _ in jobs])
        gate = gate_label(batch, ServerArgs().speculative_disable_by_batch_size)
        ratios_wall, ratios_cpu, cold, st = [], [], [], {}
        steps = {}
        leak = ""
        what = f"{algo} {name} batch {batch}"
        for rnd in range(args.rounds):
            # cold: fresh schedulers, no warm-up (an empty trie, the grammar compiled inside
            # the timed run), the jobs once a side
            off, on = make(False), make(True, args.ngram_breadth, algo, eagle)
            order = (on, off) if rnd % 2 else (off, on)
            res = {id(s): run_once(s, jobs, batch) for s in order}
            compare_outputs(res[id(off)][0], res[id(on)][0], what + " (cold)")
            cold.append(res[id(off)][1] / res[id(on)][1])
            off.close()
            on.close()
            # steady state: each side runs the jobs `reps` times a round, on fresh schedulers
            # warmed on WARMUP each time (so each timed prompt is seen once per scheduler): at
            # least --min-seconds of the off side's wall time, so one round is not one ~0.3 s
            # sample; same work both sides
            tot = {"w_on": 0.0, "w_off": 0.0, "c_on": 0.0, "c_off": 0.0}
            reps = 0
            while reps == 0 or tot["w_off"] < args.min_seconds:
                off, on = make(False), make(True, args.ngram_breadth, algo, eagle)
                warm_off, _, _ = run_once(off, warm, len(warm))
                warm_on, _, _ = run_once(on, warm, len(warm))
                compare_outputs(warm_off, warm_on, what + " (warm-up)")
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
                    outs_on, w_on, c_on = run_once(on, jobs, batch)
                    outs_off, w_off, c_off = run_once(off, jobs, batch)
                else:
                    outs_off, w_off, c_off = run_once(off, jobs, batch)
                    outs_on, w_on, c_on = run_once(on, jobs, batch)
                compare_outputs(outs_off, outs_on, what)
                if not leak:  # greedy: every repeat's outputs are these
                    leak = check_leak(list(outs_off.values()), list(warm_off.values()), what)
                    print(leak, flush=True)
                n_on = sum(len(v) for v in outs_on.values())
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
        engine = (
            engine_figure(args, algo, eagle, tok, warm, jobs, batch, args.engine_rounds)
            if args.engine_rounds
            else []
        )
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
            f"{'' if algo == 'NGRAM' else algo + ' '}bundled-{name} batch {batch:2d}{gate}: "
            f"tokens/s on/off in-process wall {spread(ratios_wall)}, CPU {spread(ratios_cpu)}, "
            f"cold {spread(cold)}, Engine wall {spread(engine)} | outputs identical token by "
            f"token on {len(jobs)} distinct prompts | {n_on} tokens, "
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
    passed += ["--engine-rounds", str(args.engine_rounds)]
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
