"""Verification and the target distribution: temperature and top-p / top-k / min-p
(`target_probs`), draft-tree walks with multi-candidate rejection sampling (`verify_trees`),
the residual a rejected row samples from, and the exponential race.

Each function takes numpy arrays (the torch-free CPU path: numpy float32 probabilities and a
numpy `SamplingInfo`) or torch tensors (the torch runner's), and answers in the same kind.
The numpy versions do the torch versions' operations in the same order and dtype; where the
two libraries' float32 kernels round differently (exp / log, a row sum's order) a
probability may differ in its last bit, so a sampled token differs only where that moves the
race's argmax or a top-p / min-p cut."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from loom.runtime.sampling.rng import hashed_uniform, hashed_uniform_columns

if TYPE_CHECKING:
    from loom.runtime.sampling.info import SamplingInfo


def verify_trees(probs, greedy_ids, info: SamplingInfo) -> list[tuple[list[int], int]]:
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
    host = isinstance(greedy_ids, np.ndarray)
    coins = None
    if probs is not None:  # every row's coins for its first children, in one hash
        most = max(len(t[1]) for t in info.trees)
        if host:
            columns = -1 - np.arange(most, dtype=np.int64)
        else:
            import torch

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
                    qk = np.zeros_like(p) if host else p.new_zeros(p.shape)
                    qk[x] = 1.0
                    q_x = 1.0
                else:
                    qk = _host_row(q[k]) if host else q[k].to(p.device, p.dtype)
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


def _host_row(q) -> np.ndarray:
    """A node's draft distribution as a numpy float32 row (a drafter may hand a tensor)."""
    if isinstance(q, np.ndarray):
        return q.astype(np.float32, copy=False)
    return q.detach().float().cpu().numpy()


# On the CPU the top-p / top-k / min-p filter first looks at each row's TOP_CANDIDATES largest
# probabilities only: a full-vocabulary sort of [64, 151936] takes ~1 s on one core, topk(1024)
# a few tens of ms. Exact: it is used only when every row's cut provably falls inside them.
TOP_CANDIDATES = 1024


def target_probs(logits, info: SamplingInfo):
    """The distribution each row samples from: temperature, then top-p / top-k / min-p."""
    if isinstance(logits, np.ndarray):
        return _target_probs_np(logits, info)
    import torch

    if info.is_numpy():  # a numpy info (from `from_reqs`) viewed as tensors
        info = info.to(logits.device)
    probs = torch.softmax(logits / info.temperatures, dim=-1)
    if info.need_top_filter or info.need_min_p:
        sorted_probs, order = _head(probs, info)
        ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)[None, :]
        # a row at top_p 1 drops nothing (its rounded sums may pass 1 in the last bit)
        drop = (sorted_probs.cumsum(-1) - sorted_probs > info.top_ps[:, None]) & (
            info.top_ps[:, None] < 1
        )
        drop |= ranks >= info.top_ks[:, None]
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps[:, None]
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        probs /= probs.sum(dim=-1, keepdim=True)  # the acceptance test reads p(x) itself
    return probs


def _head(probs, info: SamplingInfo):
    """Each row's probabilities in descending order with their token ids: all of them, or (on
    the CPU) only the TOP_CANDIDATES largest when every row drops everything past them anyway:
    its top_k is within them, or their sum already exceeds its top_p (so every later token's
    exclusive cumulative sum does), or its min_p threshold is above the smallest of them. On
    CUDA the full sort stays (it is fast there, and the check would be a host sync)."""
    if info.is_numpy():
        info = info.to(probs.device)
    k = TOP_CANDIDATES
    if probs.device.type == "cpu" and probs.shape[-1] > k:
        vals, ids = probs.topk(k, dim=-1)
        # the full path's exclusive cumulative sum at rank k, summed in the same order
        within = (info.top_ks <= k) | ((vals.cumsum(-1)[:, -1] > info.top_ps) & (info.top_ps < 1))
        if info.need_min_p:
            within |= vals[:, -1] < vals[:, 0] * info.min_ps
        if bool(within.all()):
            return vals, ids
    return probs.sort(dim=-1, descending=True)


