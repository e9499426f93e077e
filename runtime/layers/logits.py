"""Logits for the rows a step needs (last token of each request, or prompt positions)."""

from __future__ import annotations

import torch

from loom.runtime.forward_batch import get_forward_batch
from loom.runtime.layers.embedding import ParallelLMHead
from loom.runtime.layers.pipeline import PipelineStage


def compute_logits(
    hidden: torch.Tensor | None, lm_head: ParallelLMHead | None, stage: PipelineStage
) -> torch.Tensor:
    """hidden [T, H] -> float32 logits [N, V] for batch.logits_indices. With pipeline stages
    only the last has hidden states and the head; every stage returns its logits."""
    batch = get_forward_batch()
    logits = None
    if stage.is_last:
        picked = hidden.index_select(0, batch.logits_indices)
        logits = lm_head.compute_logits(picked).float()
    if stage.size == 1:
        return logits
    return stage.share_logits(logits, batch.logits_indices.numel(), batch.input_ids.device)
