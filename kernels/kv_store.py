"""Store new tokens' K and V into the pool: one program per token (and column block)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels._util import interpreted

INTERPRETED = interpreted()


@triton.jit
def _store_kernel(Src, Dst, Slots, stride_s, stride_d, N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    slot = tl.load(Slots + t).to(tl.int64)
    x = tl.load(Src + t * stride_s + offs, mask=mask)
    tl.store(Dst + slot * stride_d + offs, x.to(Dst.dtype.element_ty), mask=mask)


def _store(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor, block: int) -> None:
    src = src.reshape(src.shape[0], -1)
    if src.stride(1) != 1:
        src = src.contiguous()
    n = src.shape[1]
    assert dst.is_contiguous() and dst[0].numel() == n, "pool rows are [kv_heads * head_dim]"
    _store_kernel[(src.shape[0], triton.cdiv(n, block))](
        src, dst, slots, src.stride(0), dst.stride(0), N=n, BLOCK=block
    )


def store_kv(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block: int = 256,
) -> None:
    """k_buf[slots] = k and v_buf[slots] = v (cast to the pool's dtype); k [T, Hkv, D]."""
    if slots.numel() == 0:
        return
    _store(k, k_buf, slots, block)
    _store(v, v_buf, slots, block)


def store_kv_ref(k_buf, v_buf, slots, k, v, **_) -> None:
    """TokenToKVPool.set_kv's indexing (runtime/memory_pool.py)."""
    k_buf[slots] = k.to(k_buf.dtype)
    v_buf[slots] = v.to(v_buf.dtype)
