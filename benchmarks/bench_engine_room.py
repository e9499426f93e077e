"""The CPU engine room: loom's forward against llama.cpp, one thread each, and where loom's
decode step time goes.

For each model and batch size B, B sequences of --pp random prompt tokens generate --tg tokens
each (llama.cpp's llama-batched-bench workload, as bench_offline --batched runs it). The sides
alternate every round: loom as it starts by default (the cpu_paged attention backend, and steps
of up to cpu_forward.MAX_TOKENS tokens, prefill included, through the compiled C forward of
runtime/cpu_forward.py), loom with
--cpu-forward eager (the torch modules, cpu_paged), loom with the torch reference backend
(eager, the per-step gather cpu_paged replaces), and llama-batched-bench with -fa off and
-fa auto (llama.cpp's default), both measured in the same alternation, through
benchmarks/peers/llamacpp.py (which builds llama.cpp once, converts the model to GGUF f32 and
checks greedy tokens match on the settings timed). Ratios are loom / llama.cpp tok/s per
round against whichever -fa setting was faster at that batch size (median tok/s; decode and
prefill each pick their own), median and range, with the load average beside them; the table
names the setting quoted and shows the other.

The split (loom, cpu_paged, in-process scheduler, one thread), in CPU time of the scheduler
thread so that the other processes' load does not inflate it: per full-batch decode step, the
whole step (scheduling, sampling and the forward), the model forward alone, its attention
calls and its matmuls (every F.linear, the LM head included; in the compiled forward its own
CPU-time counters of the same parts); "other" = forward - attention - matmuls: norms, RoPE,
elementwise ops and the Python module calls between them. The same parts are summed over the
prefill's steps. Each row that misses one of #19's targets (decode >= 0.6x at batch 1, >= 1.2x
at 32 and 64, prefill >= 1.0x) gets a "missed:" line with the split that explains it: wall
time per step (or per prefill) on both sides, and the matmuls' rate (GB/s of the f32 weights a
decode step streams; GFLOP/s over the prefill) beside the rate llama.cpp's whole step implies.

    python benchmarks/bench_engine_room.py [--models bundled,qwen0.5b-f32]
        [--batch-sizes 1,8,32,64] [--pp 128] [--tg 32] [--rounds 3] [--threads 1]
        [--sides cpu_paged,eager,torch] [--offline [--num-requests 64]]
        [--kv-cache-dtype auto|bf16] [--json out.json] [--loom-output stream|whole]

--loom-output whole times loom's sweep sides by two unstreamed runs (the batch's prefill with
max_new_tokens 1, then all --tg tokens; decode = the difference) instead of one streamed run:
a streamed token crosses scheduler -> detokenizer -> tokenizer manager -> caller, a cost
llama-batched-bench (a loop with no client) does not have.

--sides picks loom's sides (the eager and torch-backend ones are for comparison only; on the
0.5B-shape model each costs as much as the default side, so its table runs `--sides cpu_paged`).

--offline adds bench_offline's request set (prompts of 10..400 tokens, 8..128 new tokens, all
sent at once): a loom server against llama-server (-fa --offline-fa, default auto), both sent
the requests by the same HTTP client (common.post_all), alternating; llama-server with
llama.cpp's default per-slot KV and with --kv-unified, both rows; --batch-sizes "" skips the
sweep. --kv-cache-dtype bf16 stores every loom side's KV in
bfloat16 (llama-batched-bench keeps its KV in f16: the same bytes per element).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import common  # noqa: E402
from bench_offline import LoomSide  # noqa: E402

# loom's sides: the default ("cpu_paged": steps of <= cpu_forward.MAX_TOKENS tokens through
# the compiled C forward of runtime/cpu_forward.py, the rest eager with the cpu_paged backend),
# the same with --cpu-forward eager (the torch modules), and the torch reference backend (eager)
SIDES = {
    "cpu_paged": {"attention_backend": "cpu_paged"},
    "eager": {"attention_backend": "cpu_paged", "cpu_forward": "eager"},
    "torch": {"attention_backend": "torch"},
}
BACKENDS = tuple(SIDES)


class BackendSide(LoomSide):
    """bench_offline's loom side with one of SIDES' settings."""

    def __init__(
        self, model_path: str, max_running: int, threads: int, backend: str, kv: str = "auto"
    ):
        import loom

        self.engine = loom.Engine(
            model_path,
            max_running_requests=max_running,
            random_seed=0,
            cpu_threads=threads,
            log_level="warning",
            kv_cache_dtype=kv,
            **SIDES[backend],
        )
        self.engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4})


def prompts_for(path: str, b: int, pp: int, seed: int) -> list[list[int]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    special = set(tok.all_special_ids)
    pool = [i for i in range(len(tok)) if i not in special]
    rng = random.Random(seed * 1000 + b)
    return [[rng.choice(pool) for _ in range(pp)] for _ in range(b)]


def step_split(
    path: str, prompts: list[list[int]], tg: int, threads: int, kv: str = "auto"
) -> dict:
    """Median CPU milliseconds (this thread's CPU time, so other processes' load does not
    count) per decode step of the whole batch: step, forward, attention, matmuls (F.linear),
    other (= forward - attention - matmuls); the same parts summed over the prefill (every
    extend step: prefill_ms, prefill_forward_ms, ...); and the matmul weights' float32 bytes
    (weight_mb: what a decode step streams, LM head included) and parameters, so that the
    matmul times convert to GB/s (decode) and GFLOP/s (prefill)."""
    import torch
    import torch.nn.functional as F

    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.layers.linear import LinearBase
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs

    args = ServerArgs(
        model_path=path,
        cpu_threads=threads,
        max_running_requests=len(prompts),
        attention_backend="cpu_paged",
        kv_cache_dtype=kv,
    )
    torch.set_num_threads(threads)  # as the scheduler process does (scheduler/loop.py)
    sched = Scheduler(args)
    runner = sched.runner
    model, backend = runner.model, runner.attn_backend
    spent = {"forward": 0.0, "attention": 0.0, "matmul": 0.0, "rows": 0}

    def timing(key, fn):
        def wrapped(*a, **kw):
            t = time.thread_time()
            out = fn(*a, **kw)
            spent[key] += time.thread_time() - t
            return out

        return wrapped

    model.forward = timing("forward", model.forward)
    backend.forward_decode = timing("attention", backend.forward_decode)
    backend.forward_extend = timing("attention", backend.forward_extend)
    runner_forward = runner.forward

    def forward(inp):  # the decode batch size (-1: an extend step)
        spent["rows"] = len(inp.seq_lens) if inp.mode.is_decode else -1
        return runner_forward(inp)

    runner.forward = forward
    if runner.cpu_forward is not None:  # the compiled forward: its own matmul/attention split
        compiled = runner.cpu_forward
        compiled.profile = prof = torch.zeros(2, dtype=torch.float64)

        class Timed:
            covers = compiled.covers

            def __call__(self, batch):
                before = prof.tolist()
                t = time.thread_time()
                out = compiled(batch)
                spent["forward"] += time.thread_time() - t
                spent["matmul"] += float(prof[0]) - before[0]
                spent["attention"] += float(prof[1]) - before[1]
                return out

        runner.cpu_forward = Timed()
    linear = F.linear
    params = make_sampling_params({"max_new_tokens": tg, "temperature": 0, "ignore_eos": True})
    for i, ids in enumerate(prompts):
        sched.add_request(
            TokenizedGenerateReq(rid=f"r{i}", input_ids=ids, sampling_params=params, seed=0)
        )
    steps, prefill = [], [0.0] * 4
    F.linear = timing("matmul", linear)
    try:
        while not sched.is_idle:
            for key in spent:
                spent[key] = 0
            t = time.thread_time()
            sched.step()
            step = time.thread_time() - t
            parts = (step, spent["forward"], spent["attention"], spent["matmul"])
            if spent["rows"] == len(prompts):
                steps.append(parts)
            elif spent["rows"] == -1:
                prefill = [a + b for a, b in zip(prefill, parts, strict=True)]
    finally:
        F.linear = linear
        if hasattr(sched, "close"):  # its grammar workers (older trees have no close())
            sched.close()

    def ms(k: int) -> float:
        return statistics.median(x[k] for x in steps) * 1e3

    split = {"step_ms": ms(0), "forward_ms": ms(1), "attention_ms": ms(2), "matmul_ms": ms(3)}
    split["other_ms"] = split["forward_ms"] - split["attention_ms"] - split["matmul_ms"]
    for key, v in zip(("", "_forward", "_attention", "_matmul"), prefill, strict=True):
        split[f"prefill{key}_ms"] = v * 1e3
    split["prefill_other_ms"] = (
        split["prefill_forward_ms"] - split["prefill_attention_ms"] - split["prefill_matmul_ms"]
    )
    weights = [m.weight for m in model.modules() if isinstance(m, LinearBase)]
    split["matmul_params"] = sum(w.numel() for w in weights) + model.lm_head.weight.numel()
    split["weight_mb"] = split["matmul_params"] * 4 / 1e6
    return split


FA = ("off", "auto")  # llama-batched-bench's flash-attention settings, both measured
# #19's targets, loom / llama.cpp: decode at these batch sizes, prefill at every one
DECODE_TARGET = {1: 0.6, 32: 1.2, 64: 1.2}
PREFILL_TARGET = 1.0
OFFLINE_TARGET = 1.2


def measure(args, label: str, path: str, llamacpp) -> dict:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    kv = args.kv_cache_dtype
    names = [n for n in BACKENDS if n in args.sides.split(",")]
    sides = {name: BackendSide(path, max(sizes), args.threads, name, kv) for name in names}
    rows = []
    try:
        for b in sizes:
            started = time.perf_counter()
            prompts = prompts_for(path, b, args.pp, args.seed)
            runs = {
                name: (
                    lambda s=side, p=prompts: (
                        s.run_whole(p, args.tg)
                        if args.loom_output == "whole"
                        else s.run_timed(p, args.tg)
                    )
                )
                for name, side in sides.items()
            }
            for fa in FA:
                runs[f"llama.cpp -fa {fa}"] = lambda b=b, fa=fa: llamacpp.batched_point(
                    label, args.threads, fa, b, args.pp, args.tg
                )
            t = common.alternate(runs, args.rounds)
            row = {"B": b, "pp": args.pp, "tg": args.tg, "load": os.getloadavg()[0]}
            for name in names:  # tok/s per round, as llama-batched-bench counts them
                row[f"{name}_prefill"] = [b * args.pp / f for f, _ in t[name]]
                row[f"{name}_decode"] = [b * (args.tg - 1) / (tot - f) for f, tot in t[name]]
            for fa in FA:
                row[f"llama_prefill_fa_{fa}"] = [x[0] for x in t[f"llama.cpp -fa {fa}"]]
                row[f"llama_decode_fa_{fa}"] = [x[1] for x in t[f"llama.cpp -fa {fa}"]]
            quote_faster_fa(row)
            row["split"] = step_split(path, prompts, args.tg, args.threads, kv)
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            print(format_row(row), flush=True)
    finally:
        for side in sides.values():
            side.close()
    return {
        "model": label,
        "pp": args.pp,
        "tg": args.tg,
        "threads": args.threads,
        "kv": kv,
        "rows": rows,
    }


def quote_faster_fa(row: dict) -> None:
    """Per measure (prefill, decode): the -fa setting with the higher median tok/s becomes
    the row's llama.cpp figures (`llama_<what>`, every ratio's denominator) and is named in
    `llama_<what>_fa`; both settings' figures stay in the row."""
    for what in ("prefill", "decode"):
        fa = max(FA, key=lambda f, w=what: statistics.median(row[f"llama_{w}_fa_{f}"]))
        row[f"llama_{what}"], row[f"llama_{what}_fa"] = row[f"llama_{what}_fa_{fa}"], fa


