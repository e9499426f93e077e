"""The compiled forward's packed f32 matmuls with SmolLM2-135M's shapes, weights streamed from
memory: 30 layers (QKV 960x576, O 576x576, gate/up 3072x576, down 576x1536) and the LM head
(49152x576), 538 MB packed, called in a step's order for T tokens (a decode step: T = 1; a
speculative verify of d drafts: T = 1 + d). Random weights (timing only). CPU time of this
thread, median and min of 7 rounds, the T's alternating; prints each T's ratio to the first.

    python benchmarks/bench_stream_matmul.py [--tokens 1,2,3,4,5,6,7,8] [--verify-tiles 1,0]

--verify-tiles: forward.c's loom_f32_verify_tiles per variant (1: on AVX2 a 7- or 8-token call
is one pass; 0: the old 4 + 3 / 4 + 4 split), alternating within each round.

(bench_cpu_forward --matmul times the bundled model's 15.7 MB, which caches hold: it does not
see what a pass's prefetch does to a model streamed from memory.)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--verify-tiles", default="1", help="loom_f32_verify_tiles values, alternating")
    args = ap.parse_args()
    import torch

    from loom.runtime import cpu_forward

    lib = cpu_forward.load()
    g = torch.Generator().manual_seed(0)
    layer = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    mats = [*layer * 30, (49152, 576)]
    ws = [cpu_forward.pack(torch.randn(n, k, generator=g) * 0.02) for n, k in mats]
    ts = [int(t) for t in args.tokens.split(",")]
    pfs = [int(v) for v in args.verify_tiles.split(",")]
    knob = ctypes.c_int.in_dll(lib, "loom_f32_verify_tiles")
    xs = {t: [torch.randn(t, k, generator=g) for _, k in mats] for t in ts}
    ys = {t: [torch.empty(t, n) for n, _ in mats] for t in ts}
    res: dict[tuple[int, int], list[float]] = {(v, t): [] for v in pfs for t in ts}
    for _ in range(args.rounds):
        for t in ts:
            for v in pfs:
                knob.value = v
                c0 = time.thread_time()
                for (n, k), wp, x, y in zip(mats, ws, xs[t], ys[t]):
                    lib.loom_linear_packed_f32(
                        x.data_ptr(), t, k, wp.data_ptr(), None, n, y.data_ptr(), 1
                    )
                res[v, t].append(time.thread_time() - c0)
    for v in pfs:
        base = statistics.median(res[v, ts[0]])
        for t in ts:
            m = statistics.median(res[v, t])
            print(
                f"verify_tiles={v} T={t}: median {m * 1e3:.2f} ms, min {min(res[v, t]) * 1e3:.2f} ms "
                f"({m / base:.2f}x T={ts[0]})"
            )
    print("loadavg", os.getloadavg())


if __name__ == "__main__":
    main()
