"""The CPU engine room: loom's forward against llama.cpp, one thread each, and where loom's
decode step time goes.

For each model and batch size B, B sequences of --pp random prompt tokens generate --tg tokens
each (llama.cpp's llama-batched-bench workload, as bench_offline --batched runs it). The sides
alternate every round: loom as it starts by default (the cpu_paged attention backend, and steps
of up to cpu_forward.MAX_TOKENS tokens, prefill included, through the compiled C forward of
runtime/cpu_forward.py), loom with
--cpu-forward eager (the torch modules, cpu_paged), loom with the torch reference backend
(eager, the per-step gather cpu_paged replaces), and llama-batched-bench -fa off
(llama.cpp's fastest CPU setting here), through benchmarks/peers/llamacpp.py (which builds
llama.cpp once, converts the model to GGUF f32 and checks greedy tokens match). Ratios are
loom / llama.cpp tok/s per round: median and range, with the load average beside them.

The split (loom, cpu_paged, in-process scheduler, one thread), in CPU time of the scheduler
thread so that the other processes' load does not inflate it: per full-batch decode step, the
whole step (scheduling, sampling and the forward), the model forward alone, its attention
calls and its matmuls (every F.linear, the LM head included; in the compiled forward its own
CPU-time counters of the same parts); "other" = forward - attention - matmuls: norms, RoPE,
elementwise ops and the Python module calls between them.

    python benchmarks/bench_engine_room.py [--models bundled,qwen0.5b-f32]
        [--batch-sizes 1,8,32,64] [--pp 128] [--tg 32] [--rounds 3] [--threads 1]
        [--offline [--num-requests 64]] [--kv-cache-dtype auto|bf16] [--json out.json]

--offline adds bench_offline's request set (prompts of 10..400 tokens, 8..128 new tokens, all
sent at once): loom against llama-server (-fa --offline-fa, default auto), alternating;
--batch-sizes "" skips the sweep. --kv-cache-dtype bf16 stores every loom side's KV in
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
    other (= forward - attention - matmuls)."""
    import torch
    import torch.nn.functional as F

    from loom.runtime.io_struct import TokenizedGenerateReq
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
    runner_forward = runner.forward

    def forward(inp):  # the decode batch size (0: an extend step)
        spent["rows"] = len(inp.seq_lens) if inp.mode.is_decode else 0
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
    steps = []
    F.linear = timing("matmul", linear)
    try:
        while not sched.is_idle:
            for key in spent:
                spent[key] = 0
            t = time.thread_time()
            sched.step()
            step = time.thread_time() - t
            if spent["rows"] == len(prompts):
                steps.append((step, spent["forward"], spent["attention"], spent["matmul"]))
    finally:
        F.linear = linear

    def ms(k: int) -> float:
        return statistics.median(x[k] for x in steps) * 1e3

    split = {"step_ms": ms(0), "forward_ms": ms(1), "attention_ms": ms(2), "matmul_ms": ms(3)}
    split["other_ms"] = split["forward_ms"] - split["attention_ms"] - split["matmul_ms"]
    return split


def measure(args, label: str, path: str, llamacpp) -> dict:
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    kv = args.kv_cache_dtype
    sides = {name: BackendSide(path, max(sizes), args.threads, name, kv) for name in BACKENDS}
    rows = []
    try:
        for b in sizes:
            prompts = prompts_for(path, b, args.pp, args.seed)
            runs = {
                name: (lambda s=side, p=prompts: s.run_timed(p, args.tg))
                for name, side in sides.items()
            }
            runs["llama.cpp"] = lambda b=b: llamacpp.batched_point(
                label, args.threads, "off", b, args.pp, args.tg
            )
            t = common.alternate(runs, args.rounds)
            row = {"B": b, "load": os.getloadavg()[0]}
            for name in BACKENDS:  # tok/s per round, as llama-batched-bench counts them
                row[f"{name}_prefill"] = [b * args.pp / f for f, _ in t[name]]
                row[f"{name}_decode"] = [b * (args.tg - 1) / (tot - f) for f, tot in t[name]]
            row["llama_prefill"] = [x[0] for x in t["llama.cpp"]]
            row["llama_decode"] = [x[1] for x in t["llama.cpp"]]
            row["split"] = step_split(path, prompts, args.tg, args.threads, kv)
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


