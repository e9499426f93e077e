"""Grammar bitmask apply: logits of tokens whose bit is 0 become -inf, in place.

The bitmask is the grammar engines' layout (loom.grammar.base): int32 words, token i allowed
when bit i % 32 of word i // 32 is set. The reference is loom.grammar.base.apply_token_bitmask_.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from loom.kernels._util import interpreted

INTERPRETED = interpreted()


@triton.jit
def _bitmask_kernel(Logits, Bitmask, stride_l, stride_m, V, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    words = tl.load(Bitmask + b * stride_m + offs // 32, mask=inside, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0
    tl.store(Logits + b * stride_l + offs, float("-inf"), mask=inside & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 1024) -> None:
    """logits [B, V] float (last dim contiguous); bitmask [B, ceil(V / 32)] int32 (a tensor,
    or the runtime's numpy words, copied to the logits' device)."""
    if isinstance(bitmask, np.ndarray):
        bitmask = torch.from_numpy(bitmask)
    b, vocab = logits.shape
    if bitmask.shape[0] != b or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask: shape {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    assert logits.stride(1) == 1 and bitmask.dtype == torch.int32
    bitmask = bitmask.to(logits.device).contiguous()
    if b:
        _bitmask_kernel[(b, triton.cdiv(vocab, block))](
            logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, BLOCK=block
        )


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, **_) -> None:
    from loom.grammar.base import apply_token_bitmask_ as reference

    reference(logits, bitmask)
