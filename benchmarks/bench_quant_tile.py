"""Single-thread micro-benchmark of the quantized multi-token matmuls (kernels/cpu/quant.c,
quant_bi.c) on SmolLM2-135M's shapes, against loom's f32 packed-panel GEMM (forward.c) on the
same weights dequantized: GFLOP/s of each kernel at T tokens, and ns per weight block.

    python benchmarks/bench_quant_tile.py [--qtype Q4_1] [--tokens 1,8,16,32,128]

Modes: "f32" (dequantize 4 rows to f32, 4x4 FMA tile: the T > 8 path of "int16"), "int16"
(16-bit GEMV up to 8 tokens, then "f32"), "bi" (quant_bi.c: batch-invariant 16-bit activations
for every T), and "dense" (loom_linear_packed_f32 on f32 weights packed once).
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch

from loom.kernels.quant_ref import dequantize_ref, quantize_ref
from loom.runtime import cpu_forward, native
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import BLOCKS, QuantizedTensor

# (K, N) of SmolLM2-135M's matmuls: q/o, k/v, gate/up, down, LM head
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


def timed(fn, min_time: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    best = float("inf")
    while time.perf_counter() - t0 < min_time or n < 3:
        s = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - s)
        n += 1
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--qtype", default="Q4_1")
    ap.add_argument("--tokens", default="1,8,16,32,128")
    ap.add_argument("--modes", default="f32,int16,bi,dense")
    ap.add_argument("--shapes", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lib = native.load("native")
    tokens = [int(t) for t in a.tokens.split(",")]
    modes = a.modes.split(",")
    shapes = (
        SHAPES if not a.shapes else [tuple(map(int, s.split("x"))) for s in a.shapes.split(",")]
    )
    print(f"bench_quant_tile: {a.qtype}, one thread, load {os.getloadavg()}")
    print("K x N        T   " + "".join(f"{m:>22}" for m in modes) + "   (GFLOP/s, ns/block)")
    for K, N in shapes:
        w = torch.randn(N, K) * 0.05
        qt = QuantizedTensor(a.qtype, (N, K), quantize_ref(w, a.qtype))
        wd = dequantize_ref(qt.qtype, qt.data, qt.shape).contiguous()
        wp = cpu_forward.pack(wd)
        nblocks = N * K // BLOCKS[a.qtype][0]
        for T in tokens:
            x = torch.randn(T, K)
            y = torch.empty(T, N)
            cells = []
            for m in modes:
                if m == "dense":
                    args = (x.data_ptr(), T, K, wp.data_ptr(), None, N, y.data_ptr(), 1)
                    fn = partial(lib.loom_linear_packed_f32, *args)
                else:
                    args = (
                        quant_ops.QTYPES[a.qtype],
                        quant_ops.MODES[m],
                        qt.data.data_ptr(),
                        N,
                        K,
                        qt.row_bytes,
                        x.data_ptr(),
                        T,
                        K,
                        None,
                        y.data_ptr(),
                        N,
                        0,
                        1,
                    )
                    fn = partial(lib.loom_q_matmul, *args)
                s = timed(fn)
                cells.append(f"{2 * N * K * T / s / 1e9:8.1f} {s / nblocks * 1e9:8.2f}ns")
            print(f"{K:5d}x{N:<6d} {T:4d}   " + "".join(f"{c:>22}" for c in cells), flush=True)
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()
