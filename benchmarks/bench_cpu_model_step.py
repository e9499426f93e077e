"""Per-step cost of the C forward's two bindings on one GGUF model: runtime/cpu_forward.py
(torch tensors, as the scheduler calls it) against runtime/cpu_model.py (numpy arrays, no torch).

Both run the same C function on the same weights; what differs is the Python around the call
(building the step's index arrays, the logits' allocation). Each round decodes --steps tokens
at batch --batch after a --context-token prefill, first with one binding then the other
(alternating, the order swapped every round); prints each round's ms per step and the median.

    python benchmarks/bench_cpu_model_step.py [--gguf smollm2] [--batch 1] [--context 128]
        [--steps 64] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from loom.runtime.cpu_model import ArrayForward
from loom.runtime.gguf.named import resolve_model_name
from loom.runtime.model_runner import ModelRunner
from loom.runtime.server_args import ServerArgs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    path = a.gguf if a.gguf.endswith(".gguf") else resolve_model_name(a.gguf)
    torch.set_num_threads(a.threads)
    slots = a.batch * (a.context + a.steps) + 64
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=slots))
    cf = runner.cpu_forward
    rows = runner.model.model.layers[0].self_attn.rotary_emb.cos_cache.shape[0]
    kv = "bf16" if runner.token_to_kv_pool.k_buffers[0].dtype == torch.bfloat16 else "float32"
    af = ArrayForward(path, kv_rows=slots, max_reqs=a.batch + 1,
                      max_context=runner.req_to_token_pool.req_to_token.shape[1],
                      kv_dtype=kv, rotary_rows=rows)  # fmt: skip
    span = a.context + a.steps
    table = runner.req_to_token_pool.req_to_token
    for r in range(a.batch):
        table[r + 1, :span] = torch.arange(1 + r * span, 1 + (r + 1) * span)
        af.req_to_token[r + 1, :span] = np.arange(1 + r * span, 1 + (r + 1) * span)
    reqs = list(range(1, a.batch + 1))
    rng = np.random.default_rng(0)
    ids = rng.integers(100, 40000, size=(a.batch, span)).tolist()

    def step_args(q: int):  # positions q .. of every request (q == 0: the prefill)
        n = a.context if q == 0 else 1
        tok = [t for r in range(a.batch) for t in ids[r][q : q + n]]
        pos = [j for _ in range(a.batch) for j in range(q, q + n)]
        slot = [1 + r * span + j for r in range(a.batch) for j in range(q, q + n)]
        return (
            tok,
            pos,
            slot,
            reqs,
            [q + n] * a.batch,
            [n] * a.batch,
            [(r + 1) * n - 1 for r in range(a.batch)],
        )

    def torch_call(tok, pos, slot, rws, seq, ext, want):
        batch = SimpleNamespace(
            seq_lens_cpu=seq, extend_lens_cpu=ext, custom_masks=None, capture=None,
            input_ids=torch.tensor(tok), positions=torch.tensor(pos),
            out_cache_loc=torch.tensor(slot), req_pool_indices=torch.tensor(rws),
            req_to_token_pool=runner.req_to_token_pool, logits_indices=torch.tensor(want),
        )  # fmt: skip
        return cf(batch)

    def numpy_call(*args):
        return af(*args, nthreads=a.threads)

    def run(fn) -> float:
        fn(*step_args(0))
        t = time.perf_counter()
        for q in range(a.context, a.context + a.steps):
            fn(*step_args(q))
        return 1e3 * (time.perf_counter() - t) / a.steps

    res = {"torch (cpu_forward)": [], "numpy (cpu_model)": []}
    sides = list(zip(res, (torch_call, numpy_call)))
    for i in range(a.rounds):
        for name, fn in sides if i % 2 == 0 else sides[::-1]:
            res[name].append(run(fn))
    for name, ms in res.items():
        print(f"{name:20} ms/step median {statistics.median(ms):6.2f}  rounds "
              + " ".join(f"{m:.2f}" for m in ms))  # fmt: skip
    t, n = (statistics.median(v) for v in res.values())
    print(f"numpy / torch time per step: {n / t:.3f}")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
