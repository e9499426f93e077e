"""Mixtral: Llama attention; every MLP is a sparse block (`block_sparse_moe` in checkpoints).

Routing renormalises the top-k weights and keeps them in float32, as the HF reference does.
"""

from __future__ import annotations

from torch import nn

from loom.runtime.layers.moe import SparseMoeBlock, map_expert_weight
from loom.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            fp32_routing_weights=True,
        )


class MixtralModel(LlamaModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def map_weight_name(self, name: str) -> tuple[str | None, object]:
        # transformers<5 checkpoints say block_sparse_moe; v5 in-memory names say mlp
        name = name.replace(".block_sparse_moe.", ".mlp.")
        return map_expert_weight(name) or super().map_weight_name(name)
