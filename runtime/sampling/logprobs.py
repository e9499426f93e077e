"""Logprobs of the raw model (before any sampling transform)."""

from __future__ import annotations

import numpy as np


def token_logprobs(logits, token_ids, top_num: int):
    """Raw-model logprobs of `token_ids` and the top-`top_num` entries per row: one
    log_softmax over all the rows given (the caller gathers every row that needs one).
    Numpy float32 logits (and ids) give numpy arrays, in the order torch's would (top values
    descending, equal values by token id); torch tensors give tensors."""
    if isinstance(logits, np.ndarray):
        return _token_logprobs_np(logits, np.asarray(token_ids, np.int64), top_num)
    import torch

    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1)
    if top_num > 0:
        top_vals, top_ids = logp.topk(min(top_num, logp.shape[-1]), dim=-1)
        return chosen, top_vals, top_ids
    return chosen, None, None


def _token_logprobs_np(logits: np.ndarray, token_ids: np.ndarray, top_num: int):
    """log_softmax as x - max - log(sum(exp(x - max))), as torch computes it."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    chosen = logp[np.arange(logp.shape[0]), token_ids]
    if top_num <= 0:
        return chosen, None, None
    k = min(top_num, logp.shape[-1])
    vocab = logp.shape[-1]
    if k < vocab:
        ids = np.argpartition(logp, vocab - k, axis=-1)[:, vocab - k :]
    else:
        ids = np.broadcast_to(np.arange(vocab, dtype=np.int64), logp.shape)
    vals = np.take_along_axis(logp, ids, axis=-1)
    order = np.lexsort((ids, -vals), axis=-1)  # descending, equal values by token id
    top_ids = np.take_along_axis(ids, order, axis=-1).astype(np.int64, copy=False)
    return chosen, np.take_along_axis(vals, order, axis=-1), top_ids
