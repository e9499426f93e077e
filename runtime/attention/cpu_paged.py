"""CPU attention backend that reads K/V in place from the paged pool.

Decode (one query row per request) runs the C decode kernel of cpu_kernels.py over each
request's row of the req-to-token table: no per-layer gather into a padded copy, no padding
mask. Extend steps whose requests each bring few new tokens (a draft tree's verify step, short
extends after a cached prefix) run the C extend kernel the same way, causally or through
`batch.custom_masks`' tree masks. Longer extends (prompts) are the torch reference backend's
path, inherited unchanged: SDPA's blocked kernel wins once a request has many query rows.
Decode steps where requests share a long prefix also go to the torch backend, for its
shared-prefix cascade. Where the kernels cannot run (no C compiler, a KV dtype they have no
variant for, a CUDA pool) everything is the torch backend's.
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.runtime import cpu_kernels
from loom.runtime.attention import shared_prefix
from loom.runtime.attention.torch_backend import TorchAttnBackend
from loom.runtime.forward_batch import ForwardBatch


@dataclass
class _PagedDecodeMeta:
    max_len: int
    total_len: int
    shared: None = None  # a step whose requests may share a prefix takes the torch cascade


# Most new tokens per request for which the C extend kernel beats the torch path (measured
# with benchmarks/bench_engine_room.py's --verify-probe on the bundled model: see
# docs/benchmarks.md "Engine room"); beyond it SDPA's blocked kernel amortises better.
MAX_KERNEL_EXTEND = 16


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
        if batch.mode.is_decode and self._kernel_runs(batch) and not _may_share_prefix(batch):
            batch.attn_metadata = _PagedDecodeMeta(max(batch.seq_lens_cpu), sum(batch.seq_lens_cpu))
            return
        if not batch.mode.is_decode and self._kernel_runs(batch):
            exts = [s - p for s, p in zip(batch.seq_lens_cpu, batch.prefix_lens_cpu)]
            if max(exts, default=0) <= MAX_KERNEL_EXTEND:
                plan = cpu_kernels.ExtendPlan.build(batch.seq_lens_cpu, exts, batch.custom_masks)
                batch.attn_metadata = plan
                return
        super().init_forward_metadata(batch)

    def forward_extend(self, q, k, v, layer, batch):
        plan = batch.attn_metadata
        if not isinstance(plan, cpu_kernels.ExtendPlan):
            return super().forward_extend(q, k, v, layer, batch)
        pool = batch.token_to_kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv(layer.layer_id)
        table = batch.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices
        return cpu_kernels.extend_attention(
            self._lib, q, k_buf, v_buf, table, rows, plan, layer.scaling
        )

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


def _may_share_prefix(batch: ForwardBatch) -> bool:
    """Whether two adjacent requests start with the same MIN_SHARED_TOKENS KV slots (a fork's
    branches, parallel samples): such a step goes to the torch backend, whose shared-prefix
    cascade attends to the common prefix once per group instead of once per request."""
    n = shared_prefix.MIN_SHARED_TOKENS
    if batch.batch_size < 2 or max(batch.seq_lens_cpu) <= n:
        return False
    head = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, :n]
    return bool((head[1:] == head[:-1]).all(dim=1).any())
