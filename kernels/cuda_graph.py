"""Decode CUDA-graph buckets and padding rules (pure functions; tested on the CPU).

A captured graph replays fixed shapes, so a decode batch of B requests runs in the graph of
the smallest captured size >= B, its extra rows padded so they are harmless: each padded row
feeds token 0 at position 0, writes its K/V into slot 0 (the pool's reserved padding page,
never handed to a request) and attends to one position through a reserved page-table row
whose first entry is slot 0. The decode kernel's split count is fixed per graph and each
request's split length is computed inside the kernel (decode_attention.py), so the same
graph serves any context lengths.

The capture itself is not built yet (it needs a model-runner seam and a GPU to verify it on),
so loom has no --disable-cuda-graph / --cuda-graph-max-bs flags today.
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
    `pad_row` is a page-table row reserved for padding (its entry 0 must be slot 0)."""
    b = input_ids.shape[0]
    if not 0 < b <= size:
        raise ValueError(f"batch of {b} does not fit a captured size of {size}")
    extra = size - b

    def pad(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([x, x.new_full((extra,), value)])

    return (
        pad(input_ids, 0),
        pad(positions, 0),
        pad(out_cache_loc, 0),
        pad(req_pool_indices, pad_row),
        pad(seq_lens, 1),
    )
