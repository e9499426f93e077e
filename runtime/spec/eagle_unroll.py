"""Whole-sequence passes for training and evaluating an EAGLE head (no KV cache, no scheduler).

`target_pass` runs loom's own target model over [B, T] token rows (one extend per row through
the normal forward context) and returns its logits and the features the head reads.
`unroll` runs the head for `steps` draft steps at every position at once ("training-time
test", EAGLE-3): step s at row p is the s-th draft step of a chain that starts after the
committed position c = p - s, so its query sees the step-0 entries at positions <= c and the
entry of each step j in 1..s at position c + j, exactly what the serving draft loop
(eagle_drafter.py) attends to. Step 0 reads the target's features; step s >= 1 reads the
head's own output of step s-1 one position to the left, and either the true next tokens
(teacher forcing, training) or its own greedy drafts (evaluation).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context
from loom.runtime.models.llama import head_dim_of


def target_pass(model, ids: torch.Tensor, capture: tuple[int, ...] | None):
    """ids [B, T] -> (float32 logits [B, T, V], features [B, T, F]): the final hidden states
    (capture None: EAGLE) or the residual streams after the `capture` layers, concatenated
    (EAGLE-3)."""
    from loom.runtime.attention.torch_backend import TorchAttnBackend
    from loom.runtime.memory_pool import ReqToTokenPool, TokenToKVPool

    cfg = model.config
    b, t = ids.shape
    device = ids.device
    dtype = next(model.parameters()).dtype
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    n = b * t
    kv = TokenToKVPool(n + 1, cfg.num_hidden_layers, kv_heads, head_dim_of(cfg), dtype, device)
    rows = ReqToTokenPool(b, t, device)
    rows.req_to_token[:] = torch.arange(1, n + 1, device=device).view(b, t)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=ids.reshape(-1),
        positions=torch.arange(t, device=device).repeat(b),
        out_cache_loc=torch.arange(1, n + 1, device=device),
        req_pool_indices=torch.arange(b, device=device),
        seq_lens=torch.full((b,), t, device=device),
        seq_lens_cpu=[t] * b,
        prefix_lens_cpu=[0] * b,
        req_to_token_pool=rows,
        token_to_kv_pool=kv,
        attn_backend=TorchAttnBackend(),
        logits_indices=torch.arange(n, device=device),
    )
    batch.attn_backend.init_forward_metadata(batch)
    batch.capture = tuple(capture or ())
    with forward_context(batch):
        logits = model(batch.input_ids, batch.positions)
    final, aux = batch.captured
    feats = torch.cat(aux, dim=-1) if capture else final
    return logits.view(b, t, -1), feats.view(b, t, -1)


class _UnrollAttention:
    """Stands in for the attention backend during `unroll`: keeps each step's K/V and applies
    the chain mask."""

    def __init__(self, b: int, t: int):
        self.b, self.t = b, t
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, layer, batch):
        b, t = self.b, self.t
        q = q.view(b, t, layer.num_heads, -1).transpose(1, 2)
        self.keys.append(k.view(b, t, layer.num_kv_heads, -1).transpose(1, 2))
        self.values.append(v.view(b, t, layer.num_kv_heads, -1).transpose(1, 2))
        mask = chain_mask(t, len(self.keys) - 1, q.device)
        out = F.scaled_dot_product_attention(
            q,
            torch.cat(self.keys, dim=2).to(q.dtype),
            torch.cat(self.values, dim=2).to(q.dtype),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.is_gqa,
        )
        return out.transpose(1, 2).reshape(b * t, layer.num_heads, -1)


def chain_mask(t: int, step: int, device) -> torch.Tensor:
    """[t, (step + 1) * t] bool: row p sees step-0 columns <= p - step and, in block j
    (1..step), column p - step + j."""
    p = torch.arange(t, device=device)[:, None]
    q = torch.arange(t, device=device)[None, :]
    blocks = [q <= p - step] + [q == p - step + j for j in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def unroll(
    head, features: torch.Tensor, next_ids: torch.Tensor, steps: int, teacher_forcing: bool
) -> list[torch.Tensor]:
    """features [B, T, F] (the target's), next_ids [B, T] (row p: the token at p + 1) ->
    draft-vocabulary logits [B, T, Vd] of each step. Row p of step s predicts the token at
    p + 2 of the chain that starts after position p - s (valid for p >= s)."""
    b, t, _ = features.shape
    device = features.device
    attn = _UnrollAttention(b, t)
    positions = torch.arange(t, device=device).repeat(b)
    out = []
    feats, ids = features.reshape(b * t, -1), next_ids.reshape(-1)
    with forward_context(SimpleNamespace(attn_backend=attn)):
        for s in range(steps):
            hidden = head(positions, ids, feats, fused=s == 0)
            logits = head.logits(hidden)
            out.append(logits.view(b, t, -1))
            if s + 1 == steps:
                break
            feats = _shift_right(hidden.view(b, t, -1)).reshape(b * t, -1)
            if not teacher_forcing:
                drafted = head.to_target_ids(logits.argmax(-1)).view(b, t)
                ids = _shift_right(drafted).reshape(-1)
    return out


def _shift_right(x: torch.Tensor) -> torch.Tensor:
    """Row p gets row p - 1 (row 0 gets zeros): along dim 1 of [B, T, ...]."""
    out = torch.zeros_like(x)
    out[:, 1:] = x[:, :-1]
    return out


def chain_accept_lengths(drafts: torch.Tensor, seq: torch.Tensor, start: int) -> list[int]:
    """Tokens per verify step (accepted drafts + 1) of greedy chain speculation along `seq`,
    the target's own greedy output after the prompt seq[:start + 1] (its first token,
    seq[start + 1], comes from the prefill). drafts [S, T] (target ids): step s at row p
    drafts the token at p + 2 of the chain that starts after p - s."""
    steps, n = drafts.shape[0], seq.numel()
    lengths = []
    c = start
    while c + 2 < n:
        m = 0
        while m < steps and c + 2 + m < n and int(drafts[m, c + m]) == int(seq[c + 2 + m]):
            m += 1
        lengths.append(m + 1)
        c += m + 1
    return lengths
