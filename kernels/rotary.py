"""Rotary position embedding (neox layout: the two halves of each head rotate together).

The reference is loom.runtime.layers.rotary.RotaryEmbedding.forward, which reads the same
[max_position, head_dim] cos/sin caches (attention scaling folded in) cast to q's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels._util import interpreted

INTERPRETED = interpreted()


@triton.jit
def _rotary_kernel(
    X, Out, Positions, Cos, Sin, stride_xt, stride_xh, stride_ot, stride_oh, stride_c,
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    hmask = heads < NUM_HEADS
    dmask = offs < HALF
    mask = hmask[:, None] & dmask[None, :]
    pos = tl.load(Positions + t).to(tl.int64)
    dt = X.dtype.element_ty
    cos1 = tl.load(Cos + pos * stride_c + offs, mask=dmask, other=0.0).to(dt).to(tl.float32)
    cos2 = tl.load(Cos + pos * stride_c + HALF + offs, mask=dmask, other=0.0).to(dt).to(tl.float32)
    sin1 = tl.load(Sin + pos * stride_c + offs, mask=dmask, other=0.0).to(dt).to(tl.float32)
    sin2 = tl.load(Sin + pos * stride_c + HALF + offs, mask=dmask, other=0.0).to(dt).to(tl.float32)
    base = X + t * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = Out + t * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(out, (x1 * cos1[None, :] - x2 * sin1[None, :]).to(dt), mask=mask)
    tl.store(out + HALF, (x2 * cos2[None, :] + x1 * sin2[None, :]).to(dt), mask=mask)


def _rotate(x, positions, cos_cache, sin_cache, block_h):
    t, h, d = x.shape
    if d % 2:
        raise ValueError(f"rotary: head_dim must be even, got {d}")
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty_like(x)
    if t:
        _rotary_kernel[(t, triton.cdiv(h, block_h))](
            x, out, positions, cos_cache, sin_cache, x.stride(0), x.stride(1),
            out.stride(0), out.stride(1), cos_cache.stride(0),
            NUM_HEADS=h, HALF=d // 2, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d // 2),
        )  # fmt: skip
    return out


def rotary(positions, q, k, cos_cache, sin_cache, block_h: int = 4):
    """q [T, H, D], k [T, Hkv, D] -> rotated copies; caches [max_position, D] float32."""
    assert cos_cache.is_contiguous() and sin_cache.is_contiguous()
    return (
        _rotate(q, positions, cos_cache, sin_cache, block_h),
        _rotate(k, positions, cos_cache, sin_cache, block_h),
    )


def rotary_ref(positions, q, k, cos_cache, sin_cache, **_):
    cos = cos_cache[positions].unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].unsqueeze(1).to(q.dtype)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
