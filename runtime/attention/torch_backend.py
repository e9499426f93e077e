"""Reference attention backend in plain torch (CPU and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.runtime.attention import shared_prefix
from loom.runtime.attention.base import AttentionBackend
from loom.runtime.forward_batch import ForwardBatch


@dataclass
class _ExtendMeta:
    kv_slots: list[torch.Tensor]  # per request: slots of positions 0 .. seq_len-1
    # per request: [extend_len, seq_len] bool (causal, or `batch.custom_masks`'s tree mask;
    # None: causal over the new tokens alone)
    masks: list[torch.Tensor | None]
    token_starts: list[int]
    extend_lens: list[int]


@dataclass
class _DecodeMeta:
    kv_slots: torch.Tensor  # [B * max_len], padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, max_len]
    max_len: int
    # gather buffers, allocated by the first layer and reused by the others: index_select into
    # a preallocated buffer is ~5x faster on CPU than fancy indexing into a fresh tensor
    k_out: torch.Tensor | None = None
    v_out: torch.Tensor | None = None
    # requests sharing a long prefix attend to it once per group (shared_prefix.py)
    shared: shared_prefix.SharedPrefixPlan | None = None


def causal_mask(prefix_len: int, extend_len: int, device) -> torch.Tensor:
    """[extend_len, prefix_len + extend_len]: token j sees the prefix and new tokens <= j."""
    cols = torch.arange(prefix_len + extend_len, device=device)
    rows = torch.arange(extend_len, device=device)[:, None] + prefix_len
    return cols[None, :] <= rows


class TorchAttnBackend(AttentionBackend):
    def __init__(self, **_: object):
        pass

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        device = table.device
        if batch.mode.is_decode:
            max_len = max(batch.seq_lens_cpu)
            slots = table[batch.req_pool_indices, :max_len]
            mask = torch.arange(max_len, device=device)[None, :] < batch.seq_lens[:, None]
            slots = slots.masked_fill(~mask, 0)
            meta = _DecodeMeta(slots.reshape(-1), mask[:, None, None, :], max_len)
            groups = shared_prefix.find_groups(slots, batch.seq_lens_cpu)
            if groups:
                meta.shared = shared_prefix.SharedPrefixPlan.build(slots, batch.seq_lens, groups)
            batch.attn_metadata = meta
            return
        kv_slots, masks, starts, exts = [], [], [], []
        start = 0
        req_rows = batch.req_pool_indices.tolist()
        custom = batch.custom_masks or [None] * len(req_rows)
        for row, prefix, seq, tree in zip(
            req_rows, batch.prefix_lens_cpu, batch.seq_lens_cpu, custom
        ):
            ext = seq - prefix
            kv_slots.append(table[row, :seq])
            if tree is not None:  # a draft tree: each node sees its ancestors only
                masks.append(tree)
            else:  # no cached prefix: plain causal attention, which takes the fused kernel
                masks.append(None if prefix == 0 else causal_mask(prefix, ext, device))
            starts.append(start)
            exts.append(ext)
            start += ext
        batch.attn_metadata = _ExtendMeta(kv_slots, masks, starts, exts)

    def forward_extend(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        meta: _ExtendMeta = batch.attn_metadata
        out = torch.empty(
            q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device
        )
        for slots, mask, start, ext in zip(
            meta.kv_slots, meta.masks, meta.token_starts, meta.extend_lens
        ):
            qi = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
            if mask is None:  # the new tokens are the whole sequence: attend to them directly
                ki, vi = k[start : start + ext], v[start : start + ext]
            else:
                ki, vi = k_buf[slots], v_buf[slots]
            ki = ki.transpose(0, 1).to(q.dtype)  # [Hkv, seq, D]
            vi = vi.transpose(0, 1).to(q.dtype)
            oi = F.scaled_dot_product_attention(
                qi,
                ki,
                vi,
                attn_mask=mask,
                is_causal=mask is None,
                scale=layer.scaling,
                enable_gqa=layer.is_gqa,
            )
            out[start : start + ext] = oi.transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        meta: _DecodeMeta = batch.attn_metadata
        plan = meta.shared
        if plan is None:
            if meta.k_out is None or meta.k_out.shape[1:] != k_buf.shape[1:]:
                meta.k_out = k_buf.new_empty((meta.kv_slots.numel(), *k_buf.shape[1:]))
                meta.v_out = v_buf.new_empty((meta.kv_slots.numel(), *v_buf.shape[1:]))
            return _decode(q, k_buf, v_buf, meta.kv_slots, meta.mask, layer, meta.k_out, meta.v_out)
        if not len(plan.single_rows):  # every row is in a group: rows are 0 .. B-1 in order
            return shared_prefix.decode_attention(
                q, k_buf, v_buf, plan.suffix, plan.suffix_mask, plan.groups, layer.scaling
            )
        out = torch.empty_like(q)
        out[plan.rows] = shared_prefix.decode_attention(
            q[plan.rows], k_buf, v_buf, plan.suffix, plan.suffix_mask, plan.groups, layer.scaling
        )
        mask = plan.single_mask[:, None, None, :]
        slots = plan.single_slots.reshape(-1)
        out[plan.single_rows] = _decode(q[plan.single_rows], k_buf, v_buf, slots, mask, layer)
        return out


def _decode(q, k_buf, v_buf, kv_slots, mask, layer, k_out=None, v_out=None) -> torch.Tensor:
    """Per-request decode attention: q [B, H, D] over `kv_slots` [B * L] (padded with slot 0,
    masked out by `mask` [B, 1, 1, L])."""
    b, max_len = q.shape[0], mask.shape[-1]
    ks = torch.index_select(k_buf, 0, kv_slots, out=k_out)
    vs = torch.index_select(v_buf, 0, kv_slots, out=v_out)
    ks = ks.view(b, max_len, *k_buf.shape[1:]).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    vs = vs.view(b, max_len, *v_buf.shape[1:]).transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), ks, vs, attn_mask=mask, scale=layer.scaling, enable_gqa=layer.is_gqa
    )
    return out.squeeze(2)
