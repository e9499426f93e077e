"""Load a local Hugging Face folder (config.json + safetensors) or a GGUF file (runtime/gguf)
into loom's own model classes."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from loom.runtime.gguf.file import gguf_file
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


def check_model_folder(path: str) -> Path:
    if gguf_file(path) is not None:
        return Path(path)
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"model_path: {path!r} is not a local folder or .gguf file (loom loads models offline)"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(f"model_path: {path!r} has no config.json")
    return folder


def load_config(path: str):
    import transformers

    if (file := gguf_file(path)) is not None:
        from loom.runtime.gguf.config import gguf_config

        return gguf_config(str(file))
    folder = check_model_folder(path)
    try:
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"model_path: cannot read {folder / 'config.json'}: {e}") from e


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


def load_model(path: str, dtype: torch.dtype, device: str, config=None) -> torch.nn.Module:
    config = config or load_config(path)
    cls = get_model_class(getattr(config, "architectures", None))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(iterate_weights(path))
    return model.eval()
