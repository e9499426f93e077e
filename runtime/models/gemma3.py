"""Gemma 3 (text) decoder, written like Hugging Face's Gemma3ForCausalLM.

What sets it apart from Llama: RMSNorm scales by (1 + weight); four norms per layer (before
and after attention, before and after the MLP); RMSNorm on each query and key head; the query
scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5; the embedding is multiplied by
sqrt(hidden_size); the MLP is gelu(tanh)-gated; layers alternate between sliding-window
attention with a local rope base and global attention with the global rope (and its scaling);
the head is tied and its logits are optionally soft-capped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.runtime import cpu_kernels
from loom.runtime.distributed import get_parallel_state
from loom.runtime.layers.attention import Attention
from loom.runtime.layers.embedding import VocabParallelEmbedding
from loom.runtime.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from loom.runtime.layers.pipeline import PipelineStage
from loom.runtime.layers.rotary import RotaryEmbedding, rope_parameters
from loom.runtime.models.llama import LlamaForCausalLM, LlamaModel, head_dim_of


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32; the checkpoint's weight is HF's (zero-centred)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps
        self._scale: tuple[tuple[int, int], torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """1 + weight in float32, computed once per weight version (a load writes the weight
        in place or replaces its storage; either changes the key): ~110 norms a Gemma 3
        decode step, each otherwise one more add and cast."""
        w = self.weight
        if w.is_inference():  # no version counter (built under inference_mode): no cache
            return 1.0 + w.float()
        key = (w.data_ptr(), w._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, 1.0 + w.float())
        return self._scale[1]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual), as RMSNorm does."""
        if residual is not None:
            x = x + residual
            residual = x
        scale = self.scale()
        if cpu_kernels.fusable(x):
            out = cpu_kernels.rms_norm(x, scale, self.eps, None)
        else:
            h = x.float()
            out = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)
        return out if residual is None else (out, residual)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


def is_sliding(config, layer_id: int) -> bool:
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer_id] == "sliding_attention"
    pattern = getattr(config, "sliding_window_pattern", 6)  # every 6th layer is global
    return bool((layer_id + 1) % pattern)


def layer_rope(config, head_dim: int, sliding: bool) -> RotaryEmbedding:
    """Local layers: the local base, no scaling; global ones: rope_theta and its scaling
    (transformers >= 5 keeps one parameter dict per layer type, < 5 separate fields)."""
    params = getattr(config, "rope_parameters", None)
    kind = "sliding_attention" if sliding else "full_attention"
    if isinstance(params, dict) and kind in params:
        scaling = dict(params[kind])
        base = float(scaling.get("rope_theta", 10000.0))
    elif sliding:
        base, scaling = float(getattr(config, "rope_local_base_freq", 10000.0)), {}
    else:
        base, scaling = rope_parameters(config)
    return RotaryEmbedding(head_dim, config.max_position_embeddings, base, scaling)


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        tp = get_parallel_state().tp_size
        self.head_dim = head_dim_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, num_kv, bias=bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim * tp, config.hidden_size, bias
        )
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attn_logit_softcapping: not supported for Gemma 3 yet")
        sliding = is_sliding(config, layer_id)
        self.rotary_emb = layer_rope(config, self.head_dim, sliding)
        scaling = config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, self.head_dim, scaling, self.num_kv_heads, layer_id)
        self.attn.sliding_window = config.sliding_window if sliding else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        eps, size = config.rms_norm_eps, config.hidden_size
        self.self_attn = Gemma3Attention(config, layer_id)
        self.mlp = Gemma3MLP(size, config.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) in and out as Llama's layers pass them: the stream is their sum."""
        stream = hidden if residual is None else hidden + residual
        h = self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(stream)))
        stream = stream + h
        h = self.mlp(self.pre_feedforward_layernorm(stream))
        return self.post_feedforward_layernorm(h), stream


class ScaledEmbedding(VocabParallelEmbedding):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim)
        self.scale = embedding_dim**0.5  # HF multiplies by this scalar cast to the weight dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(ids)
        return out * torch.tensor(self.scale, dtype=out.dtype)


class Gemma3Model(LlamaModel):
    """LlamaModel's stage loop over Gemma's layers, embedding and final norm."""

    layer_cls = Gemma3DecoderLayer

    def __init__(self, config):
        nn.Module.__init__(self)
        self.stage = stage = PipelineStage(config)
        self.hidden_size = config.hidden_size
        if stage.is_first:
            self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                self.layer_cls(config, i) if stage.owns(i) else nn.Identity()
                for i in range(config.num_hidden_layers)
            ]
        )
        if stage.is_last:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Weights load as Llama's do (fused qkv / gate_up, tied head)."""

    model_cls = Gemma3Model

    def __init__(self, config):
        if getattr(config, "tie_word_embeddings", None) is None:
            config.tie_word_embeddings = True
        super().__init__(config)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids, positions)
        if self.softcap and logits is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
