"""What a verify step's matmuls and attention cost against a decode step's, by context length
(issue 33: a verify's rows attend over the whole context, `small_attention` on a float32 pool).

One in-process scheduler, one synthetic request per context length (`cost._prompt`), steps
alternating a decode step and FixedDrafter verifies of 1, 2, 3, 4 and 7 drafts (none
accepted, so the context grows by one token a step on both); per cell the fastest wall step
and the medians of the C forward's own matmul / attention CPU ms over 8 rounds.

    python benchmarks/bench_verify_context.py --model ~/.cache/loom/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --quantization gguf [--contexts 96,512,1024,1536] [--knob NAME=1,0]

--knob NAME=V1,V2,...: an int knob of the C library (loom_f32_verify_tiles: the f32 target on
AVX2, 1 a 7- or 8-token matmul in one pass, 0 the old 4 + 3 / 4 + 4 split;
loom_small_attn_round: 8 or 16, small_attention's row rounding) set to each value in turn,
alternating within each round.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs
from loom.runtime.spec import cost
from loom.runtime.spec.cost import FixedDrafter

# this bench reads the torch runner's CpuForward (its library, knobs, timers): a GGUF model
# would otherwise get the torch-free ArrayRunner (runtime/runner_choice.py)
os.environ.setdefault("LOOM_TORCH_RUNNER", "1")

DRAFTS = (0, 1, 2, 3, 4, 5, 6, 7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--contexts", default="96,512,1024,1536")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--knob", default=None, help="NAME=V1,V2: a C knob's values, alternating")
    args = ap.parse_args()
    kw = {"model_path": args.model, "dtype": "float32", "max_running_requests": 16,
          "speculative_algorithm": "NGRAM", "speculative_verify_cost": "bundled"}  # fmt: skip
    if args.quantization:
        kw["quantization"] = args.quantization
    torch.set_num_threads(ServerArgs().effective_cpu_threads)
    sched = Scheduler(ServerArgs(**kw))
    fwd = sched.runner.cpu_forward
    prof = torch.zeros(2, dtype=torch.float64)
    if fwd is not None:
        fwd.profile = prof
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 10 * (args.rounds + 2)}
    tiles: list[int | None] = [None]
    knob = name = None
    if args.knob:
        name, vals = args.knob.split("=")
        tiles = [int(v) for v in vals.split(",")]
        knob = ctypes.c_int.in_dll(fwd.lib, name)
    default = knob.value if knob is not None else None
    print("context: per drafts, fastest wall ms / median matmul ms / median attention ms")
    for n in (int(x) for x in args.contexts.split(",")):
        sched.add_request(
            TokenizedGenerateReq(
                rid="ctx",
                input_ids=cost._prompt(0, sched.vocab_size, n),
                sampling_params=make_sampling_params(params),
                seed=0,
            )  # fmt: skip
        )
        while sched.prefill.waiting or sched.prefill.chunked_req is not None:
            sched.step()
        res: dict[tuple, list[tuple[float, float, float]]] = {}
        for k in range(args.rounds + 1):
            for v in tiles:
                if v is not None:
                    knob.value = v
                for d in DRAFTS:
                    sched.set_drafter(FixedDrafter(d) if d else None)
                    prof.zero_()
                    t = time.perf_counter()
                    sched.step()
                    wall = time.perf_counter() - t
                    if k:  # the first round warms each shape
                        res.setdefault((v, d), []).append((wall, *prof.tolist()))
        sched.set_drafter(None)
        sched.abort("")
        while not sched.is_idle:
            sched.step()
        sched.output.drain()
        sched.flush_cache()
        for v in tiles:
            cells = " | ".join(
                f"d{d} {1e3 * min(x[0] for x in res[v, d]):.2f}"
                f" / {1e3 * statistics.median(x[1] for x in res[v, d]):.2f}"
                f" / {1e3 * statistics.median(x[2] for x in res[v, d]):.2f}"
                for d in DRAFTS
            )
            tag = "" if v is None else f" {name}={v}"
            print(f"{n:6d}{tag}: {cells}   loadavg {os.getloadavg()[0]:.1f}", flush=True)
        if knob is not None:
            knob.value = default


if __name__ == "__main__":
    main()