def misses(row: dict) -> list[str]:
    """One line per #19 target this row misses (default side against llama.cpp, medians),
    with the measured figures that explain it: wall time per step or per prefill on both
    sides, loom's CPU split, and the matmuls' rate (GB/s of f32 weights streamed per decode
    step; GFLOP/s over the prefill, 2 x parameters x tokens) beside the rate llama.cpp's whole
    step or prefill implies for the same weights."""
    if "cpu_paged_decode" not in row:
        return []
    b, sp, out = row["B"], row["split"], []
    med = statistics.median
    dec = med(x / y for x, y in zip(row["cpu_paged_decode"], row["llama_decode"], strict=True))
    if b in DECODE_TARGET and dec < DECODE_TARGET[b]:
        loom_ms = b / med(row["cpu_paged_decode"]) * 1e3
        llama_ms = b / med(row["llama_decode"]) * 1e3
        gflop = 2 * sp["matmul_params"] * b / 1e9
        out.append(
            f"B={b} decode {dec:.2f}x < {DECODE_TARGET[b]}x: a step takes {loom_ms:.2f} ms wall "
            f"(llama.cpp {llama_ms:.2f}; the target needs <= {llama_ms / DECODE_TARGET[b]:.2f}); "
            f"loom's CPU {sp['step_ms']:.2f} ms = forward {sp['forward_ms']:.2f} (matmuls "
            f"{sp['matmul_ms']:.2f}, attention {sp['attention_ms']:.2f}, other "
            f"{sp['other_ms']:.2f}) + {sp['step_ms'] - sp['forward_ms']:.2f} around it; the "
            f"matmuls stream {sp['weight_mb']:.0f} MB of f32 weights at "
            f"{sp['weight_mb'] / sp['matmul_ms']:.1f} GB/s, llama.cpp's whole step at "
            f"{sp['weight_mb'] / llama_ms:.1f} GB/s (the unit for a bandwidth-bound step); "
            f"{gflop:.2f} GFLOP at {gflop / sp['matmul_ms'] * 1e3:.1f} GFLOP/s, llama.cpp's "
            f"whole step at {gflop / llama_ms * 1e3:.1f} (the unit for a compute-bound one)"
        )
    pre = med(x / y for x, y in zip(row["cpu_paged_prefill"], row["llama_prefill"], strict=True))
    if pre < PREFILL_TARGET:
        tokens = b * row["pp"]
        gflop = 2 * sp["matmul_params"] * tokens / 1e9
        loom_s = tokens / med(row["cpu_paged_prefill"])
        llama_s = tokens / med(row["llama_prefill"])
        out.append(
            f"B={b} prefill {pre:.2f}x < {PREFILL_TARGET}x: {tokens} tokens in {loom_s * 1e3:.0f} "
            f"ms wall (llama.cpp {llama_s * 1e3:.0f}); loom's CPU {sp['prefill_ms']:.0f} ms = "
            f"forward {sp['prefill_forward_ms']:.0f} (matmuls {sp['prefill_matmul_ms']:.0f}, "
            f"attention {sp['prefill_attention_ms']:.0f}, other {sp['prefill_other_ms']:.0f}) + "
            f"{sp['prefill_ms'] - sp['prefill_forward_ms']:.0f} around it; the matmuls run "
            f"{gflop:.1f} GFLOP at {gflop / sp['prefill_matmul_ms'] * 1e3:.1f} GFLOP/s, "
            f"llama.cpp's whole prefill at {gflop / llama_s:.1f}"
        )
    return out


