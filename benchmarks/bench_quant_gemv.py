"""Batch-1 decode GEMV of the quantized kernels (kernels/cpu/quant.c) on SmolLM2-135M's own
blocks: time per call and GB/s of blocks streamed, one thread, for each matrix of one layer and
the tied LM head (the layer's matrices repeated: cache-resident), and then a whole token's
matmuls in the forward's order over all 30 layers and the LM head (96 MB of blocks: streamed
from the last-level cache or memory, as in a decode step).

    python benchmarks/bench_quant_gemv.py [--gguf smollm2] [--modes f32,int16] [--tokens 1]
        [--reps 200] [--threads 1]

Calls go through ctypes straight to loom_q_matmul (an empty ctypes call's cost is printed:
it is part of every figure). Times are the calling thread's CPU time (time.thread_time: a
shared machine's descheduling is not counted, its cache contention is), so use --threads 1.
Modes alternate per round: median [min, max] of --rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import QuantizedTensor


def model_mats(path: str) -> list[dict[str, QuantizedTensor]]:
    """Per layer {qkv, o, gate_up, down} as the C forward multiplies them (q, k, v rows
    stacked; gate, up rows stacked), the last entry {lm_head}."""
    from loom.runtime.gguf.weights import iterate_gguf_weights

    want = {
        "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
        "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
    }  # fmt: skip
    parts: dict[int, dict[str, list[QuantizedTensor]]] = {}
    for name, t in iterate_gguf_weights(path, keep_quantized=True):
        if not isinstance(t, QuantizedTensor):
            continue
        if name == "model.embed_tokens.weight":
            parts.setdefault(-1, {})["lm_head"] = [t]
        elif name.startswith("model.layers."):
            key = want.get(name.split(".")[-2])
            if key:
                parts.setdefault(int(name.split(".")[2]), {}).setdefault(key, []).append(t)
    out = []
    for layer in sorted(parts, key=lambda i: (i < 0, i)):
        mats = {}
        for key, ts in parts[layer].items():
            data = torch.cat([t.data for t in ts]).contiguous()
            mats[key] = QuantizedTensor(ts[0].qtype, (data.shape[0], ts[0].shape[1]), data)
        out.append(mats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--modes", default="f32,int16")
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--token-reps", type=int, default=20)
    p.add_argument(
        "--prefetch-rows", default="", help="comma list: f32 mode once per loom_q_prefetch_rows"
    )
    p.add_argument(
        "--wide-rows",
        default="",
        help="comma list: f32 mode once per loom_q_wide_rows (T > 4; 0 = two passes of 4 tokens)",
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    path = args.gguf
    if not path.endswith(".gguf"):
        from loom.runtime.gguf.named import resolve_model_name

        path = resolve_model_name(path)
    model = model_mats(path)
    mats = {**model[0], **model[-1]}
    lib = quant_ops.load()
    modes = args.modes.split(",")
    knob = ctypes.c_int.in_dll(lib, "loom_q_prefetch_rows")
    wide = ctypes.c_int.in_dll(lib, "loom_q_wide_rows")
    pfs = {m: (knob.value, wide.value) for m in modes}  # mode -> (prefetch rows, wide rows)
    for v in filter(None, args.prefetch_rows.split(",")):
        pfs[f"f32@{v}"] = (int(v), wide.value)
    for v in filter(None, args.wide_rows.split(",")):
        pfs[f"f32w{v}"] = (knob.value, int(v))
    modes = list(pfs)
    T = args.tokens
    print(f"{path}: T={T}, threads {args.threads}, load {os.getloadavg()}")
    empty = lib.loom_q_vnni
    t0 = time.perf_counter()
    for _ in range(10000):
        empty()
    print(f"empty ctypes call: {(time.perf_counter() - t0) / 10000 * 1e9:.0f} ns")
    res: dict[tuple[str, str], list[float]] = {}

    def calls(mode: str, qt: QuantizedTensor) -> tuple:
        n, k = qt.shape
        x, y = torch.randn(T, k), torch.empty(T, n)
        keep.append((x, y))
        return (
            quant_ops.QTYPES[qt.qtype], quant_ops.MODES[mode.split("@")[0].split("w")[0]], qt.data.data_ptr(), n, k,
            qt.row_bytes, x.data_ptr(), T, k, None, y.data_ptr(), n, 0, args.threads,
        )  # fmt: skip

    keep: list = []
    token = {mode: [calls(mode, qt) for mats in model for qt in mats.values()] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            knob.value, wide.value = pfs[mode]
            for c in token[mode]:  # a warm-up pass
                lib.loom_q_matmul(*c)
            t0 = time.thread_time()
            for _ in range(args.token_reps):
                for c in token[mode]:
                    lib.loom_q_matmul(*c)
            res.setdefault((mode, "token"), []).append((time.thread_time() - t0) / args.token_reps)
            for key, qt in mats.items():
                n, k = qt.shape
                x = torch.randn(T, k)
                y = torch.empty(T, n)
                call = (
                    quant_ops.QTYPES[qt.qtype], quant_ops.MODES[mode.split("@")[0].split("w")[0]], qt.data.data_ptr(), n, k,
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
        print(f"{mode:6} sum of the above x 30 layers + LM head: {total * 1e3:.2f} ms")
        tok = res[(mode, "token")]
        nbytes = sum(qt.data.numel() for mats in model for qt in mats.values())
        print(
            f"{mode:6} whole token, all {len(model) - 1} layers + LM head in order: "
            f"{statistics.median(tok) * 1e3:.2f} ms [{min(tok) * 1e3:.2f}, {max(tok) * 1e3:.2f}]"
            f"  {nbytes / statistics.median(tok) / 1e9:.2f} GB/s"
        )
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
