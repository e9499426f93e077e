"""Load a local Hugging Face folder (config.json + safetensors) or a GGUF file (runtime/gguf)
into loom's own model classes."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from loom.runtime.gguf.file import gguf_file
from loom.runtime.layers.quant_types import QuantizedTensor
from loom.runtime.model_config import check_model_folder, load_config  # noqa: F401 - re-exported
from loom.runtime.models.registry import get_model_class

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str, config, device: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    resolved = (
        name
        if isinstance(name, torch.dtype)
        else _DTYPES.get(str(name).replace("torch.", ""), torch.float32)
    )
    if device == "cpu" and resolved == torch.float16:
        return torch.float32  # float16 matmuls are slow and inexact on CPU
    return resolved


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint: sharded (index json), single-file, or .bin fallback;
    a GGUF file's tensors dequantized to float32 under their HF names."""
    from safetensors import safe_open

    if (file := gguf_file(path)) is not None:
        from loom.runtime.gguf.weights import iterate_gguf_weights

        yield from iterate_gguf_weights(str(file))
        return

    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if files:
        for name in files:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    yield key, f.get_tensor(key)
        return
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not bins:
        raise ValueError(f"model_path: {path!r} has no *.safetensors or pytorch_model*.bin weights")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


# --quantization int8 | int4 -> (projection block type, embedding / LM head block type); "gguf"
# keeps a GGUF file's own block types
QUANT_TYPES = {"int8": ("Q8_0", "Q8_0"), "int4": ("Q4_1", "Q8_0")}
# checkpoint tensors --quantization quantizes: dense projections, the embedding, the LM head
# (MoE experts, norms and biases stay float)
_QUANTIZED_NAMES = re.compile(
    r"(\.(q|k|v|o|gate|up|down|qkv|gate_up)_proj\.weight|embed_tokens\.weight|lm_head\.weight)$"
)


def quantize_weights(
    weights: Iterable[tuple[str, torch.Tensor]], quantization: str
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors with the dense projections, embedding and LM head replaced by
    QuantizedTensors (columns not whole blocks of 32 stay float)."""
    from loom.kernels.quant_ref import quantize_ref

    proj, table = QUANT_TYPES[quantization]
    for name, t in weights:
        if t.dim() == 2 and t.shape[1] % 32 == 0 and _QUANTIZED_NAMES.search(name):
            if ".experts." not in name:
                qtype = table if "embed_tokens" in name or "lm_head" in name else proj
                yield name, QuantizedTensor(qtype, tuple(t.shape), quantize_ref(t, qtype))
                continue
        yield name, t


def load_model(
    path: str,
    dtype: torch.dtype,
    device: str,
    config=None,
    quantization: str | None = None,
    rotary_positions: int | None = None,
) -> torch.nn.Module:
    """`rotary_positions`: the most positions the model will see (its rotary tables' rows;
    None: the config's max_position_embeddings)."""
    from loom.runtime.layers.rotary import served_positions

    config = config or load_config(path)
    cls = get_model_class(getattr(config, "architectures", None))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), served_positions(rotary_positions):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    if quantization is not None and torch.device(device).type != "cpu":
        raise ValueError(f"quantization: {quantization!r} runs on the CPU only so far")
    file = gguf_file(path)
    if quantization == "gguf":  # the file's own blocks, kept as they are
        if file is None:
            raise ValueError(f"quantization: 'gguf' needs a GGUF model_path, got {path!r}")
        from loom.runtime.gguf.weights import iterate_gguf_weights

        weights = iterate_gguf_weights(str(file), keep_quantized=True)
    else:
        from loom.runtime.hf_quant import hf_quantized_weights, quant_method

        weights = iterate_weights(path)
        packed = quant_method(config) if file is None else None  # GPTQ / AWQ checkpoint
        if packed is not None and (quantization is not None or torch.device(device).type != "cpu"):
            raise ValueError(
                f"quantization: a {packed['quant_method']} checkpoint is kept as it is quantized, "
                f"on the CPU (got quantization={quantization!r}, device={device!r})"
            )
        if packed is not None:
            weights = hf_quantized_weights(weights, packed)
        elif quantization is not None:
            weights = quantize_weights(weights, quantization)
    model.load_weights(weights)
    return model.eval()
