"""Shared-prefix (cascade) decode attention.

Requests forked from one prompt read the same KV slots for their common prefix. Per-request
decode reads that prefix once per request; here each group of adjacent batch rows that share
a prefix attends to it in one program per (group, head, row block), so the prefix's K/V rows are
loaded once for all the group's queries. Each request then attends to its own suffix with the
paged decode kernel (kv_start = its group's prefix length), and the two partial softmaxes are
merged exactly through their log-sum-exps (FlashInfer's cascade; the torch version is
runtime/attention/shared_prefix.py, whose `find_groups` chooses the groups for both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels import decode_attention as _decode
from loom.kernels._online_softmax import fold_block, load_rows
from loom.kernels._util import block, dot_precision, interpreted

INTERPRETED = interpreted()


@triton.jit
def _prefix_kernel(
    Q, K, V, OPre, LsePre, GroupRows, GroupSlots, GroupSlotStarts,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
    stride_lb,
    scale,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    h = tl.program_id(1)
    mblock = tl.program_id(2)
    row0 = tl.load(GroupRows + 2 * g)  # [start_0, end_0, start_1, end_1, ...]
    n_rows = tl.load(GroupRows + 2 * g + 1) - row0
    if mblock * BLOCK_M >= n_rows:
        return
    s0 = tl.load(GroupSlotStarts + g)
    n_slots = tl.load(GroupSlotStarts + g + 1) - s0
    kvh = h // GROUP
    offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < n_rows
    rows = (row0 + offs_m).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask = offs_d < D
    dvmask = offs_dv < DV
    q = tl.load(
        Q + rows[:, None] * stride_qb + h * stride_qh + offs_d[None, :],
        mask=mmask[:, None] & dmask[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, n_slots, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < n_slots
        slot = tl.load(GroupSlots + s0 + pos, mask=pmask, other=0).to(tl.int64)
        k = load_rows(K, slot, kvh, stride_kt, stride_kh, offs_d, pmask, dmask, q)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(pmask[None, :], s, float("-inf"))
        v = load_rows(V, slot, kvh, stride_vt, stride_vh, offs_dv, pmask, dvmask, q)
        m_i, l_i, acc = fold_block(s, v, m_i, l_i, acc, PRECISION)
    tl.store(
        OPre + rows[:, None] * stride_ob + h * stride_oh + offs_dv[None, :],
        acc / l_i[:, None],
        mask=mmask[:, None] & dvmask[None, :],
    )
    tl.store(LsePre + rows * stride_lb + h, m_i + tl.log(l_i), mask=mmask)


@triton.jit
def _merge_kernel(
    O1, Lse1, O2, Lse2, Out, stride_o1, stride_o2, stride_out, stride_l1, stride_l2,
    H: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_DV)
    dmask = offs < DV
    l1 = tl.load(Lse1 + b * stride_l1 + h)
    l2 = tl.load(Lse2 + b * stride_l2 + h)
    m = tl.maximum(l1, l2)
    w1 = tl.exp(l1 - m)
    w2 = tl.exp(l2 - m)
    o1 = tl.load(O1 + b * stride_o1 + h * DV + offs, mask=dmask, other=0.0).to(tl.float32)
    o2 = tl.load(O2 + b * stride_o2 + h * DV + offs, mask=dmask, other=0.0).to(tl.float32)
    out = (o1 * w1 + o2 * w2) / (w1 + w2)
    tl.store(Out + b * stride_out + h * DV + offs, out.to(Out.dtype.element_ty), mask=dmask)


def merge_states(o1, lse1, o2, lse2, out_dtype) -> torch.Tensor:
    """Two normalised partial attentions over disjoint keys, [B, H, Dv] with lse [B, H] (an
    lse of -inf is an empty part) -> the attention over their union."""
    b, h, dv = o1.shape
    o1, o2 = o1.contiguous(), o2.contiguous()
    lse1, lse2 = lse1.contiguous(), lse2.contiguous()
    out = torch.empty((b, h, dv), dtype=out_dtype, device=o1.device)
    if b:
        _merge_kernel[(b, h)](
            o1, lse1, o2, lse2, out, o1.stride(0), o2.stride(0), out.stride(0),
            lse1.stride(0), lse2.stride(0), H=h, DV=dv, BLOCK_DV=block(dv),
        )  # fmt: skip
    return out


def cascade_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    group_bounds: list[tuple[int, int, int]],
    num_splits: int = 1,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """q [B, H, D] -> [B, H, Dv]. `group_bounds`: (first row, end row, prefix length) of each
    run of adjacent rows whose first `prefix length` page-table entries are equal (and shorter
    than each member's sequence); rows in no group attend per request."""
    b, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    device = q.device
    kv_start = torch.zeros_like(seq_lens)
    o_pre = torch.zeros((b, h, dv), dtype=torch.float32, device=device)
    lse_pre = torch.full((b, h), float("-inf"), dtype=torch.float32, device=device)
    if group_bounds:
        slot_starts, slots, last_end = [0], [], 0
        for start, end, plen in group_bounds:
            assert last_end <= start < end and plen >= 1, "groups: ordered, disjoint rows"
            kv_start[start:end] = plen
            slots.append(req_to_token[int(req_pool_indices[start]), :plen])
            slot_starts.append(slot_starts[-1] + plen)
            last_end = end
        bounds = torch.tensor([x for g in group_bounds for x in g[:2]], dtype=torch.int32)
        bounds = bounds.to(device)
        flat_slots = torch.cat(slots)
        starts_t = torch.tensor(slot_starts, dtype=torch.int64, device=device)
        max_rows = max(e - s for s, e, _ in group_bounds)
        grid = (len(group_bounds), h, triton.cdiv(max_rows, block_m))
        _prefix_kernel[grid](
            q, k_buf, v_buf, o_pre, lse_pre, bounds, flat_slots, starts_t,
            q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0),
            v_buf.stride(1), o_pre.stride(0), o_pre.stride(1), lse_pre.stride(0),
            scale,
            GROUP=h // hkv, D=d, DV=dv,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block(d), BLOCK_DV=block(dv),
            PRECISION=dot_precision(q.dtype),
        )  # fmt: skip
    o_suf, lse_suf = _decode.decode_attention(
        q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale,
        kv_start=kv_start, num_splits=num_splits, block_n=block_n,
    )  # fmt: skip
    if not group_bounds:
        return o_suf
    return merge_states(o_pre, lse_pre, o_suf, lse_suf, q.dtype)
