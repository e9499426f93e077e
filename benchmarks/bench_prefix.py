"""Prefix reuse: three workloads shaped like the SGLang paper's, with the radix cache on, off,
and through HF transformers `generate`, on the same prompts.

- few-shot: a ~1,500-token shared few-shot prefix, 64 questions (16 new tokens each);
- multi-turn chat: 16 sessions x 4 turns, each turn resends the whole history (32 new tokens);
- tree of thought: 4 problems, each a shared context with 8 branches (48 new tokens), then an
  evaluation of every branch that resends context + branch (12 new tokens).

Greedy decoding throughout. Prints requests/s for each system, the cache hit rate, and ratios.

    python benchmarks/bench_prefix.py [--model-path PATH]
"""

from __future__ import annotations

import argparse
import random
import time

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

    def __init__(self, kind: str, path: str):
        self.kind = kind
        if kind == "hf":
            import torch
            import transformers

            from loom.runtime.server_args import ServerArgs

            # the same thread count loom's scheduler uses, so neither side oversubscribes
            torch.set_num_threads(ServerArgs().effective_cpu_threads)

            self.tok = transformers.AutoTokenizer.from_pretrained(path)
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32
            ).eval()
        else:
            import loom

            self.engine = loom.Engine(
                path, disable_radix_cache=(kind == "loom-nocache"), random_seed=0
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


def run_few_shot(r: Runner) -> int:
    prefix = few_shot_prefix(r.tok, 1500)
    rng = random.Random(2)
    questions = [f"Q: What is the capital of {rng.choice(COUNTRIES)[0]}?\nA:" for _ in range(64)]
    r.generate([prefix + q for q in questions], 16)
    return len(questions)


def run_multi_turn(r: Runner) -> int:
    rng = random.Random(3)
    sessions = [[{"role": "system", "content": "You are a helpful assistant."}] for _ in range(16)]
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


def run_tree_of_thought(r: Runner) -> int:
    n = 0
    for p in range(4):
        c, _ = COUNTRIES[p]
        context = few_shot_prefix(r.tok, 400) + f"Problem: plan a trip to {c}.\n"
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled model")
    parser.add_argument("--systems", default="loom,loom-nocache,hf")
    args = parser.parse_args()
    from loom.runtime.server_args import BUNDLED_MODEL_PATH

    path = args.model_path or BUNDLED_MODEL_PATH
    results: dict[tuple[str, str], tuple[float, float]] = {}
    for kind in args.systems.split(","):
        r = Runner(kind, path)
        try:
            r.generate(["warm up"], 2)
            for name, fn in WORKLOADS.items():
                if kind != "hf":
                    r.engine.flush_cache()
                p0, c0 = r.stats()
                t = time.perf_counter()
                n = fn(r)
                elapsed = time.perf_counter() - t
                p1, c1 = r.stats()
                hit = (c1 - c0) / max(1, p1 - p0)
                results[(kind, name)] = (n / elapsed, hit)
                print(
                    f"{kind:13s} {name:16s} {n / elapsed:8.2f} req/s  {elapsed:7.2f} s  hit rate {100 * hit:5.1f}%",
                    flush=True,
                )
        finally:
            r.close()
    print("\nworkload          cache/no-cache   cache/HF   hit rate")
    for name in WORKLOADS:
        on = results.get(("loom", name))
        off = results.get(("loom-nocache", name))
        hf = results.get(("hf", name))
        if on is None:
            continue
        r_off = f"{on[0] / off[0]:8.2f}x" if off else "       -"
        r_hf = f"{on[0] / hf[0]:8.2f}x" if hf else "       -"
        print(f"{name:16s} {r_off}       {r_hf}   {100 * on[1]:5.1f}%")


if __name__ == "__main__":
    main()
