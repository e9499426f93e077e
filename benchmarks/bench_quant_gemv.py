"""Batch-1 decode GEMV of the quantized kernels (kernels/cpu/quant.c) on SmolLM2-135M's own
blocks: ns per call and GB/s of blocks streamed, one thread, for each matrix of one layer and
the tied LM head, and the whole model's per-token matmul time (30 layers + LM head).

    python benchmarks/bench_quant_gemv.py [--gguf smollm2] [--modes f32,int16] [--tokens 1]
        [--reps 200] [--threads 1]

Calls go through ctypes straight to loom_q_matmul (an empty ctypes call's cost is printed:
it is part of every figure). Times are the calling thread's CPU time (time.thread_time: a
shared machine's descheduling is not counted, its cache contention is), so use --threads 1.
Modes alternate per round: median [min, max] of --rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import QuantizedTensor


def layer_mats(path: str) -> dict[str, QuantizedTensor]:
    """{qkv, o, gate_up, down, lm_head} of layer 0 as the C forward multiplies them (q, k, v
    rows stacked; gate, up rows stacked)."""
    from loom.runtime.gguf.weights import iterate_gguf_weights

    want = {
        "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
        "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
    }  # fmt: skip
    parts: dict[str, list[QuantizedTensor]] = {}
    for name, t in iterate_gguf_weights(path, keep_quantized=True):
        if not isinstance(t, QuantizedTensor):
            continue
        if name == "model.embed_tokens.weight":
            parts["lm_head"] = [t]
        elif name.startswith("model.layers.0."):
            key = want.get(name.split(".")[-2])
            if key:
                parts.setdefault(key, []).append(t)
    out = {}
    for key in ("qkv", "o", "gate_up", "down", "lm_head"):
        ts = parts[key]
        data = torch.cat([t.data for t in ts]).contiguous()
        out[key] = QuantizedTensor(ts[0].qtype, (data.shape[0], ts[0].shape[1]), data)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--modes", default="f32,int16")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    path = args.gguf
    if not path.endswith(".gguf"):
        from loom.runtime.gguf.named import resolve_model_name

        path = resolve_model_name(path)
    mats = layer_mats(path)
    lib = quant_ops.load()
    modes = args.modes.split(",")
    T = args.tokens
    print(f"{path}: T={T}, threads {args.threads}, load {os.getloadavg()}")
    empty = lib.loom_q_vnni
    t0 = time.perf_counter()
    for _ in range(10000):
        empty()
    print(f"empty ctypes call: {(time.perf_counter() - t0) / 10000 * 1e9:.0f} ns")
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for mode in modes:
            for key, qt in mats.items():
                n, k = qt.shape
                x = torch.randn(T, k)
                y = torch.empty(T, n)
                call = (
                    quant_ops.QTYPES[qt.qtype], quant_ops.MODES[mode], qt.data.data_ptr(), n, k,
                    qt.row_bytes, x.data_ptr(), T, k, None, y.data_ptr(), n, 0, args.threads,
                )  # fmt: skip
                reps = max(5, args.reps * 576 * 576 // (n * k))
                for _ in range(3):
                    lib.loom_q_matmul(*call)
                t0 = time.thread_time()
                for _ in range(reps):
                    lib.loom_q_matmul(*call)
                res.setdefault((mode, key), []).append((time.thread_time() - t0) / reps)
    layers = 30
    for mode in modes:
        total = 0.0
        for key, qt in mats.items():
            med = statistics.median(res[(mode, key)])
            gbs = qt.data.numel() / med / 1e9
            print(
                f"{mode:6} {key:8} {qt.qtype} {tuple(qt.shape)!s:14} {med * 1e6:8.1f} us "
                f"[{min(res[(mode, key)]) * 1e6:.1f}, {max(res[(mode, key)]) * 1e6:.1f}]"
                f"  {gbs:5.2f} GB/s"
            )
            total += med * (1 if key == "lm_head" else layers)
        print(f"{mode:6} per-token matmuls (30 layers + LM head): {total * 1e3:.2f} ms")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