def offline(args, label: str, path: str, llamacpp) -> dict:
    """bench_offline's request set (--num-requests prompts of 10..400 tokens, 8..128 new
    tokens, all at once): a loom server (cpu_paged, the default) against llama-server (-fa
    --offline-fa), both through the same HTTP client; llama-server with llama.cpp's default
    per-slot KV and with --kv-unified (one pool: with -fa off every sequence then attends over
    the whole pool, masked), each a side of the alternation. The ratio quotes the faster."""
    import transformers
    from bench_offline import LoomServerSide, make_requests

    tok = transformers.AutoTokenizer.from_pretrained(path)
    reqs = make_requests(tok, args.num_requests, args.seed)
    useful = sum(m for _, m in reqs)
    started = time.perf_counter()
    loom_side = LoomServerSide(path, len(reqs), args.threads)
    peers = {
        uni: llamacpp.ServerPeer(label, args.threads, args.offline_fa, reqs, kv_unified=uni)
        for uni in (False, True)
    }

    def loom_run() -> tuple[float, float]:
        """(seconds, of which in decode steps: the scheduler's own per-step wall clock)"""
        before = loom_side.decode_timing()
        seconds = loom_side.run(reqs)
        after = loom_side.decode_timing()
        return seconds, sum(v[1] - before.get(b, [0, 0.0])[1] for b, v in after.items())

    runs = {"loom": loom_run}
    for uni, peer in peers.items():
        runs[f"llama.cpp{' --kv-unified' if uni else ''}"] = lambda p=peer: p.run(reqs)
    try:
        t = common.alternate(runs, args.rounds)
    finally:
        loom_side.close()
        for peer in peers.values():
            peer.close()
    per_slot = [useful / x for x in t["llama.cpp"]]
    unified = [useful / x for x in t["llama.cpp --kv-unified"]]
    faster = "--kv-unified" if statistics.median(unified) > statistics.median(per_slot) else ""
    out = {
        "requests": len(reqs),
        "prompt_tokens": sum(len(p) for p, _ in reqs),
        "useful_tokens": useful,
        "fa": args.offline_fa,
        "load": os.getloadavg()[0],
        "loom": [useful / x for x, _ in t["loom"]],
        "loom_decode_s": [d for _, d in t["loom"]],
        "llama_per_slot": per_slot,
        "llama_unified": unified,
        "llama_kv": faster or "per-slot",
        "llama": unified if faster else per_slot,
        "seconds": time.perf_counter() - started,
    }
    seconds = statistics.median(x for x, _ in t["loom"])
    decode = statistics.median(out["loom_decode_s"])
    print(
        f"offline ({len(reqs)} requests, {out['prompt_tokens']} prompt and {useful} new tokens, "
        f"-fa {args.offline_fa}, load {out['load']:.1f}, {out['seconds']:.0f} s; servers, one "
        f"client): loom {statistics.median(out['loom']):.0f} vs llama-server per-slot KV "
        f"{statistics.median(per_slot):.0f} / --kv-unified {statistics.median(unified):.0f} "
        f"useful tok/s; loom / llama.cpp ({out['llama_kv']}, the faster) "
        f"{common.fmt_ratio(out['loom'], out['llama'])}; loom's run {seconds:.1f} s wall, "
        f"{decode:.1f} s of it in decode steps, {seconds - decode:.1f} s in prefill steps, "
        f"between steps and HTTP",
        flush=True,
    )
    ratio = common.ratio_summary(out["loom"], out["llama"])[0]
    if ratio < OFFLINE_TARGET:
        print(
            f"    missed: offline {ratio:.2f}x < {OFFLINE_TARGET}x: loom {seconds:.1f} s "
            f"({decode:.1f} in decode steps), llama.cpp "
            f"{useful / statistics.median(out['llama']):.1f} s for the same requests",
            flush=True,
        )
    return out


