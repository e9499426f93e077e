"""Extend attention: a ragged batch of new tokens over each request's cached prefix.

Request b's new tokens are rows qo_starts[b] .. qo_starts[b]+extend_lens[b]-1 of q, at positions
prefix_lens[b] .. prefix_lens[b]+extend_lens[b]-1; they attend to KV positions 0 .. seq_len-1
read in place from the pool through the request's page-table row (the new tokens' K/V are
stored there first, as by every backend). The mask is causal, or a custom one for tree
verification in speculative decoding: per request a bool [extend_len, seq_len] (True =
attend, the torch backend's convention), flattened and concatenated, request b's starting at
mask_starts[b]. An empty prefix and an empty extension are both fine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels._online_softmax import fold_block, load_rows
from loom.kernels._util import block, dot_precision, interpreted

INTERPRETED = interpreted()


@triton.jit
def _extend_kernel(
    Q, K, V, Out, ReqToToken, ReqIdx, PrefixLens, ExtendLens, QoStarts, Mask, MaskStarts,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_rt,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, CUSTOM_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblock = tl.program_id(2)
    ext = tl.load(ExtendLens + b)
    if mblock * BLOCK_M >= ext:
        return
    row = tl.load(ReqIdx + b).to(tl.int64)
    prefix = tl.load(PrefixLens + b)
    qo = tl.load(QoStarts + b).to(tl.int64)
    seq = prefix + ext
    kvh = h // GROUP

    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < ext
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    q = tl.load(
        Q + (qo + offs_m[:, None]) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mmask[:, None] & dmask[None, :],
        other=0.0,
    )
    if CUSTOM_MASK:
        hi = seq
        mask_start = tl.load(MaskStarts + b).to(tl.int64)
    else:  # causal: this block's last row sees up to position prefix + its index
        hi = tl.minimum(seq, prefix + (mblock + 1) * BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        slot = tl.load(ReqToToken + row * stride_rt + pos, mask=pmask, other=0).to(tl.int64)
        k = load_rows(K, slot, kvh, stride_kt, stride_kh, offs_d, pmask, dmask, q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = mmask[:, None] & pmask[None, :]
        if CUSTOM_MASK:
            bits = tl.load(
                Mask + mask_start + offs_m[:, None] * seq + pos[None, :], mask=visible, other=0
            )
            visible = visible & (bits != 0)
        else:
            visible = visible & (pos[None, :] <= prefix + offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        v = load_rows(V, slot, kvh, stride_vt, stride_vh, offs_dv, pmask, dvmask, q)
        m_i, l_i, acc = fold_block(s, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        Out + (qo + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=mmask[:, None] & dvmask[None, :],
    )


def pack_custom_masks(masks: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request bool [extend_len, seq_len] masks -> (flat uint8 mask, start of each)."""
    sizes = [m.numel() for m in masks]
    starts = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)
    flat = torch.cat([m.reshape(-1) for m in masks]) if masks else torch.zeros(0)
    return flat.to(device=device, dtype=torch.uint8), starts.to(device)


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_starts: torch.Tensor,
    max_extend_len: int,
    scale: float,
    custom_mask: torch.Tensor | None = None,
    mask_starts: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """q [T, H, D] -> out [T, H, Dv]; k_buf / v_buf [slots, Hkv, D|Dv] already hold the new
    tokens' K/V. `custom_mask` / `mask_starts` from `pack_custom_masks` (None: causal)."""
    t, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    if h % hkv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    assert k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and q.stride(2) == 1
    assert req_to_token.stride(1) == 1
    out = torch.empty((t, h, dv), dtype=q.dtype, device=q.device)
    b = len(extend_lens)
    if t == 0 or b == 0:
        return out
    use_mask = custom_mask is not None
    if use_mask:
        assert mask_starts is not None and len(mask_starts) == b
    grid = (b, h, triton.cdiv(max(int(max_extend_len), 1), block_m))
    _extend_kernel[grid](
        q, k_buf, v_buf, out, req_to_token, req_pool_indices, prefix_lens, extend_lens,
        qo_starts, custom_mask if use_mask else extend_lens,
        mask_starts if use_mask else extend_lens,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), out.stride(0), out.stride(1), req_to_token.stride(0),
        scale,
        GROUP=h // hkv, D=d, DV=dv, CUSTOM_MASK=use_mask,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block(d), BLOCK_DV=block(dv),
        PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    return out


def extend_attention_ref(
    q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, scale, masks=None
) -> torch.Tensor:
    """The contract in plain torch (float32 math); `masks`: per-request bool
    [extend_len, seq_len] or None for causal."""
    h, hkv = q.shape[1], k_buf.shape[1]
    out = torch.zeros((q.shape[0], h, v_buf.shape[2]), dtype=q.dtype, device=q.device)
    start = 0
    for i in range(len(extend_lens)):
        pre, ext = int(prefix_lens[i]), int(extend_lens[i])
        slots = req_to_token[int(req_pool_indices[i]), : pre + ext]
        k = k_buf[slots].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = v_buf[slots].float().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("thd,lhd->htl", q[start : start + ext].float(), k) * scale
        if masks is not None and masks[i] is not None:
            mask = masks[i].bool()
        else:
            cols = torch.arange(pre + ext, device=q.device)
            mask = cols[None, :] <= torch.arange(ext, device=q.device)[:, None] + pre
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        out[start : start + ext] = torch.einsum("htl,lhd->thd", p, v).to(q.dtype)
        start += ext
    return out