def offline(args, label: str, path: str, llamacpp) -> dict:
    """bench_offline's request set (--num-requests prompts of 10..400 tokens, 8..128 new
    tokens, all at once): loom (cpu_paged, the default) against llama-server (-fa
    --offline-fa: with "off" its unified KV pool makes every sequence attend over the whole
    pool, masked, so "auto" is its faster setting for this workload)."""
    import transformers
    from bench_offline import make_requests

    tok = transformers.AutoTokenizer.from_pretrained(path)
    reqs = make_requests(tok, args.num_requests, args.seed)
    useful = sum(m for _, m in reqs)
    loom_side = BackendSide(path, len(reqs), args.threads, "cpu_paged")
    peer = llamacpp.ServerPeer(label, args.threads, args.offline_fa, reqs)
    try:
        t = common.alternate(
            {"loom": lambda: loom_side.run(reqs), "llama.cpp": lambda: peer.run(reqs)},
            args.rounds,
        )
    finally:
        loom_side.close()
        peer.close()
    out = {
        "requests": len(reqs),
        "fa": args.offline_fa,
        "load": os.getloadavg()[0],
        "loom": [useful / x for x in t["loom"]],
        "llama": [useful / x for x in t["llama.cpp"]],
    }
    print(
        f"offline ({len(reqs)} requests, -fa {args.offline_fa}, load {out['load']:.1f}): loom "
        f"{statistics.median(out['loom']):.0f} vs llama.cpp {statistics.median(out['llama']):.0f}"
        f" useful tok/s; loom / llama.cpp {common.fmt_ratio(out['loom'], out['llama'])}",
        flush=True,
    )
    return out


def format_row(row: dict) -> str:
    sp = row["split"]
    parts = [f"B={row['B']:3} (load {row['load']:.1f})"]
    for what in ("decode", "prefill"):
        for name in BACKENDS:
            parts.append(
                f"{what} {name} / llama.cpp "
                f"{common.fmt_ratio(row[f'{name}_{what}'], row[f'llama_{what}'])}"
            )
    parts.append(
        f"loom {statistics.median(row['cpu_paged_decode']):.0f} vs llama.cpp "
        f"{statistics.median(row['llama_decode']):.0f} decode tok/s"
    )
    parts.append(
        "cpu_paged decode step {step_ms:.2f} CPU ms: forward {forward_ms:.2f} (attention "
        "{attention_ms:.2f}, matmuls {matmul_ms:.2f}, other {other_ms:.2f})".format(**sp)
    )
    return "\n    ".join(parts)


def markdown(results: list[dict]) -> str:
    lines = []
    for res in results:
        if res.get("rows"):
            lines += [
                f"**{res['model']}**, pp {res['pp']}, tg {res['tg']}, loom KV {res['kv']}, "
                f"{res['threads']} thread(s)"
                " each; ratios loom / llama.cpp (-fa off), median and range over the rounds:",
                "",
                "| B | load | decode, default | decode, --cpu-forward eager | decode, torch backend"
                " | prefill, default | loom decode tok/s | llama.cpp decode tok/s | loom CPU ms per"
                " decode step: step: forward (attention / matmuls / other) |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
        for row in res.get("rows", []):
            sp = row["split"]
            lines.append(
                f"| {row['B']} | {row['load']:.1f} "
                f"| {common.fmt_ratio(row['cpu_paged_decode'], row['llama_decode'])} "
                f"| {common.fmt_ratio(row['eager_decode'], row['llama_decode'])} "
                f"| {common.fmt_ratio(row['torch_decode'], row['llama_decode'])} "
                f"| {common.fmt_ratio(row['cpu_paged_prefill'], row['llama_prefill'])} "
                f"| {statistics.median(row['cpu_paged_decode']):.0f} "
                f"| {statistics.median(row['llama_decode']):.0f} "
                f"| {sp['step_ms']:.2f}: {sp['forward_ms']:.2f} ({sp['attention_ms']:.2f} / "
                f"{sp['matmul_ms']:.2f} / {sp['other_ms']:.2f}) |"
            )
        if "offline" in res:
            off = res["offline"]
            lines += [
                "",
                f"**{res['model']}** offline ({off['requests']} requests, load "
                f"{off['load']:.1f}): loom {statistics.median(off['loom']):.0f} vs llama.cpp "
                f"{statistics.median(off['llama']):.0f} useful tok/s, loom / llama.cpp -fa {off['fa']} "
                f"{common.fmt_ratio(off['loom'], off['llama'])}.",
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
    p.add_argument("--offline", action="store_true", help="also bench_offline's request set")
    p.add_argument("--num-requests", type=int, default=64, help="offline: requests")
    p.add_argument("--offline-fa", default="auto", choices=["auto", "off"], help="offline: -fa")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bf16"],
        help="loom's KV pool (auto: the model's f32; llama-batched-bench's is f16)",
    )
    p.add_argument("--json", help="write the raw figures here")
    args = p.parse_args(argv)
    import llamacpp

    print(common.header("engine room (CPU): loom vs llama.cpp"))
    results = []
    for name in args.models.split(","):
        label, path = common.resolve_model(name)
        llamacpp.build()
        llamacpp.check(label, args.threads)  # same tokens, same greedy output first
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
