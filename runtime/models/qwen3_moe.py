"""Qwen3-MoE: Qwen3 attention (RMSNorm on q/k heads) with Qwen-style sparse MLP blocks."""

from __future__ import annotations

from loom.runtime.models.qwen2_moe import (
    Qwen2MoeDecoderLayer,
    Qwen2MoeForCausalLM,
    Qwen2MoeModel,
)
from loom.runtime.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    """No shared expert: the config has no `shared_expert_intermediate_size`."""

    attention_cls = Qwen3Attention


class Qwen3MoeModel(Qwen2MoeModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    model_cls = Qwen3MoeModel
