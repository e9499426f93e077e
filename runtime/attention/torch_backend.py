"""Reference attention backend in plain torch (CPU and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.runtime.attention.base import AttentionBackend
from loom.runtime.forward_batch import ForwardBatch


@dataclass
class _ExtendMeta:
    kv_slots: list[torch.Tensor]  # per request: slots of positions 0 .. seq_len-1
    masks: list[torch.Tensor]  # per request: [extend_len, seq_len] bool, True = attend
    token_starts: list[int]


@dataclass
class _DecodeMeta:
    kv_slots: torch.Tensor  # [B, max_len], padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, max_len]


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
            batch.attn_metadata = _DecodeMeta(slots, mask[:, None, None, :])
            return
        kv_slots, masks, starts = [], [], []
        start, mask_offset = 0, 0
        req_rows = batch.req_pool_indices.tolist()
        for row, prefix, seq in zip(req_rows, batch.prefix_lens_cpu, batch.seq_lens_cpu):
            ext = seq - prefix
            kv_slots.append(table[row, :seq])
            mask = causal_mask(prefix, ext, device)
            if batch.custom_mask is not None:
                custom = batch.custom_mask[mask_offset : mask_offset + ext * seq].view(ext, seq)
                mask = custom.to(torch.bool)
                mask_offset += ext * seq
            masks.append(mask)
            starts.append(start)
            start += ext
        batch.attn_metadata = _ExtendMeta(kv_slots, masks, starts)

    def forward_extend(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        meta: _ExtendMeta = batch.attn_metadata
        out = torch.empty(
            q.shape[0], layer.num_heads, layer.v_head_dim, dtype=q.dtype, device=q.device
        )
        for slots, mask, start in zip(meta.kv_slots, meta.masks, meta.token_starts):
            ext = mask.shape[0]
            qi = q[start : start + ext].transpose(0, 1)  # [H, ext, D]
            ki = k_buf[slots].transpose(0, 1).to(q.dtype)  # [Hkv, seq, D]
            vi = v_buf[slots].transpose(0, 1).to(q.dtype)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=layer.is_gqa
            )
            out[start : start + ext] = oi.transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        meta: _DecodeMeta = batch.attn_metadata
        ks = k_buf[meta.kv_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        vs = v_buf[meta.kv_slots].transpose(1, 2).to(q.dtype)
        qs = q.unsqueeze(2)  # [B, H, 1, D]
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=meta.mask, scale=layer.scaling, enable_gqa=layer.is_gqa
        )
        return out.squeeze(2)
