"""Attention through the Triton kernels of loom.kernels (CUDA; the CPU only under Triton's
interpreter, for tests).

Same contract as the torch backend (torch_backend.py, the reference it is tested against):
new K/V are stored into the pool, then every request attends to its KV read in place through
its page-table row, with no gather copy. Decode takes split-K when contexts are long, and
shared-prefix (cascade) attention when adjacent requests share a long prefix (the torch
backend's `shared_prefix.find_groups` picks the groups for both). Extend is causal, or takes
per-request custom masks for tree verification (`batch.custom_masks`, the torch backend's
convention: bool [extend_len, seq_len], True = attend, columns are KV positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.kernels import cascade, decode_attention, extend_attention, kv_store
from loom.kernels._util import interpreted
from loom.runtime.attention import shared_prefix
from loom.runtime.attention.base import AttentionBackend
from loom.runtime.forward_batch import ForwardBatch


@dataclass
class _DecodeMeta:
    num_splits: int
    groups: list[tuple[int, int, int]]  # (first row, end row, shared prefix length)


@dataclass
class _ExtendMeta:
    prefix_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    qo_starts: torch.Tensor  # [B] first row of each request's tokens in q
    max_extend_len: int
    masks: list[torch.Tensor | None] | None = None  # batch.custom_masks (None: all causal)
    packed: tuple[torch.Tensor, torch.Tensor] | None = None  # (flat mask, starts), on demand


class TritonAttnBackend(AttentionBackend):
    def __init__(self, **_: object):
        if not torch.cuda.is_available() and not interpreted():
            raise ValueError(
                "attention_backend: 'triton' needs CUDA (on the CPU only under TRITON_INTERPRET=1,"
                " Triton's interpreter, for tests); use 'torch'"
            )

    def graph_decode_metadata(self, max_context_len: int) -> _DecodeMeta:
        """Decode metadata a captured CUDA graph replays for any batch (runtime/graph_runner.py):
        the split count of the longest context the pool holds (each request's split length is
        computed inside the kernel) and no shared-prefix groups (their launches depend on the
        step's data)."""
        return _DecodeMeta(decode_attention.num_splits_for(max_context_len), [])

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode:
            lens = batch.seq_lens_cpu
            groups = []
            if len(lens) > 1 and max(lens) > shared_prefix.MIN_SHARED_TOKENS:
                table = batch.req_to_token_pool.req_to_token
                slots = table[batch.req_pool_indices, : max(lens)]
                cols = torch.arange(max(lens), device=slots.device)
                slots = slots.masked_fill(cols[None, :] >= batch.seq_lens[:, None], 0)
                groups = [
                    (g.start, g.end, len(g.slots)) for g in shared_prefix.find_groups(slots, lens)
                ]
            splits = decode_attention.num_splits_for(max(lens))
            batch.attn_metadata = _DecodeMeta(splits, groups)
            return
        device = batch.seq_lens.device
        prefix = torch.tensor(batch.prefix_lens_cpu, dtype=torch.int64)
        ext = torch.tensor(batch.extend_lens_cpu, dtype=torch.int64)
        starts = torch.cumsum(ext, 0) - ext
        batch.attn_metadata = _ExtendMeta(
            prefix.to(device),
            ext.to(device),
            starts.to(device),
            int(ext.max()),
            masks=batch.custom_masks,
        )

    def forward_extend(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        kv_store.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        meta: _ExtendMeta = batch.attn_metadata
        flat = starts = None
        if meta.masks is not None and any(m is not None for m in meta.masks):
            if meta.packed is None:  # once per forward, shared by every layer
                meta.packed = extend_attention.pack_custom_masks(self._full_masks(meta), q.device)
            flat, starts = meta.packed
        return extend_attention.extend_attention(
            q.contiguous(),
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.qo_starts,
            meta.max_extend_len,
            layer.scaling,
            flat,
            starts,
        )

    @staticmethod
    def _full_masks(meta: _ExtendMeta) -> list[torch.Tensor]:
        """Requests without a custom mask get their causal mask written out."""
        out = []
        for mask, pre, ext in zip(meta.masks, meta.prefix_lens.tolist(), meta.extend_lens.tolist()):
            if mask is None:
                cols = torch.arange(pre + ext)
                mask = cols[None, :] <= torch.arange(ext)[:, None] + pre
            out.append(mask)
        return out

    def forward_decode(self, q, k, v, layer, batch):
        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        kv_store.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v)
        meta: _DecodeMeta = batch.attn_metadata
        args = (
            q.contiguous(),
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            layer.scaling,
        )
        if meta.groups:
            return cascade.cascade_decode_attention(*args, meta.groups, num_splits=meta.num_splits)
        out, _ = decode_attention.decode_attention(*args, num_splits=meta.num_splits)
        return out