def format_row(row: dict) -> str:
    sp = row["split"]
    parts = [f"B={row['B']:3} (load {row['load']:.1f}, {row['seconds']:.0f} s)"]
    names = [n for n in BACKENDS if f"{n}_decode" in row]
    for what in ("decode", "prefill"):
        for name in names:
            parts.append(
                f"{what} {name} / llama.cpp "
                f"{common.fmt_ratio(row[f'{name}_{what}'], row[f'llama_{what}'])}"
            )
    parts.append(f"llama.cpp {_fa_both(row, 'decode')} decode tok/s; {_fa_both(row, 'prefill')} "
                 "prefill tok/s (ratios against the faster)")  # fmt: skip
    if "cpu_paged_decode" in row:
        parts.append(
            f"loom {statistics.median(row['cpu_paged_decode']):.0f} vs llama.cpp "
            f"{statistics.median(row['llama_decode']):.0f} decode tok/s; prefill "
            f"{statistics.median(row['cpu_paged_prefill']):.0f} vs "
            f"{statistics.median(row['llama_prefill']):.0f} tok/s"
        )
    parts.append(
        "cpu_paged decode step {step_ms:.2f} CPU ms: forward {forward_ms:.2f} (attention "
        "{attention_ms:.2f}, matmuls {matmul_ms:.2f}, other {other_ms:.2f}); prefill "
        "{prefill_ms:.0f} CPU ms: forward {prefill_forward_ms:.0f} (attention "
        "{prefill_attention_ms:.0f}, matmuls {prefill_matmul_ms:.0f}, other "
        "{prefill_other_ms:.0f})".format(**sp)
    )
    parts += [f"missed: {m}" for m in misses(row)]
    return "\n    ".join(parts)


