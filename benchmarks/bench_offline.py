"""Offline throughput: loom's Engine beside HF transformers `generate` on the same requests.

Offline workload: N requests (default 64), prompts of 10-400 tokens, 8-128 new tokens each
(greedy, ignore_eos). HF runs them once as one padded static batch (which must run to the
longest output) and once one request at a time. Both sides are warmed up first; the runs
alternate (loom, HF static, HF serial, loom, ...) for --rounds rounds and the ratios are the
median of the per-round ratios with their range. Useful tokens/s counts only each request's
own new tokens. Decode overhead = the share of all decode-step time (every batch size) spent
outside the model forward.

Batched workload (--batched): B sequences of --pp random prompt tokens and --tg new tokens for
each B in --batch-sizes, as llama.cpp's llama-batched-bench measures it: prefill tok/s =
B*pp / (time to the first token), decode tok/s = B*(tg-1) / (the rest).

    python benchmarks/bench_offline.py [--model bundled|qwen0.5b-f32|qwen0.5b-bf16|PATH]
        [--num-requests 64] [--rounds 3] [--batched --batch-sizes 1,8,32,64 --pp 128 --tg 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import common


def make_requests(tokenizer, n: int, seed: int, max_prompt: int = 400, max_new: int = 128):
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2)[:2000] or ["the"]
    reqs = []
    for _ in range(n):
        target = rng.randint(min(10, max_prompt), max_prompt)
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" " + rng.choice(words))
        reqs.append((ids[:target], rng.randint(min(8, max_new), max_new)))
    return reqs


class LoomSide:
    """One Engine kept for every round (warmed up once); the cache is flushed before each run."""

    def __init__(self, model_path: str, max_running: int, threads: int):
        import loom

        self.engine = loom.Engine(
            model_path,
            max_running_requests=max_running,
            random_seed=0,
            cpu_threads=threads,
            log_level="warning",
        )
        self.engine.generate(input_ids=[[5, 6, 7, 8]], sampling_params={"max_new_tokens": 4})

    def run(self, reqs: list[tuple[list[int], int]]) -> float:
        """Seconds for all requests at once."""
        self.engine.flush_cache()
        params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True} for _, m in reqs]
        t = time.perf_counter()
        outs = self.engine.generate(input_ids=[p for p, _ in reqs], sampling_params=params)
        elapsed = time.perf_counter() - t
        assert sum(o["meta_info"]["completion_tokens"] for o in outs) == sum(m for _, m in reqs)
        return elapsed

    def decode_timing(self) -> dict[int, list]:
        info = self.engine.get_server_info()
        return {int(k): v for k, v in info["decode_timing"].items()}

    def close(self) -> None:
        self.engine.shutdown()


class HFSide:
    def __init__(self, model_path: str, pad_id: int):
        import torch
        import transformers

        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype="auto"
        ).eval()
        self.pad = pad_id
        self.generate([[5, 6, 7, 8]], 4)  # warm-up, as loom gets

    def generate(self, prompts: list[list[int]], max_new: int) -> float:
        """Seconds for one padded (left) batch run to exactly max_new tokens."""
        torch = self.torch
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=self.pad,
            )
        return time.perf_counter() - t

    def static(self, reqs) -> float:
        return self.generate([p for p, _ in reqs], max(m for _, m in reqs))

    def serial(self, reqs) -> float:
        return sum(self.generate([p], m) for p, m in reqs)


def offline(args, label: str, path: str, tok, threads: int) -> dict:
    reqs = make_requests(tok, args.num_requests, args.seed, args.max_prompt, args.max_new)
    useful = sum(m for _, m in reqs)
    print(
        f"model {label} ({path})\n{len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
        f"useful new tokens {useful}, threads {threads}, {args.rounds} rounds alternating"
    )
    loom_side = LoomSide(path, args.num_requests, threads)
    try:
        hf = HFSide(path, tok.pad_token_id if tok.pad_token_id is not None else 0)
        runs = {"loom": lambda: loom_side.run(reqs), "hf_static": lambda: hf.static(reqs)}
        if not args.skip_serial:
            runs["hf_serial"] = lambda: hf.serial(reqs)
        secs = common.alternate(runs, args.rounds)
        timing = loom_side.decode_timing()
    finally:
        loom_side.close()
    tps = {k: [useful / s for s in v] for k, v in secs.items()}
    names = {"loom": "loom Engine", "hf_static": "HF static batch", "hf_serial": "HF one at a time"}
    for k, v in tps.items():
        print(
            f"{names[k]:22} {statistics.median(v):9.1f} tok/s  (median of {len(v)}; {min(v):.1f}-{max(v):.1f})"
        )
    out = {"model": label, "tok_s": {k: statistics.median(v) for k, v in tps.items()}}
    out["vs_static"] = common.ratio_summary(tps["loom"], tps["hf_static"])
    print(f"loom / HF static batch  {common.fmt_ratio(tps['loom'], tps['hf_static'])}")
    if "hf_serial" in tps:
        out["vs_serial"] = common.ratio_summary(tps["loom"], tps["hf_serial"])
        print(f"loom / HF one-at-a-time {common.fmt_ratio(tps['loom'], tps['hf_serial'])}")
    steps, step_s, fwd_s = (sum(v[i] for v in timing.values()) for i in range(3))
    out["overhead"] = 1 - fwd_s / step_s
    print(
        f"all decode steps of all rounds (batch 1-{max(timing)}): {steps} steps, "
        f"{1000 * step_s / steps:.2f} ms/step, outside the model forward {100 * out['overhead']:.1f}%"
    )
    return out


def batched(args, label: str, path: str, tok, threads: int) -> dict:
    """Prefill and decode tok/s per batch size, loom and HF alternating per batch size."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rng = random.Random(args.seed)
    vocab = len(tok)
    special = set(tok.all_special_ids)
    pool = [i for i in range(vocab) if i not in special]
    print(
        f"batched: model {label}, pp {args.pp}, tg {args.tg}, batch sizes {sizes}, threads {threads}"
    )
    loom_side = LoomSide(path, max(sizes), threads)
    rows = []
    try:
        hf = HFSide(path, tok.pad_token_id if tok.pad_token_id is not None else 0)
        for b in sizes:
            prompts = [[rng.choice(pool) for _ in range(args.pp)] for _ in range(b)]
            reqs1 = [(p, 1) for p in prompts]
            reqs = [(p, args.tg) for p in prompts]
            t = common.alternate(
                {
                    "loom_pp": lambda r=reqs1: loom_side.run(r),
                    "loom_all": lambda r=reqs: loom_side.run(r),
                    "hf_pp": lambda p=prompts: hf.generate(p, 1),
                    "hf_all": lambda p=prompts: hf.generate(p, args.tg),
                },
                args.rounds,
            )
            row = {"B": b}
            for side in ("loom", "hf"):
                pp_s = statistics.median(t[f"{side}_pp"])
                tg_s = statistics.median(t[f"{side}_all"]) - pp_s
                row[f"{side}_prefill"] = b * args.pp / pp_s
                row[f"{side}_decode"] = b * (args.tg - 1) / max(tg_s, 1e-9)
            rows.append(row)
            print(
                f"B={b:3}  loom prefill {row['loom_prefill']:9.1f} tok/s decode {row['loom_decode']:8.1f} tok/s"
                f" | HF prefill {row['hf_prefill']:9.1f} tok/s decode {row['hf_decode']:8.1f} tok/s"
            )
    finally:
        loom_side.close()
    return {"model": label, "pp": args.pp, "tg": args.tg, "threads": threads, "rows": rows}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bundled", help=f"one of {common.MODELS} or a model folder")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=400, help="prompt lengths 10..this")
    p.add_argument("--max-new", type=int, default=128, help="new tokens 8..this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (A B A B ...)")
    p.add_argument("--skip-serial", action="store_true", help="skip HF one-at-a-time")
    p.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (default: loom's)"
    )
    p.add_argument("--batched", action="store_true", help="also the batch-size sweep")
    p.add_argument("--only-batched", action="store_true", help="only the batch-size sweep")
    p.add_argument("--batch-sizes", default="1,8,32,64")
    p.add_argument("--pp", type=int, default=128, help="batched: prompt tokens per sequence")
    p.add_argument("--tg", type=int, default=32, help="batched: new tokens per sequence")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.tg < 2:
        raise SystemExit("--tg: must be >= 2 (decode time is the time after the first token)")
    import torch
    import transformers

    from loom.runtime.server_args import ServerArgs

    threads = args.threads or ServerArgs().effective_cpu_threads
    torch.set_num_threads(threads)
    label, path = common.resolve_model(args.model)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    print(common.header("bench_offline"))
    out = {}
    if not args.only_batched:
        out["offline"] = offline(args, label, path, tok, threads)
    if args.batched or args.only_batched:
        out["batched"] = batched(args, label, path, tok, threads)
    print(common.loadavg())
    return out


if __name__ == "__main__":
    main()
