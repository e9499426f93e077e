"""Paged decode attention: one query token per request over its KV read in place from the pool.

Request b reads KV positions kv_start[b] .. seq_lens[b]-1 through its page-table row
req_to_token[req_pool_indices[b]] (one slot per position, so any page size works). Split-K:
each request's range is cut into `num_splits` parts attended by separate programs (a long
context otherwise leaves the GPU idle at small batch), each writing a normalised partial output
and its log-sum-exp; a second kernel merges them exactly. The split count is fixed per launch
and the split length is computed per request inside the kernel, so a captured CUDA graph stays
valid whatever the lengths. GQA/MQA: one program serves all query heads of one KV head, so the
KV rows are loaded once per group.

The log-sum-exp is returned too, so shared-prefix (cascade) attention can merge this partial
with another over disjoint keys (cascade.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels._online_softmax import fold_block, load_rows
from loom.kernels._util import block, dot_precision, interpreted

INTERPRETED = interpreted()


@triton.jit
def _decode_split_kernel(
    Q, K, V, ReqToToken, ReqIdx, KvStart, SeqLens, OPart, LsePart,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(ReqIdx + b).to(tl.int64)
    start = tl.load(KvStart + b)
    end = tl.load(SeqLens + b)
    split_len = tl.cdiv(end - start, NUM_SPLITS)
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, end)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_h
    hmask = offs_h < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < hi
        slot = tl.load(ReqToToken + row * stride_rt + pos, mask=pmask, other=0).to(tl.int64)
        k = load_rows(K, slot, kvh, stride_kt, stride_kh, offs_d, pmask, dmask, q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        v = load_rows(V, slot, kvh, stride_vt, stride_vh, offs_dv, pmask, dvmask, q)
        m_i, l_i, acc = fold_block(s, v, m_i, l_i, acc, PRECISION)
    # an empty split (a short request) leaves lse = -inf and output 0: the merge weighs it 0
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        OPart + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_dv[None, :],
        out,
        mask=hmask[:, None] & dvmask[None, :],
    )
    tl.store(LsePart + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _merge_splits_kernel(
    OPart, LsePart, Out, Lse,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh, stride_lseb,
    DV: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    smask = offs_s < NUM_SPLITS
    offs_dv = tl.arange(0, BLOCK_DV)
    dvmask = offs_dv < DV
    lse = tl.load(LsePart + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    o = tl.load(
        OPart + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_dv[None, :],
        mask=smask[:, None] & dvmask[None, :],
        other=0.0,
    )
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / total
    tl.store(
        Out + b * stride_outb + h * stride_outh + offs_dv, out.to(Out.dtype.element_ty), mask=dvmask
    )
    tl.store(Lse + b * stride_lseb + h, m + tl.log(total))


def num_splits_for(max_kv_len: int, min_split_len: int = 256, max_splits: int = 16) -> int:
    """How many parts split-K cuts a decode batch's contexts into: one per `min_split_len`
    tokens of the longest context, at most `max_splits` (more parts than that cost more in the
    merge than they win in parallelism)."""
    return max(1, min(max_splits, -(-int(max_kv_len) // min_split_len)))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_start: torch.Tensor | None = None,
    num_splits: int = 1,
    block_n: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D]; k_buf [slots, Hkv, D], v_buf [slots, Hkv, Dv] -> (out [B, H, Dv] in q's
    dtype, lse [B, H] float32). Query head h reads KV head h // (H // Hkv)."""
    b, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    if h % hkv:
        raise ValueError(f"num_heads {h} is not a multiple of num_kv_heads {hkv}")
    if kv_start is None:
        kv_start = torch.zeros_like(seq_lens)
    assert k_buf.stride(2) == 1 and v_buf.stride(2) == 1 and q.stride(2) == 1
    assert req_to_token.stride(1) == 1
    group = h // hkv
    o_part = torch.empty((b, h, num_splits, dv), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, hkv, num_splits)](
        q, k_buf, v_buf, req_to_token, req_pool_indices, kv_start, seq_lens, o_part, lse_part,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
        v_buf.stride(1), req_to_token.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1),
        scale,
        GROUP=group, D=d, DV=dv, NUM_SPLITS=num_splits,
        BLOCK_H=block(group), BLOCK_D=block(d), BLOCK_DV=block(dv), BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    out = torch.empty((b, h, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    _merge_splits_kernel[(b, h)](
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0),
        lse_part.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        DV=dv, NUM_SPLITS=num_splits, BLOCK_S=block(num_splits, 1), BLOCK_DV=block(dv),
    )  # fmt: skip
    return out, lse


def decode_attention_ref(
    q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale, kv_start=None, **_
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in plain torch, one request at a time (float32 math)."""
    b, h, _ = q.shape
    hkv = k_buf.shape[1]
    out = torch.empty((b, h, v_buf.shape[2]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    for i in range(b):
        lo = 0 if kv_start is None else int(kv_start[i])
        slots = req_to_token[int(req_pool_indices[i]), lo : int(seq_lens[i])]
        k = k_buf[slots].float().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        v = v_buf[slots].float().repeat_interleave(h // hkv, dim=1)
        s = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        lse[i] = torch.logsumexp(s, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out, lse
