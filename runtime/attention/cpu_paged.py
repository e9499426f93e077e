"""CPU attention backend whose decode reads K/V in place from the paged pool.

Decode (one query row per request) runs the C kernel of cpu_kernels.py over each request's
row of the req-to-token table: no per-layer gather into a padded copy, no padding mask.
Everything else (prompt extends, cached-prefix extends, draft verification and any custom
mask) is the torch reference backend's path, inherited unchanged, so the two backends can
only differ in decode. Where the kernel cannot run (no C compiler, a KV dtype it has no
variant for, a CUDA pool) decode is the torch backend's too.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.runtime import cpu_kernels
from loom.runtime.attention.torch_backend import TorchAttnBackend
from loom.runtime.forward_batch import ForwardBatch


@dataclass
class _PagedDecodeMeta:
    max_len: int
    total_len: int


class CpuPagedAttnBackend(TorchAttnBackend):
    def __init__(self, **kwargs: object):
        super().__init__(**kwargs)
        self._lib = cpu_kernels.load()

    def _kernel_runs(self, batch: ForwardBatch) -> bool:
        pool = batch.token_to_kv_pool
        k0 = pool.k_buffers[0]
        return (
            self._lib is not None
            and k0.device.type == "cpu"
            and cpu_kernels.supports(k0.dtype)
            and pool.v_buffers[0].dtype == k0.dtype
        )

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode and self._kernel_runs(batch):
            batch.attn_metadata = _PagedDecodeMeta(max(batch.seq_lens_cpu), sum(batch.seq_lens_cpu))
            return
        super().init_forward_metadata(batch)

    def forward_decode(self, q, k, v, layer, batch):
        meta = batch.attn_metadata
        if not isinstance(meta, _PagedDecodeMeta):
            return super().forward_decode(q, k, v, layer, batch)
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        return cpu_kernels.decode_attention(
            self._lib,
            q,
            k_buf,
            v_buf,
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            meta.max_len,
            layer.scaling,
            meta.total_len,
        )
