"""Decode GEMV of the quantized kernels (kernels/cpu/quant.c) at 1-8 token rows on a real
model's own blocks (SmolLM2-135M Q4_1 by default, `--gguf gemma3-270m` for Gemma 3's Q5_0 /
Q8_0 / Q4_K / Q6_K layers and its 262,144-row Q8_0 LM head; a later layer's matrix of another
type or shape than layer 0's is timed too, as key.L<layer>): time per call and GB/s of blocks
streamed, one thread, for each matrix of one layer and the tied LM head (the layer's matrices
repeated: cache-resident), and then a whole step's matmuls in the forward's order over all
layers and the LM head (streamed from the last-level cache or memory, as in a decode step).
A layer's rows of different block types (Gemma's q / k Q5_0, v Q8_0) are separate calls, as
the C forward's segments are (`qkv`, `qkv.1`).

    python benchmarks/bench_quant_gemv.py [--gguf smollm2] [--modes f32,int16] [--tokens 1,8]
        [--reps 200] [--threads 1] [--only lm_head]

Calls go through ctypes straight to loom_q_matmul (an empty ctypes call's cost is printed:
it is part of every figure). Times are the calling thread's CPU time (time.thread_time: a
shared machine's descheduling is not counted, its cache contention is), so use --threads 1.
Modes alternate per round: median [min, max] of --rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
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
            runs: list[list[QuantizedTensor]] = []  # consecutive tensors of one block type
            for t in ts:
                if runs and runs[-1][0].qtype == t.qtype:
                    runs[-1].append(t)
                else:
                    runs.append([t])
            for j, run in enumerate(runs):
                data = torch.cat([t.data for t in run]).contiguous()
                name = key if j == 0 else f"{key}.{j}"
                mats[name] = QuantizedTensor(run[0].qtype, (data.shape[0], run[0].shape[1]), data)
        out.append(mats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--modes", default="f32,int16")
    p.add_argument("--tokens", default="1", help="comma list of token rows per call (1..8: decode)")
    p.add_argument("--only", default="", help="comma list of matrices to time (qkv, lm_head, ...)")
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
    p.add_argument(
        "--bi-lanes",
        default="",
        help="comma list: bi mode once per loom_q_bi_lanes (0: the older GEMV / 8-token tile)",
    )
    p.add_argument(
        "--bi-avx2",
        default="",
        help="comma list: bi mode once per loom_q_bi_avx2 (AVX2 builds; 0: the portable C)",
    )
    p.add_argument(
        "--bi-kgemv",
        default="",
        help="comma list: bi mode once per loom_q_bi_kgemv (AVX2 builds, Q4_K / Q6_K at 1-4 tokens; 0: the tiles)",
    )
    p.add_argument(
        "--bi-gemv",
        default="",
        help="comma list: bi mode once per loom_q_bi_gemv (AVX2 builds, 1-4 tokens; 0: the row "
        "lanes / 8-token tiles)",
    )
    p.add_argument(
        "--bi-gemv1",
        default="",
        help="comma list: bi mode once per loom_q_bi_gemv1 (AVX2 builds, Q8_0 / Q5_0 at one token; "
        "0: quant_gemv_avx2.c)",
    )
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    path = args.gguf
    if not path.endswith(".gguf"):
        from loom.runtime.gguf.named import resolve_model_name

        path = resolve_model_name(path)
    model = model_mats(path)
    mats = {**model[0], **model[-1]}
    # matrices of later layers whose type or shape differs from layer 0's (Gemma 3 Q4_K_M: 9
    # layers' down are Q4_K, not Q6_K; their v is Q5_0 and joins qkv), timed as "key.L<i>"
    # (not in the per-layer sum below, which is layer 0's x the layer count)
    seen_kinds = {(k, qt.qtype, tuple(qt.shape)) for k, qt in model[0].items()}
    for i, m in enumerate(model[1:-1], start=1):
        for key, qt in m.items():
            if (key, qt.qtype, tuple(qt.shape)) not in seen_kinds:
                seen_kinds.add((key, qt.qtype, tuple(qt.shape)))
                mats[f"{key}.L{i}"] = qt
    lib = quant_ops.load()
    modes = args.modes.split(",")
    knob = ctypes.c_int.in_dll(lib, "loom_q_prefetch_rows")
    wide = ctypes.c_int.in_dll(lib, "loom_q_wide_rows")
    try:  # (a tree before quant_bi.c's bi_lanes has no such knob: this script A/Bs against it)
        lanes = ctypes.c_int.in_dll(lib, "loom_q_bi_lanes")
    except ValueError:
        lanes = ctypes.c_int(1)
    try:  # (likewise quant_bi_avx2.c's knob)
        avx2 = ctypes.c_int.in_dll(lib, "loom_q_bi_avx2")
    except ValueError:
        avx2 = ctypes.c_int(1)
    try:  # (likewise quant_gemv_k_avx2.c's and quant_gemv_avx2.c's knobs)
        kgemv = ctypes.c_int.in_dll(lib, "loom_q_bi_kgemv")
    except ValueError:
        kgemv = ctypes.c_int(1)
    try:
        gemv = ctypes.c_int.in_dll(lib, "loom_q_bi_gemv")
    except ValueError:
        gemv = ctypes.c_int(1)
    try:
        gemv1 = ctypes.c_int.in_dll(lib, "loom_q_bi_gemv1")
    except ValueError:
        gemv1 = ctypes.c_int(1)
    # mode -> (prefetch rows, wide rows, bi lanes, bi avx2, bi kgemv, bi gemv, bi gemv1)
    k0 = (knob.value, wide.value, lanes.value, avx2.value, kgemv.value, gemv.value, gemv1.value)
    pfs = {m: k0 for m in modes}
    for v in filter(None, args.prefetch_rows.split(",")):
        pfs[f"f32@{v}"] = (int(v), *k0[1:])
    for v in filter(None, args.wide_rows.split(",")):
        pfs[f"f32w{v}"] = (k0[0], int(v), *k0[2:])
    for v in filter(None, args.bi_lanes.split(",")):
        pfs[f"bi#{v}"] = (*k0[:2], int(v), *k0[3:])
    for v in filter(None, args.bi_avx2.split(",")):
        # 0: the portable C for all (the K-type GEMV off too)
        pfs[f"bi~{v}"] = (*k0[:3], int(v), *(k0[4:] if int(v) else (0, 0, 0)))
    for v in filter(None, args.bi_kgemv.split(",")):
        pfs[f"bi^{v}"] = (*k0[:4], int(v), *k0[5:])
    for v in filter(None, args.bi_gemv.split(",")):
        pfs[f"bi%{v}"] = (*k0[:5], int(v), k0[6])
    for v in filter(None, args.bi_gemv1.split(",")):
        pfs[f"bi!{v}"] = (*k0[:6], int(v))
    modes = list(pfs)
    if args.only:
        mats = {k: v for k, v in mats.items() if k in args.only.split(",")}
    print(f"{path}: threads {args.threads}, load {os.getloadavg()}")
    empty = lib.loom_q_vnni
    t0 = time.perf_counter()
    for _ in range(10000):
        empty()
    print(f"empty ctypes call: {(time.perf_counter() - t0) / 10000 * 1e9:.0f} ns")
    for T in [int(v) for v in args.tokens.split(",")]:
        knobs = (knob, wide, lanes, avx2, kgemv, gemv, gemv1)
        run_tokens(lib, model, mats, modes, pfs, knobs, T, args)
    print(f"load after {os.getloadavg()}")


def run_tokens(lib, model, mats, modes, pfs, knobs, T: int, args) -> None:
    """Every mode at T token rows: the per-matrix and the whole-step figures."""
    print(f"T={T}, load {os.getloadavg()}")
    res: dict[tuple[str, str], list[float]] = {}
    keep: list = []

    def call(mode: str, qt: QuantizedTensor) -> tuple:
        n, k = qt.shape
        x, y = torch.randn(T, k), torch.empty(T, n)
        keep.append((x, y))
        return (
            quant_ops.QTYPES[qt.qtype], quant_ops.MODES[re.split("[@w#~^%!]", mode)[0]], qt.data.data_ptr(), n, k,
            qt.row_bytes, x.data_ptr(), T, k, None, y.data_ptr(), n, 0, args.threads,
        )  # fmt: skip

    whole = not args.only
    token = {mode: [call(mode, qt) for m in model for qt in m.values()] for mode in modes}
    for _ in range(args.rounds):
        for mode in modes:
            for k, v in zip(knobs, pfs[mode]):
                k.value = v
            if whole:
                for c in token[mode]:  # a warm-up pass
                    lib.loom_q_matmul(*c)
                t0 = time.thread_time()
                for _ in range(args.token_reps):
                    for c in token[mode]:
                        lib.loom_q_matmul(*c)
                res.setdefault((mode, "token"), []).append(
                    (time.thread_time() - t0) / args.token_reps
                )
            for key, qt in mats.items():
                n, k = qt.shape
                c = call(mode, qt)
                reps = max(5, args.reps * 576 * 576 // (n * k))
                for _ in range(3):
                    lib.loom_q_matmul(*c)
                t0 = time.thread_time()
                for _ in range(reps):
                    lib.loom_q_matmul(*c)
                res.setdefault((mode, key), []).append((time.thread_time() - t0) / reps)
    layers = len(model) - 1
    for mode in modes:
        total = 0.0
        for key, qt in mats.items():
            med = statistics.median(res[(mode, key)])
            gbs = qt.data.numel() / med / 1e9
            # multiply-adds per second: N * K * T over the call's time
            gmacs = qt.shape[0] * qt.shape[1] * T / med / 1e9
            print(
                f"T={T} {mode:6} {key:8} {qt.qtype} {tuple(qt.shape)!s:14} {med * 1e6:9.1f} us "
                f"[{min(res[(mode, key)]) * 1e6:.1f}, {max(res[(mode, key)]) * 1e6:.1f}]"
                f"  {gbs:5.2f} GB/s {gmacs:6.1f} GMAC/s"
            )
            if ".L" not in key:
                total += med * (1 if key == "lm_head" else layers)
        if not whole:
            continue
        print(f"T={T} {mode:6} sum of the above x {layers} layers + LM head: {total * 1e3:.2f} ms")
        tok = res[(mode, "token")]
        nbytes = sum(qt.data.numel() for m in model for qt in m.values())
        print(
            f"T={T} {mode:6} whole step, all {layers} layers + LM head in order: "
            f"{statistics.median(tok) * 1e3:.2f} ms [{min(tok) * 1e3:.2f}, {max(tok) * 1e3:.2f}]"
            f"  {nbytes / statistics.median(tok) / 1e9:.2f} GB/s"
        )


if __name__ == "__main__":
    main()
