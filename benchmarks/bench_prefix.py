"""Prefix reuse: three workloads shaped like the SGLang paper's, with the radix cache on, off,
and through HF transformers `generate`, on the same prompts.

- few-shot: a ~1,500-token shared few-shot prefix, 64 questions (16 new tokens each);
- multi-turn chat: 16 sessions x 4 turns, each turn resends the whole history (32 new tokens);
- tree of thought: 4 problems, each a shared context with 8 branches (48 new tokens), then an
  evaluation of every branch that resends context + branch (12 new tokens).

Greedy decoding throughout; every system is warmed up, and the systems alternate per workload
for --rounds rounds (loom, loom without the cache, HF, loom, ...). Prints requests/s (median),
the cache hit rate, and the median per-round ratios with their range. The headline is loom
against HF `generate` (a padded batch per stage, the same threads): the cache-off ratio is shown
too, but loom's cache-off path is itself slower than HF's padded batch on long shared prompts,
so it overstates what the cache buys. --scale shrinks every workload (prefix length and counts)
for larger models. Writes docs/img/prefix_hit_rate.png (hit rate against speed-up over HF).

    python benchmarks/bench_prefix.py [--model bundled|qwen0.5b-f32|PATH] [--rounds 3] [--scale 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import common

COUNTRIES = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Spain", "Madrid"),
    ("Italy", "Rome"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Egypt", "Cairo"),
    ("Peru", "Lima"),
    ("Kenya", "Nairobi"),
    ("Norway", "Oslo"),
    ("Chile", "Santiago"),
    ("India", "New Delhi"),
]


def few_shot_prefix(tok, target: int) -> str:
    rng = random.Random(1)
    text = "Answer each question with one word.\n\n"
    while len(tok.encode(text)) < target:
        c, cap = rng.choice(COUNTRIES)
        text += f"Q: What is the capital of {c}?\nA: {cap}\n\n"
    return text


class Runner:
    """One system under test: loom with or without the cache, or HF generate."""

    def __init__(self, kind: str, path: str, threads: int):
        self.kind = kind
        if kind == "hf":
            import torch
            import transformers

            # the same thread count loom's scheduler uses, so neither side oversubscribes
            torch.set_num_threads(threads)
            self.tok = transformers.AutoTokenizer.from_pretrained(path)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype="auto"
            ).eval()
        else:
            import loom

            self.engine = loom.Engine(
                path,
                disable_radix_cache=(kind == "loom-nocache"),
                random_seed=0,
                cpu_threads=threads,
                log_level="warning",
            )
            self.tok = self.engine.tokenizer

    def generate(self, prompts: list[str], max_new: int) -> list[str]:
        if self.kind != "hf":
            params = {"max_new_tokens": max_new, "temperature": 0}
            return [o["text"] for o in self.engine.generate(prompts, params)]
        import torch

        enc = [self.tok.encode(p) for p in prompts]
        longest = max(map(len, enc))
        pad = self.tok.pad_token_id or 0
        ids = torch.full((len(enc), longest), pad)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(enc):
            ids[i, longest - len(e) :] = torch.tensor(e)
            mask[i, longest - len(e) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad,
            )
        return self.tok.batch_decode(out[:, longest:], skip_special_tokens=True)

    def stats(self) -> tuple[int, int]:
        if self.kind == "hf":
            return 0, 0
        info = self.engine.get_server_info()
        return info["prompt_tokens"], info["cached_tokens"]

    def close(self) -> None:
        if self.kind != "hf":
            self.engine.shutdown()


def chat(tok, history: list[dict]) -> str:
    return tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)


def _n(base: int, scale: float) -> int:
    return max(1, round(base * scale))


def run_few_shot(r: Runner, scale: float) -> int:
    prefix = few_shot_prefix(r.tok, _n(1500, scale))
    rng = random.Random(2)
    questions = [
        f"Q: What is the capital of {rng.choice(COUNTRIES)[0]}?\nA:" for _ in range(_n(64, scale))
    ]
    r.generate([prefix + q for q in questions], 16)
    return len(questions)


def run_multi_turn(r: Runner, scale: float) -> int:
    rng = random.Random(3)
    sessions = [
        [{"role": "system", "content": "You are a helpful assistant."}]
        for _ in range(_n(16, scale))
    ]
    n = 0
    for turn in range(4):
        for h in sessions:
            c, _ = rng.choice(COUNTRIES)
            h.append({"role": "user", "content": f"Tell me about {c}, part {turn + 1}."})
        answers = r.generate([chat(r.tok, h) for h in sessions], 32)
        for h, a in zip(sessions, answers):
            h.append({"role": "assistant", "content": a})
        n += len(sessions)
    return n


def run_tree_of_thought(r: Runner, scale: float) -> int:
    n = 0
    for p in range(_n(4, scale)):
        c, _ = COUNTRIES[p]
        context = few_shot_prefix(r.tok, _n(400, scale)) + f"Problem: plan a trip to {c}.\n"
        branches = [context + f"Thought {i + 1}:" for i in range(8)]
        thoughts = r.generate(branches, 48)
        evals = [b + t + "\nEvaluation:" for b, t in zip(branches, thoughts)]
        r.generate(evals, 12)
        n += len(branches) + len(evals)
    return n


WORKLOADS = {
    "few-shot": run_few_shot,
    "multi-turn": run_multi_turn,
    "tree-of-thought": run_tree_of_thought,
}


def measure(r: Runner, fn, scale: float) -> tuple[float, float]:
    """(requests/s, cache hit rate) of one workload on a cold cache."""
    if r.kind != "hf":
        r.engine.flush_cache()
    p0, c0 = r.stats()
    t = time.perf_counter()
    n = fn(r, scale)
    elapsed = time.perf_counter() - t
    p1, c1 = r.stats()
    return n / elapsed, (c1 - c0) / max(1, p1 - p0)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bundled", help=f"one of {common.MODELS} or a folder")
    parser.add_argument("--systems", default="loom,loom-nocache,hf")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor")
    parser.add_argument("--threads", type=int, default=None, help="default: loom's")
    args = parser.parse_args(argv)
    from loom.runtime.server_args import ServerArgs

    label, path = common.resolve_model(args.model)
    threads = args.threads or ServerArgs().effective_cpu_threads
    kinds = args.systems.split(",")
    print(common.header("bench_prefix"))
    print(f"model {label}, threads {threads}, scale {args.scale}, {args.rounds} rounds alternating")
    runners = {}
    try:
        for kind in kinds:
            runners[kind] = Runner(kind, path, threads)
            runners[kind].generate(["warm up"], 2)
        rps: dict[tuple[str, str], list[float]] = {}
        hits: dict[tuple[str, str], list[float]] = {}
        for name, fn in WORKLOADS.items():
            for _ in range(args.rounds):
                for kind, r in runners.items():
                    v, hit = measure(r, fn, args.scale)
                    rps.setdefault((kind, name), []).append(v)
                    hits.setdefault((kind, name), []).append(hit)
            for kind in kinds:
                v = rps[(kind, name)]
                print(
                    f"{kind:13s} {name:16s} {statistics.median(v):8.2f} req/s "
                    f"({min(v):.2f}-{max(v):.2f})  hit rate {100 * statistics.median(hits[(kind, name)]):5.1f}%",
                    flush=True,
                )
    finally:
        for r in runners.values():
            r.close()
    out = {"model": label, "workloads": {}}
    print(
        "\nworkload         loom/HF (median, range)     loom/cache-off             cache-off/HF   hit rate"
    )
    for name in WORKLOADS:
        on = rps.get(("loom", name))
        if on is None:
            continue
        off, hf = rps.get(("loom-nocache", name)), rps.get(("hf", name))
        hit = statistics.median(hits[("loom", name)])
        row = {"hit_rate": hit}
        cols = []
        for key, a, b in (("vs_hf", on, hf), ("vs_nocache", on, off), ("nocache_vs_hf", off, hf)):
            if a and b:
                row[key] = common.ratio_summary(a, b)
                cols.append(f"{row[key][0]:6.2f}x ({row[key][1]:.2f}-{row[key][2]:.2f})")
            else:
                cols.append("     -")
        out["workloads"][name] = row
        print(f"{name:16s} {cols[0]:26s} {cols[1]:26s} {cols[2]:20s} {100 * hit:5.1f}%")
    if all("vs_hf" in w for w in out["workloads"].values()):
        pts = {n: ([100 * w["hit_rate"]], [w["vs_hf"][0]]) for n, w in out["workloads"].items()}
        common.plot(
            f"prefix_hit_rate_{label}.png",
            f"Prefix reuse: cache hit rate vs speed-up over HF generate ({label})",
            "loom cache hit rate (%)",
            "loom req/s / HF req/s",
            pts,
        )
    print(common.loadavg())
    return out


if __name__ == "__main__":
    main()
