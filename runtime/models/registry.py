"""Maps a config's `architectures` entry to loom's model class (imported lazily)."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": "loom.runtime.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "loom.runtime.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "loom.runtime.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "loom.runtime.models.qwen3:Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM": "loom.runtime.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "loom.runtime.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "loom.runtime.models.mixtral:MixtralForCausalLM",
    "Gemma3ForCausalLM": "loom.runtime.models.gemma3:Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architectures: list[str] | None):
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, cls_name = _MODELS[arch].split(":")
            return getattr(importlib.import_module(module_name), cls_name)
    raise ValueError(
        f"architectures: {architectures} is not supported; supported: {', '.join(supported_architectures())}"
    )
