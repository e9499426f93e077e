"""Logprobs of the raw model (before any sampling transform)."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_num: int):
    """Raw-model logprobs of `token_ids` and the top-`top_num` entries per row: one
    log_softmax over all the rows given (the caller gathers every row that needs one)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1)
    if top_num > 0:
        top_vals, top_ids = logp.topk(min(top_num, logp.shape[-1]), dim=-1)
        return chosen, top_vals, top_ids
    return chosen, None, None
