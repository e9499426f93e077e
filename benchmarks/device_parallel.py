"""Prepared GPU check for the parallel workers (run it on a machine lent with CUDA GPUs).

1. Correctness on CUDA (NCCL): the tiny Llama (6 heads / 2 KV heads) served with --tp-size 2
   gives the same greedy tokens as --tp-size 1, and prompt logprobs within 1e-3 (float32).
2. Speed: bench_parallel's workload on the 0.5B-shaped model (benchmarks/common.py), TP=1 vs
   TP=2, alternating rounds, ratios with their ranges, per-rank weight/KV bytes.

Needs 2 GPUs for TP=2 (NCCL puts one rank on each); with one GPU it runs the TP=1 half and
exits 2 saying so. Bounded: every step has a timeout; total well under 10 minutes.

    timeout 540 python benchmarks/device_parallel.py [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import common

sys.path.insert(0, str(common.REPO))


def tiny_model(root: Path) -> str:
    import torch
    import transformers as tf

    from tests.tiny_models import MODEL_VOCAB, build_tokenizer, random_model

    folder = root / "llama-6h"
    torch.manual_seed(3)
    config = tf.LlamaConfig(
        vocab_size=MODEL_VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    random_model(config).save_pretrained(folder)
    build_tokenizer(folder)
    return str(folder)


def greedy(engine, prompts):
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    out = engine.generate(
        input_ids=prompts, sampling_params=params, return_logprob=True, logprob_start_len=0
    )
    return [
        (o["output_ids"], [t[0] for t in o["meta_info"]["input_token_logprobs"][1:]]) for o in out
    ]


def throughput(engine, prompts, new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start


def main() -> int:
    import torch

    import loom

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    gpus = torch.cuda.device_count()
    print(common.header("device_parallel"), f"| {gpus} GPU(s)")
    results: dict = {"gpus": gpus}
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 300) for _ in range(rng.randint(5, 40))] for _ in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        path = tiny_model(Path(tmp))
        layouts = [1, 2] if gpus >= 2 else [1]
        got = {}
        for tp in layouts:
            with loom.Engine(path, device="cuda", tp_size=tp, max_total_tokens=4096) as e:
                got[tp] = greedy(e, prompts)
        if 2 in got:
            same = all(a[0] == b[0] for a, b in zip(got[1], got[2]))
            diff = max(abs(x - y) for a, b in zip(got[1], got[2]) for x, y in zip(a[1], b[1]))
            print(
                f"CUDA TP2 vs TP1: greedy ids identical {same}, max prompt-logprob diff {diff:.2e}"
            )
            results.update(tp2_same_ids=same, tp2_max_logprob_diff=diff)
    big = common.model_path("qwen0.5b-bf16")
    work = [[rng.randrange(10, 4000) for _ in range(512)] for _ in range(64)]
    engines = {}
    try:
        for tp in layouts:
            engines[f"TP{tp}"] = e = loom.Engine(big, device="cuda", tp_size=tp)
            throughput(e, work[:4], 4)  # warm-up
        runs = {k: (lambda e=e: throughput(e, work, 128)) for k, e in engines.items()}
        times = common.alternate(runs, args.rounds)
        memory = {k: e.get_server_info()["parallel"]["ranks"] for k, e in engines.items()}
    finally:
        for e in engines.values():
            e.shutdown()
    tokens = len(work) * (512 + 128)
    for k, ts in times.items():
        print(f"{k}: median {tokens / sorted(ts)[len(ts) // 2]:.0f} tok/s; ranks {memory[k]}")
    results.update(times=times, memory=memory)
    if "TP2" in times:
        print(f"TP2 / TP1 throughput: {common.fmt_ratio(times['TP1'], times['TP2'])}")
    Path(args.out, "device_parallel.json").write_text(json.dumps(results, indent=1))
    if gpus < 2:
        print("TP=2 needs 2 GPUs (one NCCL rank per GPU); only TP=1 ran")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
