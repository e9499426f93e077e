"""Shared-prefix (cascade) decode attention, in plain torch.

Requests forked from one prompt (a program's `fork(n)`, `n > 1`, parallel samples) read the
same KV slots for their common prefix. Attending per request gathers that prefix once per
request and layer: at 32 branches of a 300-token prompt, the gather and the per-request
attention were over half of a CPU decode step. Here each group of requests that share leading
slots attends to the prefix once, as one matrix product of all the group's queries against
the prefix keys, and each request attends to its own suffix separately; the two partial
softmaxes are merged exactly through their running max and sum (as FlashInfer's cascade does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Shorter shared prefixes are attended per request: the saving would not pay for the extra
# ops (measured even at 8 requests sharing 40 tokens on CPU).
MIN_SHARED_TOKENS = 64


@dataclass
class PrefixGroup:
    start: int  # rows start .. end-1 of the batch share
    end: int
    slots: torch.Tensor  # [shared] KV slots of the common prefix


def find_groups(slots: torch.Tensor, seq_lens: list[int]) -> list[PrefixGroup]:
    """Runs of adjacent rows of `slots` ([B, L], padded with 0) that share at least
    MIN_SHARED_TOKENS leading slots. A group's prefix stops before each member's last
    position, so every request keeps at least one token (its own) in its suffix."""
    b = slots.shape[0]
    if b < 2:
        return []
    same = (slots[1:] == slots[:-1]).to(torch.int32)
    lcp = same.cumprod(dim=1).sum(dim=1).tolist()  # common leading slots of rows i, i+1
    groups: list[PrefixGroup] = []
    start, shared = 0, 0
    for i in range(b):
        n = min(lcp[i], seq_lens[i] - 1, seq_lens[i + 1] - 1) if i + 1 < b else 0
        if n >= MIN_SHARED_TOKENS:
            shared = n if i == start else min(shared, n)
            continue
        if i > start:
            groups.append(PrefixGroup(start, i + 1, slots[start, :shared]))
        start, shared = i + 1, 0
    return groups


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
):
    """Softmax attention split for merging: q [..., M, D], k and v [..., N, D], mask
    broadcastable to [..., M, N] (True = attend). Returns the unnormalised output [..., M, D],
    the row max and the row sum of exp(score - max), both [..., M, 1]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = torch.exp(scores - row_max)
    return torch.matmul(probs, v), row_max, probs.sum(dim=-1, keepdim=True)


def merge(o1, m1, s1, o2, m2, s2):
    """Combine two partial softmaxes over disjoint key sets (still unnormalised)."""
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return o1 * w1 + o2 * w2, m, s1 * w1 + s2 * w2


@dataclass
class SharedPrefixPlan:
    """A decode batch split for shared-prefix attention. `rows` (in groups, in batch order)
    attend through `decode_attention`; `single_rows` (in no group) keep per-request
    attention over their own padded slots, so one long lone request does not widen the
    grouped requests' suffixes."""

    rows: torch.Tensor  # [n] batch rows in a group
    groups: list[PrefixGroup]  # start/end index into `rows`
    suffix: torch.Tensor  # [n, S] slots after each row's group prefix, padded with 0
    suffix_mask: torch.Tensor  # [n, S]
    single_rows: torch.Tensor  # [m] the other rows
    single_slots: torch.Tensor  # [m, L] their slots, padded with 0
    single_mask: torch.Tensor  # [m, L]

    @classmethod
    def build(
        cls, slots: torch.Tensor, seq_lens: torch.Tensor, groups: list[PrefixGroup]
    ) -> SharedPrefixPlan:
        """`slots` [B, max_len] padded with 0 and `groups` from `find_groups`."""
        device = slots.device
        grouped = [i for g in groups for i in range(g.start, g.end)]
        in_group = set(grouped)
        single = [i for i in range(slots.shape[0]) if i not in in_group]
        rows = torch.tensor(grouped, dtype=torch.int64, device=device)
        prefix = torch.zeros(len(grouped), dtype=seq_lens.dtype, device=device)
        packed, at = [], 0
        for g in groups:
            n = g.end - g.start
            prefix[at : at + n] = len(g.slots)
            packed.append(PrefixGroup(at, at + n, g.slots))
            at += n
        suffix, suffix_mask = _window(slots[rows], prefix, seq_lens[rows])
        single_rows = torch.tensor(single, dtype=torch.int64, device=device)
        zero = torch.zeros(len(single), dtype=seq_lens.dtype, device=device)
        single_slots, single_mask = _window(slots[single_rows], zero, seq_lens[single_rows])
        return cls(rows, packed, suffix, suffix_mask, single_rows, single_slots, single_mask)


def _window(slots: torch.Tensor, begin: torch.Tensor, end: torch.Tensor):
    """Row i's slots [begin_i, end_i), left-aligned and padded with 0, and their mask."""
    lens = end - begin
    cols = torch.arange(int(lens.max()) if len(lens) else 0, device=slots.device)
    mask = cols[None, :] < lens[:, None]
    idx = (begin[:, None] + cols[None, :]).clamp(max=max(slots.shape[1] - 1, 0))
    return torch.gather(slots, 1, idx).masked_fill(~mask, 0), mask


def decode_attention(q, k_buf, v_buf, suffix, suffix_mask, groups, scale) -> torch.Tensor:
    """q [B, H, D] (a plan's grouped rows); `suffix` [B, S] slots and `suffix_mask` [B, S].
    Returns [B, H, D]. Query head h reads KV head h // (H // kv_heads), as in SDPA's GQA."""
    b, h, d = q.shape
    hkv = k_buf.shape[1]
    qg = q.view(b, hkv, h // hkv, d)
    flat = suffix.reshape(-1)
    ks = k_buf.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
    vs = v_buf.index_select(0, flat).view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
    o, m, s = partial_attention(qg, ks, vs, suffix_mask[:, None, None, :], scale)
    for g in groups:
        n = g.end - g.start
        kp = k_buf.index_select(0, g.slots).transpose(0, 1).to(q.dtype)  # [hkv, P, d]
        vp = v_buf.index_select(0, g.slots).transpose(0, 1).to(q.dtype)
        qp = qg[g.start : g.end].transpose(0, 1).reshape(hkv, -1, d)  # [hkv, n * h/hkv, d]
        parts = partial_attention(qp, kp, vp, None, scale)
        op, mp, sp = (x.view(hkv, n, -1, x.shape[-1]).transpose(0, 1) for x in parts)
        rows = slice(g.start, g.end)
        o[rows], m[rows], s[rows] = merge(o[rows], m[rows], s[rows], op, mp, sp)
    return (o / s).reshape(b, h, d)