def _target_probs_np(logits: np.ndarray, info: SamplingInfo) -> np.ndarray:
    """`target_probs` in numpy: softmax as torch computes it (exp(x - max) / sum), the filter
    through `_head_np`; the exclusive cumulative sums accumulate in float64 and round to
    float32 as torch's CPU cumsum does."""
    x = logits / info.temperatures
    x -= x.max(axis=-1, keepdims=True)
    probs = np.exp(x, out=x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if info.need_top_filter or info.need_min_p:
        sorted_probs, order = _head_np(probs, info)
        cum = np.cumsum(sorted_probs, axis=-1, dtype=np.float64).astype(np.float32)
        drop = (cum - sorted_probs > info.top_ps[:, None]) & (info.top_ps[:, None] < 1)
        drop |= np.arange(sorted_probs.shape[-1])[None, :] >= info.top_ks[:, None]
        if info.need_min_p:
            drop |= sorted_probs < sorted_probs[:, :1] * info.min_ps[:, None]
        sorted_probs[drop] = 0.0
        probs = np.zeros_like(probs)
        np.put_along_axis(probs, order, sorted_probs, axis=-1)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


def _head_np(probs: np.ndarray, info: SamplingInfo) -> tuple[np.ndarray, np.ndarray]:
    """`_head` in numpy (always the candidates' check: this is the CPU path). Equal
    probabilities keep the lower token id first (a stable sort of the negated values)."""
    k = TOP_CANDIDATES
    vocab = probs.shape[-1]
    if vocab > k:
        ids = np.argpartition(probs, vocab - k, axis=-1)[:, vocab - k :]
        vals = np.take_along_axis(probs, ids, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        vals = np.take_along_axis(vals, order, axis=-1)
        ids = np.take_along_axis(ids, order, axis=-1)
        total = np.cumsum(vals, axis=-1, dtype=np.float64)[:, -1].astype(np.float32)
        within = (info.top_ks <= k) | ((total > info.top_ps) & (info.top_ps < 1))
        if info.need_min_p:
            within |= vals[:, -1] < vals[:, 0] * info.min_ps
        if within.all():
            return vals, ids
    order = np.argsort(-probs, axis=-1, kind="stable")
    return np.take_along_axis(probs, order, axis=-1), order


def residual(p, q):
    """Where a rejected draft row samples from: max(p - q, 0), renormalized (rows whose q is
    zero, i.e. no draft, get p itself)."""
    if isinstance(p, np.ndarray):
        r = np.maximum(p - q, np.float32(0))
        return r / np.maximum(r.sum(axis=-1, keepdims=True), np.float32(1e-30))
    r = (p - q).clamp_(min=0.0)
    return r / r.sum(dim=-1, keepdim=True).clamp_(min=1e-30)


def race(probs, noise):
    """A categorical sample per row: the exponential race argmax p / Exp(1)."""
    if isinstance(probs, np.ndarray):
        e = np.log(noise)
        np.negative(e, out=e)
        return argmax_rows(np.divide(probs, e, out=e))
    import torch

    return argmax_rows(probs / -torch.log(noise))


# A numpy row races over its support alone (the noise hashed for those columns only) when it
# holds fewer than 1 / SPARSE_RACE of the vocabulary: a top-k / top-p / min-p row.
SPARSE_RACE = 8


def race_rows(probs: np.ndarray, info: SamplingInfo, skip: np.ndarray) -> np.ndarray:
    """`race(probs, hashed_uniform(info.seeds, info.steps, V))` on numpy rows, the rows where
    `skip` is set left out (0: a greedy row, an accepted draft; the caller discards them).
    The same tokens: a zero probability never wins the race (its p / Exp is 0, a kept
    token's positive), a column's noise is its own hash whatever the others, and the support
    in ascending id order keeps the dense argmax's first-maximum rule."""
    n, vocab = probs.shape
    out = np.zeros(n, np.int64)
    dense = []
    for i in np.flatnonzero(~skip).tolist():
        ids = np.flatnonzero(probs[i])
        if 0 < len(ids) * SPARSE_RACE < vocab:
            noise = hashed_uniform_columns(info.seeds[i : i + 1], info.steps[i : i + 1], ids)
            out[i] = ids[race(probs[i, ids][None], noise)[0]]
        else:
            dense.append(i)
    if dense:
        rows = np.array(dense, np.int64)
        out[rows] = race(probs[rows], hashed_uniform(info.seeds[rows], info.steps[rows], vocab))
    return out


def argmax_rows(x):
    """x.argmax(dim=-1) (int64). On the CPU through numpy, ~7x faster than torch's reduction
    for a [64, 4032] float32 block on one core; both return the first index of the maximum
    (and of the first NaN), so the ids are the same. A numpy `x` gives a numpy array."""
    if isinstance(x, np.ndarray):
        ids = x.argmax(axis=-1)
        return ids if ids.dtype == np.int64 else ids.astype(np.int64)
    import torch

    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0]:
        ids = (x.detach() if x.requires_grad else x).contiguous().numpy().argmax(axis=-1)
        return torch.from_numpy(ids if ids.dtype == np.int64 else ids.astype(np.int64))
    return x.argmax(dim=-1)


def greedy_ids(logits) -> list[int]:
    """Each row's argmax as Python ints (`argmax_rows(logits).tolist()`): on the CPU straight
    from the float32 buffer through numpy, no torch tensor built for the ids."""
    if isinstance(logits, np.ndarray):
        return logits.argmax(axis=-1).tolist()
    import torch

    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        x = logits.detach() if logits.requires_grad else logits
        return x.contiguous().numpy().argmax(axis=-1).tolist()
    return argmax_rows(logits).tolist()
