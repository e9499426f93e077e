"""Vocabulary-parallel embedding and LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.runtime.distributed import get_parallel_state, tp_all_gather_last_dim, tp_all_reduce
from loom.runtime.layers.quant_linear import narrow_rows, put_rows, quant_of
from loom.runtime.layers.quant_types import QuantizedTensor


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
        if isinstance(loaded, QuantizedTensor):  # rows past the vocabulary stay 0 (not stored)
            n = max(0, min(self.shard, loaded.shape[0] - self.start))
            put_rows(param, 0, narrow_rows(loaded, self.start, n))
            return
        rows = loaded[self.start : self.start + self.shard]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        qw = quant_of(self.weight)
        return F.embedding(ids, self.weight) if qw is None else qw.lookup(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(ids)
        local = ids - self.start
        valid = (local >= 0) & (local < self.shard)
        out = self.lookup(local.clamp(0, self.shard - 1))
        out = out * valid.unsqueeze(-1).to(out.dtype)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to full-vocabulary logits (gathered across ranks)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        qw = quant_of(self.weight)
        logits = F.linear(hidden, self.weight) if qw is None else qw.matmul(hidden)
        logits = tp_all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
