"""What a serving process on a GGUF model holds without torch: resident memory phase by phase.

The floor a torch-free scheduler could reach (issue 32's peak-RSS bar): one process imports
numpy and what the scheduler needs besides torch (zmq, msgspec, tokenizers), loads the GGUF
tokenizer as the scheduler does (runtime/tokenizer.load_tokenizer), builds the C forward over
numpy arrays (runtime/cpu_model.ArrayForward: the file's quantized blocks, a KV pool sized as
bench_real sizes it, B x (pp + tg) + 64 slots) and runs bench_real's workload greedily: B
prompts of --pp random tokens prefilled in one step, then --tg decode steps, twice. Same
columns as bench_memory_phases.py (its `phase`); at the end it asserts torch was never imported.

    python benchmarks/bench_memory_notorch.py [--gguf smollm2|gemma3-270m|PATH] [--batch 1]
        [--pp 128] [--tg 32] [--threads 1] [--kv-cache-dtype bf16|float32]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from bench_memory_phases import ROWS, phase


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gguf", default="smollm2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--pp", type=int, default=128)
    p.add_argument("--tg", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="bf16", choices=("bf16", "float32"))
    a = p.parse_args()
    print(f"load before: {os.getloadavg()}")
    with phase("python"):
        pass
    with phase("import numpy, zmq, msgspec, tokenizers"):
        import msgspec  # noqa: F401
        import numpy as np  # noqa: F401
        import tokenizers  # noqa: F401
        import zmq  # noqa: F401

        from loom.runtime.process import fix_mmap_threshold, release_free_heap

        fix_mmap_threshold()  # as every loom child sets it
    path = a.gguf
    if not path.endswith(".gguf"):
        from loom.runtime.gguf.named import resolve_model_name

        path = resolve_model_name(path)
    with phase("tokenizer (load_tokenizer)"):
        from loom.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(path)
    with phase("weights + KV pool + C forward"):
        from loom.runtime.cpu_model import ArrayForward

        fwd = ArrayForward(
            path, kv_rows=a.batch * (a.pp + a.tg) + 64, max_reqs=a.batch + 1,
            max_context=a.pp + a.tg, kv_dtype=a.kv_cache_dtype,
            rotary_rows=a.batch * (a.pp + a.tg) + 64,
        )  # fmt: skip
        release_free_heap()  # as ModelRunner does after its build
    with phase("first request (4 + 4 tokens)"):
        fwd.greedy([[5, 6, 7, 8]], 4, a.threads)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(a.pp)] for _ in range(a.batch)]
    t = time.perf_counter()
    with phase(f"prefill + decode {a.batch} x {a.tg}"):
        fwd.greedy(prompts, a.tg, a.threads)
    wall = time.perf_counter() - t
    with phase("again (steady)"):
        fwd.greedy(prompts, a.tg, a.threads)
    print(f"  ({a.batch} x ({a.pp} + {a.tg}) tokens in {wall:.2f} s; tokenizer vocab {len(tok)})")
    print(f"process peak over all phases: {max(r[1]['VmHWM'] for r in ROWS):.1f} MB")
    assert "torch" not in sys.modules, "torch was imported"
    print("torch imported: no")
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
