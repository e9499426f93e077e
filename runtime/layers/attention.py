"""The attention layer models call: projections in, paged attention through the backend."""

from __future__ import annotations

import torch
from torch import nn

from loom.runtime.forward_batch import get_forward_batch


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.is_gqa = num_heads != num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D] or [T, H, D]; k, v likewise with kv heads -> [T, H*Dv]."""
        batch = get_forward_batch()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.v_head_dim)
        out = batch.attn_backend.forward(q, k, v, self, batch)
        return out.reshape(q.shape[0], self.num_heads * self.v_head_dim)
