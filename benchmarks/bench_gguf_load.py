"""Load time of a named GGUF model (smollm2, gemma3-270m): reader + config, tokenizer, weights
dequantized to float32 into loom's model, each timed, against transformers' own GGUF load.

    python benchmarks/bench_gguf_load.py [smollm2|gemma3-270m] [--no-hf] [--no-gguf-reader]

The header alone is timed twice: loom's reader (runtime/gguf/reader.py) and gguf.GGUFReader
with every field's contents() (what loom's metadata read before).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' load")
    ap.add_argument("--no-gguf-reader", action="store_true", help="skip gguf.GGUFReader's time")
    args = ap.parse_args()
    from loom.runtime.gguf.named import resolve_model_name
    from loom.runtime.model_loader import load_config, load_model
    from loom.runtime.tokenizer import load_tokenizer

    path = resolve_model_name(args.model)
    print(f"{args.model}: {path} ({Path(path).stat().st_size / 1e6:.0f} MB), "
          f"load avg {os.getloadavg()[0]:.1f}")  # fmt: skip
    from loom.runtime.gguf.reader import GGUFFile

    t0 = time.perf_counter()
    GGUFFile(path)
    print(f"header: loom's reader {time.perf_counter() - t0:.2f}s", end="", flush=True)
    if not args.no_gguf_reader:
        import gguf

        t0 = time.perf_counter()
        {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
        print(f", gguf.GGUFReader + contents() {time.perf_counter() - t0:.2f}s", end="")
    print()
    t0 = time.perf_counter()
    config = load_config(path)
    t1 = time.perf_counter()
    load_tokenizer(path)
    t2 = time.perf_counter()
    model = load_model(path, torch.float32, "cpu", config)
    t3 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    print(f"loom: reader+config {t1 - t0:.1f}s, tokenizer {t2 - t1:.1f}s, "
          f"weights (dequantize to f32) {t3 - t2:.1f}s, total {t3 - t0:.1f}s, {params / 1e6:.0f}M params")  # fmt: skip
    if not args.no_hf:
        import transformers

        p = Path(path)
        t0 = time.perf_counter()
        transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        t1 = time.perf_counter()
        transformers.AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32
        )
        t2 = time.perf_counter()
        print(f"transformers: tokenizer {t1 - t0:.1f}s, model {t2 - t1:.1f}s, total {t2 - t0:.1f}s")
    print(f"load avg after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
