"""The seam between the scheduler and the model runner, and the context a forward reads.

`ModelInput` is what the scheduler hands the runner for one step (numpy index arrays and
lists, sampling parameters included: this module and the scheduler never import torch; the
torch runner takes the arrays with `torch.as_tensor`, zero-copy); `ForwardOutput` is what
comes back (token ids and logprobs, never logits). `ForwardBatch` is the runner's
device-side view of one forward. Model files never take the batch as an argument: attention
layers read it with `get_forward_batch()`, so model code reads like the Hugging Face
reference.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from loom.runtime.attention.base import AttentionBackend
    from loom.runtime.memory_pool import ReqToTokenPool, TokenToKVPool
    from loom.runtime.sampling.info import SamplingInfo


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prompt (or prompt chunk) tokens after a cached prefix
    DECODE = "decode"  # one new token per request

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
    attn_metadata: Any = field(default=None)
    # per request: None (causal) or a bool [extend_len, seq_len] mask, True = attend (a draft
    # tree: rows are the fed tokens in order, columns the KV positions read through
    # req_to_token; tree nodes sit at columns kv_len + 1 + node index); None: all causal
    custom_masks: list[torch.Tensor | None] | None = None
    # what the model keeps for a drafter (`ModelInput.capture`): None nothing, else a tuple
    # of layer ids, possibly empty; the forward sets `captured` = (final hidden states
    # [T, hidden], [residual stream after each such layer])
    capture: tuple[int, ...] | None = None
    captured: Any = None
    # every row a prompt row (`ModelInput.prompt`): the compiled forward's quantized matmuls
    # may take 8-bit activations (quant_i8.c); decode and verify rows never do
    prompt: bool = False

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def extend_lens_cpu(self) -> list[int]:
        return [s - p for s, p in zip(self.seq_lens_cpu, self.prefix_lens_cpu)]


@dataclass
class StepDrafts:
    """A step's drafts, one entry per request (the scheduler's drafter proposed them):
    `tokens[i]` the draft tokens request i verifies after its last real token ([]: none);
    `parents[i]` their tree's parents (`loom.runtime.spec.DraftTree`: -1 the last real token,
    else an earlier node), None for a chain."""

    tokens: list[list[int]]
    parents: list[list[int] | None]

    @property
    def has_trees(self) -> bool:
        return any(p is not None for p in self.parents)


@dataclass
class ModelInput:
    """One step as the scheduler plans it, on the CPU (the runner moves it to its device).

    Index arrays (1-D numpy int64; a test may hand CPU tensors, which the runners take too)
    have length T, per-request lists length B. Request i computes positions
    prefix_lens[i] .. seq_lens[i]-1. Sampling: request i samples `sample_counts[i]` tokens
    (0: none, e.g. a prompt chunk; 1: the next token; 1 + len(drafts.tokens[i]): draft
    verification), from the logits of its last `sample_counts[i]` positions; `sampling` has
    one row per request with sample_counts > 0. Prompt logprobs: `input_logprob_targets[i]`
    are the prompt tokens scored by the logits of this step's positions starting at
    `input_logprob_starts[i]` (an index into this request's positions), or None. A draft
    tree (`drafts.parents[i]`) fills KV columns prefix_lens[i] .. seq_lens[i]-1 in node
    order; its positions (`positions`) are the last real token's + 1 + node depth.
    """

    mode: ForwardMode
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    out_cache_loc: np.ndarray  # [T]
    req_pool_indices: np.ndarray  # [B]
    seq_lens: list[int]
    prefix_lens: list[int]
    sample_counts: list[int]
    drafts: StepDrafts
    sampling: SamplingInfo | None
    logprob_top_nums: list[int | None]  # per request: None = no logprobs, else top-k count
    input_logprob_starts: list[int]
    input_logprob_targets: list[list[int] | None]
    # `seq_lens` as an int64 array, when the scheduler built it with the other index vectors
    # (None: the runner makes it)
    seq_lens_tensor: np.ndarray | None = None
    # layers whose hidden states the forward keeps for the drafter (None: none; (): the final
    # hidden states only), returned in `ForwardOutput.hidden`
    capture: tuple[int, ...] | None = None
    # greedy chains whose grammar mask rows are left lazy (`step_grammar.LazyRows`, built on
    # one rank only): the runner resolves them around the sampler's argmax
    lazy_rows: Any = None
    # a prefill step (not a decode batch: no generated token, no draft among its rows)
    prompt: bool = False


@dataclass
class ForwardOutput:
    """What one step produced, per request (lists of length B, ragged inside).

    `next_ids[i]`: the tokens request i gains this step, k >= 1 when it sampled (the accepted
    draft tokens then one sampled token), [] otherwise. A draft tree's accepted nodes have
    had their KV moved to their final positions (kv_len + 1 + j) before this returns. `logprobs[i][j]` is the raw model
    logprob of next_ids[i][j] and `top_logprobs[i][j]` its [(logprob, id)] top list (both
    only for requests that asked). `input_logprobs[i]` scores `input_logprob_targets[i]`.
    """

    next_ids: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[list[tuple[float, int]]]]
    input_logprobs: list[list[float]]
    input_top_logprobs: list[list[list[tuple[float, int]]]]
    # per request with a draft: the accepted draft nodes, in order (a chain: 0 .. k-1; a
    # tree: its accepted root path). Fed row 0 is the last real token, fed row 1 + j node j.
    accepted_nodes: list[list[int]] | None = None
    # `ModelInput.capture`'s hidden states: (final [T, hidden], [per captured layer]), or None
    hidden: Any = None


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor from a (nested) Python list, through numpy: ~3x faster than torch.tensor
    for the short lists a step builds (1.5 against 4.5 us for 2 ints, 6 against 14 for 128).
    For the torch runner and its helpers (torch imported here, not by this module)."""
    import torch

    if not _NUMPY_DTYPES:
        _NUMPY_DTYPES.update({torch.int64: np.int64, torch.float32: np.float32,
                              torch.bool: np.bool_})  # fmt: skip
    return torch.from_numpy(np.array(values, dtype=_NUMPY_DTYPES[dtype]))


_NUMPY_DTYPES: dict = {}  # torch dtype -> numpy dtype, filled by the first host_tensor


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
