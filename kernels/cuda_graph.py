"""Decode CUDA-graph buckets and padding rules (pure functions; tested on the CPU).

A captured graph replays fixed shapes, so a decode batch of B requests runs in the graph of
the smallest captured size >= B, its extra rows padded so they are harmless: each padded row
feeds token 0 at position 0, writes its K/V into slot 0 (the pool's reserved padding page,
never handed to a request) and attends to one position through page-table row `pad_row` (a
read whose result is dropped with the row's logits). The decode kernel's split count is
fixed per graph and each request's split length is computed inside the kernel
(decode_attention.py), so the same graph serves any context lengths.

The runner that captures and replays the graphs, with static buffers padded by these rules,
is runtime/graph_runner.py (--disable-cuda-graph, --cuda-graph-max-bs).
"""

from __future__ import annotations

import torch


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes to capture, as SGLang buckets them: 1, 2, 4, 8, then every 8 up to
    `max_bs` (which is always included)."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs: must be >= 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4) if s < max_bs] + list(range(8, max_bs, 8))
    return sizes + [max_bs]


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The captured size a batch of `batch_size` runs in (None: too large, run eagerly)."""
    return next((s for s in sizes if s >= batch_size), None)


def pad_values(pad_row: int) -> tuple[int, int, int, int, int]:
    """What a padded row holds in (input_ids, positions, out_cache_loc, req_pool_indices,
    seq_lens), by the rules above."""
    return (0, 0, 0, pad_row, 1)


def pad_decode_inputs(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    size: int,
    pad_row: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The five per-request decode tensors padded from B to `size` rows by the rules above;
    `pad_row` is the page-table row padded rows read their one position through."""
    b = input_ids.shape[0]
    if not 0 < b <= size:
        raise ValueError(f"batch of {b} does not fit a captured size of {size}")
    tensors = (input_ids, positions, out_cache_loc, req_pool_indices, seq_lens)
    return tuple(
        torch.cat([x, x.new_full((size - b,), value)])
        for x, value in zip(tensors, pad_values(pad_row))
    )
