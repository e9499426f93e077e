"""Speculative decoding on a real model with Spec-Bench's prompts, under spec_protocol.py.

    python benchmarks/bench_specbench.py --model DIR --questions question.jsonl \\
        [--per-category 2] [--batches 1,16] [--rounds 2] [--engine-rounds 1] \\
        [--max-new-tokens 128] [--algorithm NGRAM] [--plot docs/img/specbench_smollm2.png]

`--questions`: Spec-Bench's `data/spec_bench/question.jsonl` (github.com/hemingkx/Spec-Bench,
480 prompts, not vendored here: fetch it from there). Its six categories: mt_bench (question ids
1-80, MT-bench's eight kinds), translation, summarization, qa, math_reasoning, rag (80 each).
The subset: `--per-category` prompts per category, evenly spaced through the category in file
order (so mt_bench's pick spans its kinds), first turn only, the model's chat template, greedy.

`--model`: an HF folder (config.json + safetensors), e.g. SmolLM2-135M-Instruct converted by
scripts/convert_gguf_to_hf.py. The protocol (spec_protocol.py): both sides are warmed on
WARMUP (everyday instructions written for this benchmark, not Spec-Bench), the timed outputs'
8-gram share in the warm-up outputs is printed and the run fails above 5%; each timed prompt
is seen once per scheduler (fresh schedulers each round); outputs are compared token by token
on every timed prompt, every round; in-process and Engine wall clocks; a cold pair (no warm-up)
beside the steady ones; rows the batch-size gate switches off are labelled.

Per category (batch 1: its prompts run one after another, timed per category) and overall:
tokens/s on / off, median and range over rounds, tokens per verify step; the acceptance-length
histogram and acceptance by draft position; a plot. Batch B submits B prompts together (the
next B when they finish); at batch >= --speculative-disable-by-batch-size (8) drafting is off
while that many decode. Ratios only: print os.getloadavg() with every row and quote idle runs
(a loaded machine flatters speculative ratios: issue 33 saw 1.25x idle read 1.62x at load 4-5).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec_protocol import (  # noqa: E402
    check_distinct,
    check_leak,
    compare_outputs,
    gate_label,
    run_engine,
    run_scheduler,
    spread,
)

CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
# Warm-up prompts: everyday instructions written for this benchmark (not Spec-Bench, not its
# sources), so a warmed n-gram trie knows the model's style and chat template, not the answers.
WARMUP = [
    "Give me three tips for keeping houseplants alive in winter.",
    "Explain how the gears on a bicycle make pedalling easier.",
    "Write a short poem about a rainy afternoon in a small town.",
    "What should I pack for a two-day hiking trip?",
    "Describe how to make a simple vegetable soup.",
    "Why do cats purr?",
]


def spec_category(row: dict) -> str:
    cat = row["category"]
    return cat if cat in CATEGORIES else "mt_bench"


def load_questions(
    path: Path, per_category: int, categories=CATEGORIES, heldout: bool = False
) -> list[tuple[str, str, int]]:
    """[(category, first-turn text, question id)]: `per_category` evenly spaced rows of each
    of `categories` in file order. `heldout`: the rows half a spacing later instead (none of
    them a timed row of the same `per_category`: drafting choices are made on these)."""
    if not path.is_file():
        raise SystemExit(f"--questions: no such file {path} (Spec-Bench's question.jsonl)")
    by_cat: dict[str, list[dict]] = {c: [] for c in CATEGORIES}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_cat[spec_category(row)].append(row)
    out = []
    for cat in categories:
        rows = by_cat[cat]
        if len(rows) < per_category:
            raise SystemExit(f"--per-category: {cat} has {len(rows)} questions")
        step = len(rows) / per_category
        for k in range(per_category):
            row = rows[int((k + 0.5 * heldout) * step)]
            out.append((cat, row["turns"][0], row["question_id"]))
    return out


def chat_ids(tok, text: str) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
    )


def _ids(x) -> list[int]:
    if isinstance(x, dict) or hasattr(x, "input_ids"):  # BatchEncoding from new transformers
        x = x["input_ids"]
    return list(x)


def server_kwargs(args, spec: bool) -> dict:
    kw = {"dtype": args.dtype, "max_running_requests": max(16, max(args.batch_list)),
          "max_total_tokens": args.max_total_tokens}  # fmt: skip
    if spec:
        kw["speculative_algorithm"] = args.algorithm
        if args.draft:
            kw["speculative_draft_model_path"] = args.draft
        if args.num_draft_tokens:
            kw["speculative_num_draft_tokens"] = args.num_draft_tokens
        kw["speculative_verify_cost"] = args.verify_cost
        for item in args.spec_arg:  # NAME=VALUE, a speculative_* server argument
            name, _, value = item.partition("=")
            if not name.startswith("speculative_"):
                raise SystemExit(f"--spec-arg: {name!r} is not a speculative_* server argument")
            kw[name] = int(value) if value.lstrip("-").isdigit() else value
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.quantized_matmul:
        kw["quantized_matmul"] = args.quantized_matmul
    if args.kv_cache_dtype:
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    return kw


def in_process_round(args, jobs, warm, batch: int, rnd: int, cold: bool):
    """One pair of fresh schedulers: warmed (unless `cold`), then the timed jobs, category by
    category at batch 1, all together at a larger batch. Returns (seconds {side: {cat: s}},
    outputs {side: {question id: ids}}, warm-up outputs {side: {rid: ids}}, the on scheduler's
    state)."""
    from loom.runtime.process import freeze_startup_heap
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    scheds = {
        side: Scheduler(ServerArgs(model_path=args.model, **server_kwargs(args, side == "on")))
        for side in ("off", "on")
    }
    warm_out = {}
    try:
        if not cold:
            for side, s in scheds.items():
                warm_out[side] = run_scheduler(s, warm, len(warm), "w")[0]
            compare_outputs(warm_out["off"], warm_out["on"], "warm-up")
        freeze_startup_heap()
        secs = {side: {} for side in scheds}
        # the process's CPU seconds a side (one torch thread: what the steps cost this process,
        # less moved by other jobs on a shared machine than the wall clock)
        secs["cpu"] = dict.fromkeys(scheds, 0.0)
        outs = {side: {} for side in scheds}
        for side, cat, group in interleaved(job_groups(jobs, batch), rnd):
            s = scheds[side]
            got, wall, cpu, _, _ = run_scheduler(
                s, [(ids, p) for _, ids, p, _ in group], batch, f"{cat}-"
            )
            secs[side][cat] = wall
            secs["cpu"][side] += cpu
            for (_, _, _, qid), ids in zip(group, got.values()):  # submission order
                outs[side][qid] = ids
        state = scheds["on"].get_state()
    finally:
        for s in scheds.values():
            s.close()
        gc.unfreeze()
    return secs, outs, warm_out, state


def interleaved(groups: list[tuple[str, list]], rnd: int):
    """(side, category, jobs) in timing order: the two sides take turns per category, the
    side that goes first alternating by category and by round, so a change in the machine
    during a round (another job starting, a slow first minute) weighs on both sides alike.
    (Session 18 timed all of one side, then all of the other: its one quiet f32 round read
    the in-process off side at 81.0 s against 58.5 in the Engine, a 1.80x ratio where the
    Engine and the CPU-time ratio read 1.27x; docs/benchmarks.md, session 19.)"""
    for i, (cat, group) in enumerate(groups):
        for side in ("on", "off") if (rnd + i) % 2 else ("off", "on"):
            yield side, cat, group


def job_groups(jobs, batch: int) -> list[tuple[str, list]]:
    """The timed jobs as (category, jobs) in CATEGORIES order at batch 1 (a figure a category),
    else one group "all" (a batch mixes categories)."""
    if batch != 1:
        return [("all", jobs)]
    return [(c, [j for j in jobs if j[0] == c]) for c in CATEGORIES if any(j[0] == c for j in jobs)]


def engine_round(args, jobs, warm, batch: int, rnd: int):
    """Fresh Engines a side, warmed, the timed jobs (by category at batch 1): wall seconds
    {side: {cat: s}} and outputs {side: {qid: ids}}."""
    from loom.runtime.engine import Engine

    engines = {
        side: Engine(args.model, **server_kwargs(args, side == "on")) for side in ("off", "on")
    }
    try:
        for e in engines.values():
            run_engine(e, warm, len(warm))
        secs = {side: {} for side in engines}
        outs = {side: {} for side in engines}
        for side, cat, group in interleaved(job_groups(jobs, batch), rnd):
            got, wall = run_engine(engines[side], [(ids, p) for _, ids, p, _ in group], batch)
            secs[side][cat] = wall
            for (_, _, _, qid), ids in zip(group, got.values()):
                outs[side][qid] = ids
    finally:
        for e in engines.values():
            e.shutdown()
    return secs, outs


def ratios_by_cat(rounds: list[dict]) -> dict[str, list[float]]:
    """{cat or 'overall': [off / on wall seconds per round]}."""
    out: dict[str, list[float]] = {}
    for secs in rounds:
        for cat in secs["off"]:
            out.setdefault(cat, []).append(secs["off"][cat] / secs["on"][cat])
        if len(secs["off"]) > 1:
            out.setdefault("overall", []).append(
                sum(secs["off"].values()) / sum(secs["on"].values())
            )
    return out


def main() -> None:
    if "--merge-json" in sys.argv:  # python bench_specbench.py --merge-json A,B [--plot P]
        mp = argparse.ArgumentParser(description="join runs over disjoint --categories")
        mp.add_argument("--merge-json", required=True, help="A.json,B.json (same rounds)")
        mp.add_argument("--plot", default=None)
        margs = mp.parse_args()
        return merge(margs.merge_json.split(","), margs.plot)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="target model folder (HF layout)")
    ap.add_argument("--questions", required=True, type=Path, help="Spec-Bench question.jsonl")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument(
        "--categories",
        default=",".join(CATEGORIES),
        help="a subset of the six (split a run over processes; --merge-json joins them)",
    )
    ap.add_argument("--rounds", type=int, default=2, help="in-process rounds (steady state)")
    ap.add_argument("--engine-rounds", type=int, default=1, help="Engine rounds; 0: none")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold (no warm-up) pair")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=64, help="max new tokens a warm-up")
    ap.add_argument("--algorithm", default="NGRAM", help="NGRAM, EAGLE, EAGLE3, MEDUSA")
    ap.add_argument("--draft", default=None, help="--speculative-draft-model-path (heads)")
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-total-tokens", type=int, default=16384,
                    help="KV cache tokens a side (the default pool, 2 GiB a scheduler for "
                         "SmolLM2, got runs OOM-killed on a shared machine)")  # fmt: skip
    ap.add_argument("--quantization", default=None, help="--quantization of both sides (gguf)")
    ap.add_argument("--quantized-matmul", default=None,
                    help="--quantized-matmul of both sides (batch-invariant: greedy spec == plain)")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="--kv-cache-dtype of both sides (bf16: the bfloat16 pool)")  # fmt: skip
    ap.add_argument("--verify-cost", default="auto", help="--speculative-verify-cost")
    ap.add_argument("--spec-arg", action="append", default=[],
                    help="NAME=VALUE: a speculative_* server argument of the on side")  # fmt: skip
    ap.add_argument("--heldout", action="store_true",
                    help="the held-out rows (tuning), not the timed ones (load_questions)")  # fmt: skip
    ap.add_argument("--label", default=None, help="the model's name in the output")
    ap.add_argument("--plot", default=None, help="write the plot here (png)")
    ap.add_argument("--json-out", default=None, help="write the figures here")
    args = ap.parse_args()
    args.batch_list = [int(b) for b in args.batches.split(",")]
    if args.per_category < 1 or args.rounds < 1:
        ap.error("--per-category and --rounds must be >= 1")
    if not (Path(args.model, "config.json").is_file() or args.model.endswith(".gguf")):
        ap.error(f"--model: {args.model} is neither a folder with config.json nor a .gguf")

    import torch

    from loom.runtime.server_args import ServerArgs
    from loom.runtime.tokenizer import load_tokenizer

    torch.set_num_threads(ServerArgs().effective_cpu_threads)
    tok = load_tokenizer(args.model)
    label = args.label or Path(args.model).name
    params = {"max_new_tokens": args.max_new_tokens}
    cats = tuple(args.categories.split(","))
    if not set(cats) <= set(CATEGORIES):
        ap.error(f"--categories: each must be one of {CATEGORIES}")
    qs = load_questions(args.questions, args.per_category, cats, args.heldout)
    jobs = [(cat, _ids(chat_ids(tok, text)), params, qid) for cat, text, qid in qs]
    warm = [(_ids(chat_ids(tok, t)), {"max_new_tokens": args.warmup_tokens}) for t in WARMUP]
    check_distinct([tuple(ids) for _, ids, _, _ in jobs])
    disable_by = ServerArgs().speculative_disable_by_batch_size
    print(
        f"bench_specbench: {label} ({args.dtype}, {args.quantization or 'unquantized'}"
        f"{', quantized matmul ' + args.quantized_matmul if args.quantized_matmul else ''}"
        f"{', KV pool ' + args.kv_cache_dtype if args.kv_cache_dtype else ''}), "
        f"{args.algorithm} {' '.join(args.spec_arg)} verify cost {args.verify_cost}, "
        f"{len(jobs)} Spec-Bench {'held-out ' if args.heldout else ''}"
        f"prompts ({args.per_category} per category), max {args.max_new_tokens} new tokens, "
        f"greedy, torch threads {torch.get_num_threads()}, loadavg {os.getloadavg()}",
        flush=True,
    )
    figures: dict = {"label": label, "algorithm": args.algorithm, "rows": {}}
    for batch in args.batch_list:
        groups = [min(batch, len(jobs) - i) for i in range(0, len(jobs), batch)]
        what = f"{label} {args.algorithm} batch {batch}"
        if batch > 1:  # what ran at once: the prompts go in groups of `batch`
            what += f" (groups of {'+'.join(map(str, groups))} prompts)"
        gate = gate_label(batch, disable_by)
        steady, engine, cold = [], [], []
        leak = ""
        state = {}
        t0 = time.time()
        if not args.no_cold:
            secs, outs, _, _ = in_process_round(args, jobs, warm, batch, 0, cold=True)
            compare_outputs(outs["off"], outs["on"], what + " (cold)")
            cold.append(secs)
        for rnd in range(args.rounds):
            secs, outs, warm_out, state = in_process_round(args, jobs, warm, batch, rnd, False)
            compare_outputs(outs["off"], outs["on"], what)
            if not leak:
                leak = check_leak(list(outs["off"].values()), list(warm_out["off"].values()), what)
                print(leak, flush=True)
            steady.append(secs)
            print(
                f"  round {rnd}: in-process overall "
                f"{sum(secs['off'].values()) / sum(secs['on'].values()):.2f}x (CPU time "
                f"{secs['cpu']['off'] / secs['cpu']['on']:.2f}x), loadavg "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
        for rnd in range(args.engine_rounds):
            secs, outs = engine_round(args, jobs, warm, batch, rnd)
            compare_outputs(outs["off"], outs["on"], what + " (Engine)")
            engine.append(secs)
        r_steady, r_engine, r_cold = (ratios_by_cat(x) for x in (steady, engine, cold))
        r_cpu = [r["cpu"]["off"] / r["cpu"]["on"] for r in steady]
        verify = state.get("spec_verify_ct", 0)
        hist = state.get("spec_accept_len_hist", [])
        by_pos = [
            a / p if p else 0.0
            for a, p in zip(
                state.get("spec_accepted_by_position", []),
                state.get("spec_proposed_by_position", []),
            )
        ]
        n_tokens = sum(len(v) for v in outs["off"].values())
        key = "overall" if batch == 1 else "all"
        print(
            f"{what}{gate}: tokens/s on/off in-process {spread(r_steady.get(key, []))} "
            f"(CPU time {spread(r_cpu)}), "
            f"Engine {spread(r_engine.get(key, []))}, cold {spread(r_cold.get(key, []))} | "
            f"outputs identical token by token on {len(jobs)} prompts x "
            f"{len(steady) + len(engine) + len(cold)} runs | {n_tokens} tokens a side, "
            f"{state.get('spec_accept_length', 0.0):.2f} tokens/verify over {verify} "
            f"verifies | acceptance by position [{' '.join(f'{r:.2f}' for r in by_pos)}] | "
            f"{time.time() - t0:.0f} s, loadavg {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        if batch == 1:
            for cat in CATEGORIES:
                print(
                    f"  {cat:15s} in-process {spread(r_steady.get(cat, []))}, Engine "
                    f"{spread(r_engine.get(cat, []))}",
                    flush=True,
                )
        print(
            f"  accept-length histogram (verify steps by draft tokens accepted: 0, 1, ...) {hist}",
            flush=True,
        )
        figures["rows"][str(batch)] = {
            "in_process": r_steady,
            "in_process_cpu": r_cpu,
            "engine": r_engine,
            "cold": r_cold,
            "accept_length": state.get("spec_accept_length", 0.0),
            "accept_len_hist": hist,
            "accept_by_position": by_pos,
            "leak": leak,
            "loadavg": os.getloadavg(),
            "secs": {"in_process": steady, "engine": engine, "cold": cold},
        }
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=1))
    if args.plot:
        plot(figures, Path(args.plot))


def merge(paths: list[str], plot_path: str | None) -> None:
    """Join runs over disjoint categories: per-round seconds are summed across the runs (the
    runs' rounds pair by index), the overall ratio recomputed from them."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    out = {"label": parts[0]["label"], "algorithm": parts[0]["algorithm"], "rows": {}}
    for batch in parts[0]["rows"]:
        rows = [p["rows"][batch] for p in parts]
        merged = {"accept_len_hist": [], "accept_by_position": []}
        for key in ("in_process", "engine", "cold"):
            n = min(len(r["secs"][key]) for r in rows)
            secs = [
                {side: {c: v for r in rows for c, v in r["secs"][key][i][side].items()}
                 for side in ("off", "on")}
                for i in range(n)
            ]  # fmt: skip
            merged[key] = ratios_by_cat(secs)
        hists = [r["accept_len_hist"] for r in rows]
        merged["accept_len_hist"] = [sum(h) for h in zip(*hists)]
        merged["loadavg"] = [r["loadavg"] for r in rows]
        out["rows"][batch] = merged
        key = "overall" if batch == "1" else "all"
        print(
            f"{out['label']} {out['algorithm']} batch {batch} (merged {len(parts)} runs): "
            f"in-process {spread(merged['in_process'].get(key, []))}, Engine "
            f"{spread(merged['engine'].get(key, []))}"
        )
        for cat in CATEGORIES:
            print(
                f"  {cat:15s} in-process {spread(merged['in_process'].get(cat, []))}, Engine "
                f"{spread(merged['engine'].get(cat, []))}"
            )
        print(f"  accept-length histogram {merged['accept_len_hist']}")
    if plot_path:
        plot(out, Path(plot_path))


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    row = figures["rows"].get("1")
    if row:
        cats = [*CATEGORIES, "overall"]
        x = range(len(cats))
        for off, (name, key) in zip((-0.2, 0.2), (("in-process", "in_process"), ("Engine", "engine"))):  # fmt: skip
            vals = [statistics.median(row[key][c]) if row[key].get(c) else 0 for c in cats]
            ax1.bar([i + off for i in x], vals, width=0.4, label=name)
        ax1.axhline(1.0, color="grey", lw=0.8)
        ax1.set_xticks(list(x), cats, rotation=30, ha="right", fontsize=8)
        ax1.set_ylabel("tokens/s on / off (batch 1)")
        ax1.legend(fontsize=8)
    for batch, row in figures["rows"].items():
        hist = row["accept_len_hist"]
        total = sum(hist) or 1
        ax2.plot(range(len(hist)), [h / total for h in hist], marker="o", label=f"batch {batch}")
    ax2.set_xlabel("draft tokens accepted per verify step")
    ax2.set_ylabel("share of verify steps")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{figures['label']}, {figures['algorithm']}, Spec-Bench subset", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
