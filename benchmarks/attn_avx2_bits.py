"""Greedy tokens and logprobs of a real GGUF model with the AVX2 one-token attention
(kernels/cpu/attn_avx2.c, loom_attn_avx2 = 1) and with attn_items' per-token loop (0), in one
build: B requests of random prompts of different lengths, greedy, output logprobs with the top
5, in one in-process scheduler (the radix cache off, the model's default KV pool: bfloat16 for
a GGUF model in the C forward). Prints whether every token and logprob is equal.

    python benchmarks/attn_avx2_bits.py [--model smollm2] [--batch 8] [--tg 24]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import sys
from pathlib import Path

# this bench reads the torch runner's CpuForward (its library, knobs, timers): a GGUF model
# would otherwise get the torch-free ArrayRunner (runtime/runner_choice.py)
os.environ.setdefault("LOOM_TORCH_RUNNER", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_step_overhead import model_path  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tg", type=int, default=24)
    a = p.parse_args()
    from tests.runtime_helpers import make_scheduler, run_all, submit

    sched = make_scheduler(
        model_path(a.model), quantization="gguf", dtype="auto", cpu_threads=1,
        disable_radix_cache=True, max_running_requests=a.batch,
    )  # fmt: skip
    knob = ctypes.c_int.in_dll(sched.runner.cpu_forward.lib, "loom_attn_avx2")
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 150))]
               for _ in range(a.batch)]  # fmt: skip
    params = {"max_new_tokens": a.tg, "temperature": 0, "ignore_eos": True}
    out = {}
    for v in (0, 1):
        knob.value = v
        for i, ids in enumerate(prompts):
            submit(sched, f"{v}.{i}", ids, params, return_logprob=True, top_logprobs_num=5)
        res = run_all(sched)
        out[v] = [res[f"{v}.{i}"] for i in range(a.batch)]
    same_ids = all(x.ids == y.ids for x, y in zip(out[0], out[1]))
    same_lp = all(
        x.output_logprobs == y.output_logprobs and x.output_top == y.output_top
        for x, y in zip(out[0], out[1])
    )
    n = sum(len(x.ids) for x in out[0])
    assert all(len(x.output_logprobs) == len(x.ids) == a.tg for x in out[0] + out[1])
    print(f"{model_path(a.model)}: {a.batch} requests, {n} tokens: tokens equal {same_ids}, "
          f"logprobs (and top 5) equal {same_lp}")  # fmt: skip


if __name__ == "__main__":
    main()
