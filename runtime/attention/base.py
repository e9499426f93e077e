"""The attention-backend contract, its registry and factory."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from loom.runtime.attention import sliding_window

if TYPE_CHECKING:
    from loom.runtime.forward_batch import ForwardBatch
    from loom.runtime.layers.attention import Attention


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `init_forward_metadata` runs once per forward (index tensors shared by all layers);
    `forward_extend` handles new tokens after a cached prefix with a causal mask (prompt
    chunks, jump-forward text, and linear draft verification, which is causal too), or with
    `batch.custom_masks[i]` where that is given (draft trees: each node sees its ancestors);
    `forward_decode` handles one token per request. q is [T, heads, head_dim]; k and v are
    [T, kv_heads, head_dim] and are written to the cache before attending.
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        if sliding_window.needed(layer, batch):  # a local layer past its window: one path
            return sliding_window.forward(q, k, v, layer, batch)
        if batch.mode.is_decode:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)


_REGISTRY = {
    "torch": "loom.runtime.attention.torch_backend:TorchAttnBackend",
    "cpu_paged": "loom.runtime.attention.cpu_paged:CpuPagedAttnBackend",
    "triton": "loom.runtime.attention.triton_backend:TritonAttnBackend",
}


def create_attention_backend(name: str, **kwargs) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; choose from {sorted(_REGISTRY)}"
        )
    module_name, cls_name = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"attention_backend: {name!r} is not available here ({e})") from e
    return getattr(module, cls_name)(**kwargs)
