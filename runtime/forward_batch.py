"""ForwardBatch: the tensors one model forward reads, and the context that carries it.

Model files never take the batch as an argument: attention layers read it with
`get_forward_batch()`, so model code reads like the Hugging Face reference.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from loom.runtime.attention.base import AttentionBackend
    from loom.runtime.memory_pool import ReqToTokenPool, TokenToKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prompt (or prompt chunk) tokens after a cached prefix
    DECODE = "decode"  # one new token per request
    VERIFY = "verify"  # speculative draft tokens, attended through a custom mask

    @property
    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    """Per-token tensors have length T (tokens in this step), per-request ones length B.

    Invariant: for request i, positions prefix_lens[i] .. seq_lens[i]-1 are computed in this
    step, their KV is written to `out_cache_loc`, and req_to_token[req_pool_indices[i], :seq_lens[i]]
    already holds every slot the request attends to (prefix and new).
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]  # tokens already in the KV cache before this step
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    logits_indices: torch.Tensor  # [N] rows of the hidden states that need logits
    custom_mask: torch.Tensor | None = None  # flattened [extend_len x seq_len] per request
    attn_metadata: Any = field(default=None)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def extend_lens_cpu(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens_cpu, self.prefix_lens_cpu)]


_current: ForwardBatch | None = None


def get_forward_batch() -> ForwardBatch:
    assert _current is not None, "attention called outside a forward_context"
    return _current


@contextlib.contextmanager
def forward_context(batch: ForwardBatch):
    global _current
    previous, _current = _current, batch
    try:
        yield batch
    finally:
        _current = previous
