"""Qwen2-MoE: Qwen2 attention; sparse MLP blocks with a sigmoid-gated shared expert."""

from __future__ import annotations

import torch
from torch import nn

from loom.runtime.layers.linear import ReplicatedLinear
from loom.runtime.layers.moe import SparseMoeBlock, map_expert_weight
from loom.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from loom.runtime.models.qwen2 import Qwen2Attention


def num_experts_of(config) -> int:
    return getattr(config, "num_experts", None) or config.num_local_experts


def is_sparse_layer(config, layer_id: int) -> bool:
    """HF's rule: every `decoder_sparse_step`-th layer is sparse unless listed as MLP-only."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    return layer_id not in mlp_only and num_experts_of(config) > 0 and (layer_id + 1) % step == 0


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    def __init__(self, config):
        super().__init__(
            config.hidden_size,
            num_experts_of(config),
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = LlamaMLP(config.hidden_size, shared) if shared else None
        self.shared_expert_gate = (
            ReplicatedLinear(config.hidden_size, 1, bias=False) if shared else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(hidden))
            out = out + gate * self.shared_expert(hidden)
        return out


class Qwen2MoeAttention(Qwen2Attention):
    def __init__(self, config, layer_id: int):
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))
        super().__init__(config, layer_id)


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen2MoeAttention
    moe_cls = Qwen2MoeSparseMoeBlock

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return self.moe_cls(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Qwen2MoeModel(LlamaModel):
    layer_cls = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen2MoeModel

    def map_weight_name(self, name: str) -> tuple[str | None, object]:
        return map_expert_weight(name) or super().map_weight_name(name)
