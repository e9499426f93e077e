"""Vocabulary-parallel embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.runtime.distributed import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary rows (padded to divide evenly)."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        ps = get_parallel_state()
        self.tp_rank, self.tp_size = ps.tp_rank, ps.tp_size
        self.num_embeddings = num_embeddings
        self.shard = -(-num_embeddings // self.tp_size)
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start : self.start + self.shard]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0) & (local < self.shard)
        out = F.embedding(local.clamp(0, self.shard - 1), self.weight)
        out = out * valid.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to full-vocabulary logits (gathered across ranks)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        logits = tp_all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
