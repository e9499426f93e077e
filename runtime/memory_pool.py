"""KV memory: request rows of slot indices, and per-layer K/V buffers (the page allocator that
hands out their slots is runtime/kv_pages.py, torch-free).

Slot 0 .. page_size-1 form a reserved padding page: it is never handed out, so a zero in
`req_to_token` never aliases live KV, and padded positions can safely write there.
"""

from __future__ import annotations

import mmap

import torch

from loom.runtime.kv_pages import RequestRows

# "float32": loom's own value (SGLang has none), to pin a float32 pool where "auto" picks
# bfloat16 (a GGUF model in the C forward: ModelRunner._kv_cache_dtype)
_KV_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV pool's storage dtype for --kv-cache-dtype ("auto": the model dtype). K/V are
    rounded to it when stored; every attention path reads them back into float32 (the C
    kernels) or the query's dtype (torch) before its math. Triton's kernels are only tested
    with a pool in the model dtype, so another combination is refused there."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported yet")
    dtype = _KV_DTYPES[kv_cache_dtype]
    if backend == "triton" and dtype != model_dtype:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} with a {model_dtype} model is not supported yet"
            " by the triton attention backend (use --dtype bfloat16, or the torch backend)"
        )
    return dtype


def zeros_untouched(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    """torch.zeros, but on the CPU in fresh anonymous pages: zero-filled by the kernel when
    first touched, so only the pages written become resident. `torch.zeros` writes every byte:
    a default Gemma 3 server's request rows (257 x 32,769 int64) were 67 MB resident at
    start-up, while the rows a server uses hold at most its pool's tokens."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = 1
    for n in shape:
        count *= n
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, count * dtype.itemsize)  # the tensor keeps the map alive
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


class ReqToTokenPool(RequestRows):
    """`kv_pages.RequestRows` over a torch table: fresh anonymous pages on the CPU
    (`zeros_untouched`), zeros on a device. The torch runner's (the eager and CUDA paths index
    it with tensors); the torch-free runner holds a numpy table instead."""

    def __init__(self, size: int, max_context_len: int, device: str):
        super().__init__(zeros_untouched((size, max_context_len), torch.int64, device))


class TokenToKVPool:
    """Per-layer K and V buffers of shape [num_slots, kv_heads, head_dim]."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str,
        v_head_dim: int | None = None,
        padding_slots: int = 1,
    ):
        from loom.runtime.distributed import pp_layer_range

        self.num_slots = num_slots
        # a pipeline stage keeps the KV of its own layers only (the others get empty buffers)
        mine = pp_layer_range(num_layers)

        def buffer(dim: int, layer: int) -> torch.Tensor:
            rows = num_slots if layer in mine else 0
            return torch.empty((rows, kv_heads, dim), dtype=dtype, device=device)

        # Uninitialised: a slot is always written before it is read, except the padding page,
        # which padded decode positions read (masked out) and so must hold finite values.
        self.k_buffers = [buffer(head_dim, i) for i in range(num_layers)]
        self.v_buffers = [buffer(v_head_dim or head_dim, i) for i in range(num_layers)]
        for buf in self.k_buffers + self.v_buffers:
            buf[:padding_slots].zero_()

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffers[layer_id][slots] = k.to(self.k_buffers[layer_id].dtype)
        self.v_buffers[layer_id][slots] = v.to(self.v_buffers[layer_id].dtype)

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def bytes_per_token(self) -> int:
        total = sum(b.numel() * b.element_size() for b in self.k_buffers + self.v_buffers)
        return total // self.num_slots
