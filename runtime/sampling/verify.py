"""Verification and the target distribution: temperature and top-p / top-k / min-p
(`target_probs`), draft-tree walks with multi-candidate rejection sampling (`verify_trees`),
the residual a rejected row samples from, and the exponential race."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from loom.runtime.sampling.rng import hashed_uniform, hashed_uniform_columns

if TYPE_CHECKING:
    from loom.runtime.sampling.info import SamplingInfo


def verify_trees(
    probs: torch.Tensor | None, greedy_ids: torch.Tensor, info: SamplingInfo
) -> list[tuple[list[int], int]]:
    """Walk each draft tree from its root row: at a node, its children are tried in order.
    Greedy: a child is accepted when its token is the argmax. Sampled (multi-candidate
    rejection sampling, as SpecInfer): child k with token x and draft distribution q_k
    (one-hot for a deterministic drafter) is accepted with probability min(1, p'(x) / q_k(x)),
    a coin hashed from (seed, position, -1 - k); if rejected p' <- max(p' - q_k, 0)
    renormalized and the next child is tried; when no child is accepted the token is sampled
    from p' with the position's token noise. Each emitted token thus follows the target's
    distribution given its ancestors. A chain (one child per node) verifies exactly as the
    chain path does. Returns per tree (accepted node indices, the token after them)."""
    out = []
    greedy_list = greedy_ids.tolist()
    coins = None
    if probs is not None:  # every row's coins for its first children, in one hash
        most = max(len(t[1]) for t in info.trees)
        columns = -1 - torch.arange(most, device=info.seeds.device)
        coins = hashed_uniform_columns(info.seeds, info.steps, columns).tolist()
    for root, tokens, parents, q in info.trees:
        children: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        for i, par in enumerate(parents):
            children[par + 1].append(i)
        path: list[int] = []
        node = -1
        greedy = bool(info.greedy[root])
        while True:
            row = root + 1 + node
            kids = children[node + 1]
            if greedy or probs is None:
                want = greedy_list[row]
                nxt = next((k for k in kids if tokens[k] == want), None)
                if nxt is None:
                    out.append((path, want))
                    break
                path.append(nxt)
                node = nxt
                continue
            p = probs[row]
            nxt = None
            for j, k in enumerate(kids):
                x = tokens[k]
                if q is None:
                    qk = torch.zeros_like(p)
                    qk[x] = 1.0
                    q_x = 1.0
                else:
                    qk = q[k].to(p.device, p.dtype)
                    q_x = max(float(qk[x]), 1e-30)
                if coins[row][j] < float(p[x]) / q_x:
                    nxt = k
                    break
                p = residual(p[None], qk[None])[0]
            if nxt is None:
                seed, step = info.seeds[row : row + 1], info.steps[row : row + 1]
                noise = hashed_uniform(seed, step, p.shape[-1])
                out.append((path, int(race(p[None], noise)[0])))
                break
            path.append(nxt)
            node = nxt
    return out


# On the CPU the top-p / top-k / min-p filter first looks at each row's TOP_CANDIDATES largest
# probabilities only: a full-vocabulary sort of [64, 151936] takes ~1 s on one core, topk(1024)
# a few tens of ms. Exact: it is used only when every row's cut provably falls inside them.
TOP_CANDIDATES = 1024


def target_probs(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-p / top-k / min-p."""
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_filter or info.need_min_p:
        sorted_probs, order = _head(probs, info)
        ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)[None, :]
        drop = (sorted_probs.cumsum(-1) - sorted_probs) > info.top_ps[:, None]
        drop |= ranks >= info.top_ks[:, None]
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        probs /= probs.sum(dim=-1, keepdim=True)  # the acceptance test reads p(x) itself
    return probs


def _head(probs: torch.Tensor, info: SamplingInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities in descending order with their token ids: all of them, or (on
    the CPU) only the TOP_CANDIDATES largest when every row drops everything past them anyway:
    its top_k is within them, or their sum already exceeds its top_p (so every later token's
    exclusive cumulative sum does), or its min_p threshold is above the smallest of them. On
    CUDA the full sort stays (it is fast there, and the check would be a host sync)."""
    k = TOP_CANDIDATES
    if probs.device.type == "cpu" and probs.shape[-1] > k:
        vals, ids = probs.topk(k, dim=-1)
        # the full path's exclusive cumulative sum at rank k, summed in the same order
        within = (info.top_ks <= k) | (vals.cumsum(-1)[:, -1] > info.top_ps)
        if info.need_min_p:
            within |= vals[:, -1] < vals[:, 0] * info.min_ps
        if bool(within.all()):
            return vals, ids
    return probs.sort(dim=-1, descending=True)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft row samples from: max(p - q, 0), renormalized (rows whose q is
    zero, i.e. no draft, get p itself)."""
    r = (p - q).clamp_(min=0.0)
    return r / r.sum(dim=-1, keepdim=True).clamp_(min=1e-30)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A categorical sample per row: the exponential race argmax p / Exp(1)."""
    return argmax_rows(probs / -torch.log(noise))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1). On the CPU through numpy, ~7x faster than torch's reduction for a
    [64, 4032] float32 block on one core; both return the first index of the maximum (and of
    the first NaN), so the ids are the same."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0]:
        ids = (x.detach() if x.requires_grad else x).contiguous().numpy().argmax(axis=-1)
        return torch.from_numpy(ids if ids.dtype == np.int64 else ids.astype(np.int64))
    return x.argmax(dim=-1)


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """Each row's argmax as Python ints (`argmax_rows(logits).tolist()`): on the CPU straight
    from the float32 buffer through numpy, no torch tensor built for the ids."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        x = logits.detach() if logits.requires_grad else logits
        return x.contiguous().numpy().argmax(axis=-1).tolist()
    return argmax_rows(logits).tolist()