def _fa_both(row: dict, what: str) -> str:
    """Both -fa settings' median tok/s, the quoted (faster) one marked."""
    med = statistics.median
    return " / ".join(
        f"-fa {fa} {med(row[f'llama_{what}_fa_{fa}']):.0f}"
        + ("*" if fa == row[f"llama_{what}_fa"] else "")
        for fa in FA
    )


def _ratio(row: dict, name: str, what: str) -> str:
    if f"{name}_{what}" not in row:
        return "not run"
    return common.fmt_ratio(row[f"{name}_{what}"], row[f"llama_{what}"])


def markdown(results: list[dict]) -> str:
    lines = []
    for res in results:
        if res.get("rows"):
            lines += [
                f"**{res['model']}**, pp {res['pp']}, tg {res['tg']}, loom KV {res['kv']}, "
                f"{res['threads']} thread(s)"
                " each; ratios loom / llama.cpp at its faster -fa setting for that row and"
                " measure (both measured; * marks the one quoted), median and range over the"
                " rounds:",
                "",
                "| B | load | decode, default | decode, --cpu-forward eager | decode, torch backend"
                " | prefill, default | loom decode tok/s | llama.cpp decode tok/s | loom CPU ms per"
                " decode step: step: forward (attention / matmuls / other) | loom CPU ms in the"
                " prefill: all: forward (attention / matmuls / other) |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
        why = []
        for row in res.get("rows", []):
            sp = row["split"]
            loom_tps = (
                f"{statistics.median(row['cpu_paged_decode']):.0f}"
                if "cpu_paged_decode" in row
                else "-"
            )
            lines.append(
                f"| {row['B']} | {row['load']:.1f} "
                f"| {_ratio(row, 'cpu_paged', 'decode')} "
                f"| {_ratio(row, 'eager', 'decode')} "
                f"| {_ratio(row, 'torch', 'decode')} "
                f"| {_ratio(row, 'cpu_paged', 'prefill')} "
                f"| {loom_tps} "
                f"| {_fa_both(row, 'decode')} "
                f"| {sp['step_ms']:.2f}: {sp['forward_ms']:.2f} ({sp['attention_ms']:.2f} / "
                f"{sp['matmul_ms']:.2f} / {sp['other_ms']:.2f}) "
                f"| {sp['prefill_ms']:.0f}: {sp['prefill_forward_ms']:.0f} "
                f"({sp['prefill_attention_ms']:.0f} / {sp['prefill_matmul_ms']:.0f} / "
                f"{sp['prefill_other_ms']:.0f}) |"
            )
            why += misses(row)
        if why:
            lines += ["", "Targets missed (medians), with the measured split:", ""]
            lines += [f"- {m}" for m in why]
        if "offline" in res:
            off = res["offline"]
            seconds = off["useful_tokens"] / statistics.median(off["loom"])
            lines += [
                "",
                f"**{res['model']}** offline ({off['requests']} requests, {off['prompt_tokens']} "
                f"prompt and {off['useful_tokens']} new tokens, load {off['load']:.1f}; loom server "
                f"and llama-server through one HTTP client): loom "
                f"{statistics.median(off['loom']):.0f} vs llama-server per-slot KV "
                f"{statistics.median(off['llama_per_slot']):.0f} / --kv-unified "
                f"{statistics.median(off['llama_unified']):.0f} useful tok/s, loom / llama.cpp "
                f"-fa {off['fa']} ({off['llama_kv']}, the faster) "
                f"{common.fmt_ratio(off['loom'], off['llama'])}; loom's run "
                f"{seconds:.1f} s, {statistics.median(off['loom_decode_s']):.1f} s of it in "
                "decode steps.",
            ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="bundled", help=f"comma-separated, from {common.MODELS}")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--pp", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--tg", type=int, default=32, help="new tokens per sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="threads for loom and llama.cpp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sides",
        default=",".join(BACKENDS),
        help=f"loom's sides beside llama.cpp, from {BACKENDS} (cpu_paged: the default)",
    )
    p.add_argument("--offline", action="store_true", help="also bench_offline's request set")
    p.add_argument("--num-requests", type=int, default=64, help="offline: requests")
    p.add_argument("--offline-fa", default="auto", choices=["auto", "off"], help="offline: -fa")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16"],
        help="loom's KV pool (auto: the model's f32; llama-batched-bench's is f16)",
    )
    p.add_argument(
        "--loom-output",
        default="stream",
        choices=["stream", "whole"],
        help="how loom's sweep sides are timed: one streamed run (first token = prefill), or"
        " two unstreamed runs (max_new_tokens 1, then --tg; decode = the difference), which"
        " leaves out the per-token messages to the caller, as llama-batched-bench has none",
    )
    p.add_argument("--json", help="write the raw figures here")
    args = p.parse_args(argv)
    import llamacpp

    print(common.header("engine room (CPU): loom vs llama.cpp"))
    print(f"loom's sweep sides timed: {args.loom_output}")
    results = []
    for name in args.models.split(","):
        label, path = common.resolve_model(name)
        llamacpp.build()
        llamacpp.check(label, args.threads, fas=FA)  # same tokens and greedy output first
        res = measure(args, label, path, llamacpp) if args.batch_sizes else {"model": label}
        if args.offline:
            res["offline"] = offline(args, label, path, llamacpp)
        results.append(res)
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
