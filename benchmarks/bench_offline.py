"""Offline throughput: loom's Engine beside HF transformers `generate` on the same requests.

64 requests, prompts of 10-400 tokens, 8-128 new tokens each (greedy, ignore_eos). HF runs
them once as one padded static batch (which must run to the longest output) and once one
request at a time. Prints useful tokens/s (only each request's own new tokens count), the
ratios, and the share of decode-step time spent outside the model forward at the largest
decode batch.

    python benchmarks/bench_offline.py [--model-path PATH] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import os
import random
import time


def make_requests(tokenizer, n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2)[:2000] or ["the"]
    reqs = []
    for _ in range(n):
        target = rng.randint(10, 400)
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" " + rng.choice(words))
        reqs.append((ids[:target], rng.randint(8, 128)))
    return reqs


def bench_loom(model_path, reqs, max_running, threads):
    import loom

    engine = loom.Engine(
        model_path, max_running_requests=max_running, random_seed=0, cpu_threads=threads
    )
    try:
        engine.generate(input_ids=[reqs[0][0]], sampling_params={"max_new_tokens": 4})  # warm-up
        engine.flush_cache()
        params = [{"max_new_tokens": m, "temperature": 0, "ignore_eos": True} for _, m in reqs]
        t = time.perf_counter()
        outs = engine.generate(input_ids=[p for p, _ in reqs], sampling_params=params)
        elapsed = time.perf_counter() - t
        info = engine.get_server_info()
    finally:
        engine.shutdown()
    useful = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert useful == sum(m for _, m in reqs)
    timing = {int(k): v for k, v in info["decode_timing"].items()}
    return useful / elapsed, elapsed, timing


def bench_hf_static(model, reqs, pad_id):
    import torch

    longest = max(len(p) for p, _ in reqs)
    ids = torch.full((len(reqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, _) in enumerate(reqs):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    max_new = max(m for _, m in reqs)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - t
    return sum(m for _, m in reqs) / elapsed, elapsed


def bench_hf_serial(model, reqs, pad_id):
    import torch

    t = time.perf_counter()
    with torch.inference_mode():
        for p, m in reqs:
            model.generate(
                input_ids=torch.tensor([p]),
                max_new_tokens=m,
                min_new_tokens=m,
                do_sample=False,
                pad_token_id=pad_id,
            )
    elapsed = time.perf_counter() - t
    return sum(m for _, m in reqs) / elapsed, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled model")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-serial", action="store_true", help="skip HF one-at-a-time")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads for both (default: loom's default)"
    )
    args = parser.parse_args()

    import torch
    import transformers

    from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs

    threads = args.threads or ServerArgs().effective_cpu_threads
    torch.set_num_threads(threads)

    path = args.model_path or BUNDLED_MODEL_PATH
    tok = transformers.AutoTokenizer.from_pretrained(path)
    reqs = make_requests(tok, args.num_requests, args.seed)
    print(
        f"model {path}\n{len(reqs)} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
        f"useful new tokens {sum(m for _, m in reqs)}, torch threads {torch.get_num_threads()}"
    )

    loom_tps, loom_s, timing = bench_loom(path, reqs, args.num_requests, threads)
    print(f"loom Engine            {loom_tps:9.1f} tok/s  ({loom_s:.2f} s)")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    static_tps, static_s = bench_hf_static(hf, reqs, pad)
    print(f"HF static batch        {static_tps:9.1f} tok/s  ({static_s:.2f} s)")
    if not args.skip_serial:
        serial_tps, serial_s = bench_hf_serial(hf, reqs, pad)
        print(f"HF one at a time       {serial_tps:9.1f} tok/s  ({serial_s:.2f} s)")
    print(f"ratio vs static batch  {loom_tps / static_tps:9.2f}x")
    if not args.skip_serial:
        print(f"ratio vs one-at-a-time {loom_tps / serial_tps:9.2f}x")
    bs = max(timing)
    steps, step_s, fwd_s = timing[bs]
    print(
        f"decode batch {bs}: {steps} steps, {1000 * step_s / steps:.2f} ms/step, "
        f"outside the model forward {100 * (1 - fwd_s / step_s):.1f}%"
    )
    steps, step_s, fwd_s = (sum(v[i] for v in timing.values()) for i in range(3))
    print(
        f"all decode steps (batch 1-{bs}): {steps} steps, {1000 * step_s / steps:.2f} ms/step, "
        f"outside the model forward {100 * (1 - fwd_s / step_s):.1f}%"
    )
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
