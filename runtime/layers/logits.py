"""Logits for the rows a step needs (last token of each request, or prompt positions)."""

from __future__ import annotations

import torch

from loom.runtime.forward_batch import get_forward_batch
from loom.runtime.layers.embedding import ParallelLMHead


def compute_logits(hidden: torch.Tensor, lm_head: ParallelLMHead) -> torch.Tensor:
    """hidden [T, H] -> float32 logits [N, V] for batch.logits_indices."""
    batch = get_forward_batch()
    picked = hidden.index_select(0, batch.logits_indices)
    return lm_head.compute_logits(picked).float()
