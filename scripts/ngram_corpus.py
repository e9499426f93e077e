"""A datastore of SmolLM2's own greedy answers to prompts it wrote, for n-gram drafting (issue 33).

    python scripts/ngram_corpus.py generate [--minutes 30] [--tokens 300000] \\
        [--spec-bench /work/data/question.jsonl]

REST / SuffixDecoding's idea: a small instruct model's greedy answers are formulaic, so its
answers to *other* prompts may predict its answer here. Everything lives in `--cache`
(default ~/.cache/loom/ngram_corpus/), `corpus.jsonl`, one document a line (`batch`,
`prompt` text, `prompt_ids`, `answer` ids), appended a batch at a time, so an interrupted
run loses at most the batch in flight and a rerun continues after the last batch.

A batch (`--batch`, default 64): the data model (`--data-model`, default `smollm2`: the
Q4_1 GGUF on one thread, the in-process scheduler of `runtime/spec/eagle_data.py`) writes
prompts from `eagle3_smollm2_data.py`'s SEED_TOPICS x ASKS (temperature 0.9, a seed per
request, <= 48 tokens, first line); a prompt is dropped when seen before or when any of its
token 8-grams occurs in Spec-Bench's questions (`--spec-bench`; counted); then its greedy
answers (<= `--max-new-tokens`), the whole batch in flight. No Spec-Bench text is a source.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CACHE = Path("~/.cache/loom/ngram_corpus").expanduser()


def generate(args) -> None:
    from eagle3_smollm2_data import ASKS, SEED_TOPICS, _chat, written_prompts
    from train_eagle3_smollm2 import spec_bench_grams

    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.spec.eagle_data import _scheduler, run_all
    from loom.runtime.tokenizer import load_tokenizer

    path = args.cache / "corpus.jsonl"
    tok = load_tokenizer(os.path.expanduser(args.tokenizer))
    seen: set[str] = set()
    tokens, last = 0, 0
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                seen.add(d["prompt"].strip().lower())
                tokens += len(d["answer"])
                last = max(last, d["batch"])
    grams = spec_bench_grams(tok, args.spec_bench) if args.spec_bench else set()
    sched = _scheduler(args.data_model, 1, args.batch, False, args.batch * 1024)
    asks = [a.format(t=t) for t in SEED_TOPICS for a in ASKS]

    def run(prompts, max_new, temperature, seeds):
        reqs = [
            TokenizedGenerateReq(
                rid=f"g{i}", input_ids=p, seed=seeds[i],
                sampling_params=make_sampling_params(
                    {"temperature": temperature, "max_new_tokens": max_new}),
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        got = run_all(sched, reqs)
        return [got[f"g{i}"]["ids"] for i in range(len(prompts))]

    t_end = time.time() + args.minutes * 60
    dropped_sb = 0
    k = last
    while time.time() < t_end and tokens < args.tokens:
        k += 1
        rng = random.Random(k)
        group = [rng.choice(asks) for _ in range(args.batch)]
        t0 = time.time()
        outs = run([_chat(tok, g) for g in group], 48, 0.9, [k * 100_000 + i for i in range(args.batch)])  # fmt: skip
        prompts, dropped = written_prompts(tok, outs, grams, seen, by_text=True)
        dropped_sb += dropped
        t1 = time.time()
        answers = run([ids for _, ids in prompts], args.max_new_tokens, 0.0, [0] * len(prompts))
        t2 = time.time()
        n_tok = 0
        with path.open("a") as f:
            for (text, ids), ans in zip(prompts, answers):
                f.write(json.dumps({"batch": k, "prompt": text, "prompt_ids": ids, "answer": ans}) + "\n")  # fmt: skip
                n_tok += len(ans)
        tokens += n_tok
        print(f"batch {k}: {len(prompts)} documents, {n_tok} answer tokens ({tokens} in all); "
              f"prompts {t1 - t0:.1f} s, answers {t2 - t1:.1f} s; dropped for Spec-Bench "
              f"8-grams {dropped_sb} so far; loadavg {[round(x, 1) for x in os.getloadavg()]}",
              flush=True)  # fmt: skip
    sched.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=CACHE)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("--data-model", default="smollm2", help="writes prompts and answers")
    g.add_argument("--tokenizer", default="~/.cache/loom/models/smollm2-135m-f32")
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--minutes", type=float, default=30)
    g.add_argument("--tokens", type=int, default=300_000)
    g.add_argument("--spec-bench", type=Path, default=None, help="question.jsonl (a filter)")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    {"generate": generate}[args.cmd](args)


if __name__ == "__main__":
    main()
