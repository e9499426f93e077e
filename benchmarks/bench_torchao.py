"""torchao's weight-only CPU kernels against loom's quantized matmul (kernels/cpu/quant.c), on
SmolLM2-135M's matrix shapes, one thread: the measurement behind docs/architecture.md's
"Libraries weighed" (issue 32 asks to weigh torchao before writing kernels by hand).

    python benchmarks/bench_torchao.py [--tokens 1,8,32] [--reps 50] [--rounds 3]

Per shape and token count: torch f32 (nn.Linear), torch bf16, torchao Int8WeightOnlyConfig
(f32 and bf16 activations), torchao Int4WeightOnlyConfig (every packing format this torchao
accepts on the CPU, else the reason printed), and loom's Q8_0 / Q4_0 blocks of the same weight
(mode auto). Each a median of --rounds of --reps calls' CPU time (time.thread_time), the
variants alternating per round; the error of each against f32 on the same input is printed
(max |diff| / max |f32|). torchao is not a loom dependency: `pip install torchao`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from loom.kernels.quant_ref import quantize_ref
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import QuantizedTensor

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def variants(w: torch.Tensor) -> dict[str, tuple]:
    """name -> (callable x -> y, activation dtype) or (None, reason)."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    out: dict[str, tuple] = {}

    def linear(dtype):
        m = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
        m.weight.data.copy_(w.to(dtype))
        return m

    out["torch f32"] = (linear(torch.float32), torch.float32)
    out["torch bf16"] = (linear(torch.bfloat16), torch.bfloat16)
    for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        m = linear(dtype)
        quantize_(m, Int8WeightOnlyConfig())
        out[f"torchao int8 wo ({tag} act)"] = (m, dtype)
    for fmt in ("plain", "plain_int32", "tile_packed_to_4d", "preshuffled"):
        m = linear(torch.bfloat16)
        try:
            quantize_(m, Int4WeightOnlyConfig(group_size=32, int4_packing_format=fmt))
            m(torch.randn(1, w.shape[1], dtype=torch.bfloat16))
            out[f"torchao int4 wo {fmt} (bf16 act)"] = (m, torch.bfloat16)
        except Exception as e:  # noqa: BLE001 - the reason is the measurement
            out[f"torchao int4 wo {fmt}"] = (None, f"{type(e).__name__}: {str(e)[:90]}")
    for qtype in ("Q8_0", "Q4_0"):
        qt = QuantizedTensor(qtype, tuple(w.shape), quantize_ref(w, qtype))
        out[f"loom {qtype} (auto)"] = (lambda x, qt=qt: quant_ops.matmul(qt, x), torch.float32)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, one thread, loadavg {os.getloadavg()}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.05
        vs = variants(w)
        for reason in [f"  {v}: {r}" for v, (f, r) in vs.items() if f is None]:
            print(reason)
        live = {v: fd for v, fd in vs.items() if fd[0] is not None}
        for t in (int(x) for x in a.tokens.split(",")):
            x = torch.randn(t, k, generator=g)
            ref = x @ w.T
            times: dict[str, list[float]] = {v: [] for v in live}
            errs = {}
            with torch.inference_mode():
                for v, (f, dt) in live.items():
                    errs[v] = ((f(x.to(dt)).float() - ref).abs().max() / ref.abs().max()).item()
                for _ in range(a.rounds):
                    for v, (f, dt) in live.items():
                        xd = x.to(dt)
                        f(xd)
                        t0 = time.thread_time()
                        for _ in range(a.reps):
                            f(xd)
                        times[v].append((time.thread_time() - t0) / a.reps * 1e6)
            base = statistics.median(times["torch f32"])
            print(f"{name} [{n} x {k}], {t} token(s):")
            for v in live:
                med = statistics.median(times[v])
                print(f"  {v:34s} {med:9.1f} us  {base / med:5.2f}x f32  err {errs[v]:.1e}")
    print(f"loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()
