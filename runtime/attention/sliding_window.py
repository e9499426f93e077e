"""Attention for a sliding-window layer (Gemma 3's local layers) once a sequence outgrows it.

A query at position p sees keys at positions p - window + 1 .. p (Hugging Face's sliding
mask: kv > q - window). While every sequence of a step fits in its window, the mask changes
nothing and the backend's own causal path runs (`needed`); past it this plain-torch path runs
for every backend: it writes the step's K/V into the pool like the backends do, then attends
each request over only its window's slots with SDPA and a bool mask. The pool keeps every
position (no ring buffer), so the radix cache and prefix reuse work unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loom.runtime.forward_batch import ForwardBatch


def needed(layer, batch: ForwardBatch) -> bool:
    window = getattr(layer, "sliding_window", None)
    return bool(window) and max(batch.seq_lens_cpu, default=0) > window


def forward(q, k, v, layer, batch: ForwardBatch) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] -> [T, H, Dv], attending within `layer.sliding_window`."""
    pool = batch.token_to_kv_pool
    pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
    k_buf, v_buf = pool.get_kv(layer.layer_id)
    table = batch.req_to_token_pool.req_to_token
    window = layer.sliding_window
    out = torch.empty(q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device)
    trees = batch.custom_masks or [None] * batch.batch_size
    start = 0
    for row, prefix, seq, tree in zip(
        batch.req_pool_indices.tolist(), batch.prefix_lens_cpu, batch.seq_lens_cpu, trees
    ):
        ext = seq - prefix
        pos = batch.positions[start : start + ext]
        first = max(0, int(pos.min()) - window + 1)  # no query of this request sees before it
        cols = torch.arange(first, seq, device=q.device)
        if tree is None:  # causal: row i is the token at column prefix + i
            rows = torch.arange(prefix, seq, device=q.device)
            mask = cols[None, :] <= rows[:, None]
        else:  # a draft tree: its own ancestry mask over columns 0 .. seq - 1
            mask = tree[:, first:].to(torch.bool)
        mask = mask & (cols[None, :] > pos[:, None] - window)
        slots = table[row, first:seq]
        ki = k_buf[slots].transpose(0, 1).to(q.dtype)  # [Hkv, cols, D]
        vi = v_buf[slots].transpose(0, 1).to(q.dtype)
        qi = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
        oi = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=layer.is_gqa
        )
        out[start : start + ext] = oi.transpose(0, 1)
        start += ext
    return out
