"""Llama family decoder (also the base of Qwen2 and Qwen3), written like the HF reference."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from loom.runtime.distributed import get_parallel_state
from loom.runtime.forward_batch import get_forward_batch
from loom.runtime.layers.activation import SiluAndMul
from loom.runtime.layers.attention import Attention
from loom.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from loom.runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from loom.runtime.layers.logits import compute_logits
from loom.runtime.layers.norm import RMSNorm
from loom.runtime.layers.pipeline import PipelineStage
from loom.runtime.layers.rotary import get_rope


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    qkv_bias: bool | None = None  # None: the config's attention_bias (Llama puts it on o_proj too)
    qk_norm = False

    def __init__(self, config, layer_id: int):
        super().__init__()
        tp = get_parallel_state().tp_size
        self.head_dim = head_dim_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        config_bias = bool(getattr(config, "attention_bias", False))
        bias = config_bias if self.qkv_bias is None else self.qkv_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, num_kv, bias=bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        o_bias = config_bias if self.qkv_bias is None else False
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim * tp, config.hidden_size, o_bias
        )
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = get_rope(self.head_dim, config.max_position_embeddings, config)
        self.attn = Attention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        tp = get_parallel_state().tp_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()
        assert intermediate_size % tp == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_id: int):
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return LlamaMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        )

    def forward(self, positions, hidden, residual):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """With pipeline stages, this rank's layers only (the others are empty placeholders);
    the first stage embeds, the last normalises; the others pass hidden states on."""

    layer_cls = LlamaDecoderLayer

    def __init__(self, config):
        super().__init__()
        self.stage = stage = PipelineStage(config)
        self.hidden_size = config.hidden_size
        if stage.is_first:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                self.layer_cls(config, i) if stage.owns(i) else nn.Identity()
                for i in range(config.num_hidden_layers)
            ]
        )
        if stage.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        stage = self.stage
        if stage.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        else:
            hidden, residual = stage.recv(
                len(input_ids), self.hidden_size, stage.dtype, input_ids.device
            )
        # a drafter's features (`ForwardBatch.capture`): kept on the step's batch, not here
        batch = get_forward_batch()
        capture, aux = batch.capture, {}
        for i in range(stage.start, stage.end):
            hidden, residual = self.layers[i](positions, hidden, residual)
            if capture and i in capture:
                aux[i] = hidden + residual
        if not stage.is_last:
            # a first stage without layers has no residual yet: zeros add nothing to it
            stage.send(hidden, torch.zeros_like(hidden) if residual is None else residual)
            return None
        hidden, _ = self.norm(hidden, residual)
        if capture is not None:
            batch.captured = (hidden, [aux[i] for i in capture])
        return hidden


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    # (fused parameter, checkpoint name, shard id)
    stacked_params = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        stage = self.model.stage
        self.lm_head = None
        if stage.is_last:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if getattr(config, "tie_word_embeddings", False) and stage.is_first:
                self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Returns float32 logits for the rows the forward batch asks for."""
        stage = self.model.stage  # pipeline stages run the model once per micro-batch
        return compute_logits(stage.forward(self.model, input_ids, positions), self.lm_head, stage)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        tied = getattr(self.config, "tie_word_embeddings", False)
        stage = self.model.stage
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
                continue
            if tied and name == "model.embed_tokens.weight" and stage.is_last:
                if not stage.is_first:  # the last stage's head is its own copy
                    loaded.add("lm_head.weight")
                    self.lm_head.weight_loader(self.lm_head.weight, tensor)
                    continue
            if not stage.holds(name):
                continue
            target, shard = self.map_weight_name(name)
            if target is None:
                continue
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            param = params[target]
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard)
            loaded.add(target)
        missing = set(params) - loaded - ({"lm_head.weight"} if tied else set())
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")

    def map_weight_name(self, name: str) -> tuple[str | None, object]:
        """Checkpoint tensor name -> (parameter name, shard id)."""
        for fused, part, shard in self.stacked_params:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None
