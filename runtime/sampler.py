"""Sampling: prepared on the CPU once per step, applied on the device with no host sync. The
runner's entry points (`sample`, `greedy_verify`, `sample_and_verify`, `sample_verify_trees`)
compose the jobs in `loom.runtime.sampling`: the step's `SamplingInfo`, logit processing,
the target distribution and draft verification, counter-based noise (a request's samples
depend only on its own seed and position).

Two paths behind the same entry points: numpy float32 logits [N, V] with the numpy info
`SamplingInfo.from_reqs` builds (the torch-free CPU path; numpy arrays and lists come back,
and torch is never imported), or torch logits (the torch runner's; a numpy info is made a
torch one by `SamplingInfo.to`, and tensors come back, as before). Greedy ids are the same on
both; seeded samples too wherever float rounding does not move them (sampling/verify.py)."""

from __future__ import annotations

import numpy as np

from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling.penalties import apply_penalties
from loom.runtime.sampling.rng import hashed_uniform, hashed_uniform_column
from loom.runtime.sampling.verify import (
    argmax_rows,
    greedy_ids,
    race,
    race_rows,
    residual,
    target_probs,
    verify_trees,
)


def _torch_info(logits, info: SamplingInfo) -> SamplingInfo:
    """The info of the torch path: a numpy info (from `from_reqs`) viewed as tensors."""
    return info.to(logits.device) if info.is_numpy() else info


def _numpy_info(info: SamplingInfo) -> SamplingInfo:
    """The info of the numpy path (a torch info, built by hand, copied to numpy)."""
    return info.to_numpy()


def sample(logits, info: SamplingInfo):
    """logits [B, V] float32 (modified in place) -> next token ids [B] (no drafts)."""
    return sample_and_verify(logits, info)[0]


def greedy_verify(logits, info: SamplingInfo) -> tuple[list[int], list[bool] | None]:
    """`sample_and_verify` for rows that are all greedy with no draft tree, as Python lists:
    bias, penalties, bans and the grammar mask applied, then each row's argmax; a chain's row
    accepts its draft token when it is that argmax (so the token kept is the argmax either
    way). A decode or verify step at temperature 0 builds no token tensors. The runner calls
    the two halves itself where rows were left lazy (`step_grammar.LazyRows.resolve` fixes
    the ids between them: the sampler never sees a grammar)."""
    ids = greedy_rows(logits, info)
    return ids, greedy_accepts(ids, info)


def greedy_rows(logits, info: SamplingInfo) -> list[int]:
    """Bias, penalties, bans and the mask rows applied, then each row's argmax (a list)."""
    if isinstance(logits, np.ndarray):
        info = _numpy_info(info)
    else:
        info = _torch_info(logits, info)
    apply_penalties(logits, info)
    return greedy_ids(logits)


def greedy_accepts(ids: list[int], info: SamplingInfo) -> list[bool] | None:
    """Per row: whether its argmax is the draft token it verifies (None: no drafts)."""
    if info.draft_tokens is None:
        return None
    return [i == d for i, d in zip(ids, info.draft_tokens.tolist())]


def sample_and_verify(logits, info: SamplingInfo):
    """Chain drafts only: `sample_verify_trees` without the trees' results."""
    tokens, accepted, _ = sample_verify_trees(logits, info)
    return tokens, accepted


def sample_verify_trees(logits, info: SamplingInfo):
    """logits [N, V] float32 (modified in place) -> (token ids [N], accepted [N] or None,
    per tree of `info.trees` (accepted node indices, the token sampled after them) or None).

    Without drafts: one token per row. With chain drafts (`info.draft_tokens`), row j verifies
    the draft token x: greedy rows accept x when it is the argmax; sampled rows accept it with
    probability min(1, p(x) / q(x)) = p(x) (the n-gram drafter is deterministic: q one-hot),
    and otherwise take a sample of the residual max(p - q, 0), renormalized. The caller keeps
    the accepted run and the token of the first rejected row (or the last row's sample).
    Tree rows are verified by `verify_trees`. Noise is counter-based (seed, position), so a
    request's output is reproducible. Numpy logits give numpy arrays (int64 ids, bool
    acceptances), torch logits tensors."""
    numpy = isinstance(logits, np.ndarray)
    info = _numpy_info(info) if numpy else _torch_info(logits, info)
    # both paths: penalties, each row's argmax, then either the all-greedy answer or the
    # target distribution and the trees' walk
    apply_penalties(logits, info)
    greedy_ids = argmax_rows(logits)
    drafts = info.draft_tokens
    if info.all_greedy:
        tree_out = verify_trees(None, greedy_ids, info) if info.trees else None
        return greedy_ids, (None if drafts is None else greedy_ids == drafts), tree_out
    probs = target_probs(logits, info)
    tree_out = verify_trees(probs, greedy_ids, info) if info.trees else None
    tail = _sampled_rows_np if numpy else _sampled_rows_torch
    return (*tail(probs, greedy_ids, info), tree_out)


def _sampled_rows_torch(probs, greedy_ids, info: SamplingInfo):
    """The sampled rows' tokens and acceptances on tensors (dense noise over the vocabulary)."""
    import torch

    drafts = info.draft_tokens
    noise = hashed_uniform(info.seeds, info.steps, probs.shape[-1])
    if drafts is None:
        sampled = race(probs, noise)
        return torch.where(info.greedy, greedy_ids, sampled), None
    has_draft = drafts >= 0
    x = drafts.clamp(min=0)
    q = torch.zeros_like(probs).scatter_(1, x[:, None], 1.0) * has_draft[:, None]
    coin = hashed_uniform_column(info.seeds, info.steps, -1)
    p_x = probs.gather(1, x[:, None]).squeeze(1)
    accepted = has_draft & (coin < p_x)  # min(1, p(x) / q(x)) with q(x) = 1
    sampled = torch.where(accepted, x, race(residual(probs, q), noise))
    tokens = torch.where(info.greedy, greedy_ids, sampled)
    return tokens, torch.where(info.greedy, greedy_ids == drafts, accepted)


def _sampled_rows_np(probs: np.ndarray, greedy_ids: np.ndarray, info: SamplingInfo):
    """The same in numpy, step for step (the same noise, bit for bit; hashed only where a row
    can use it: `race_rows`)."""
    drafts = info.draft_tokens
    if drafts is None:  # the noise of a row's support only (`race_rows`)
        sampled = race_rows(probs, info, info.greedy)
        return np.where(info.greedy, greedy_ids, sampled), None
    has_draft = drafts >= 0
    x = np.maximum(drafts, 0)
    rows = np.arange(probs.shape[0])
    q = np.zeros_like(probs)
    q[rows, x] = has_draft
    coin = hashed_uniform_column(info.seeds, info.steps, -1)
    p_x = probs[rows, x]
    accepted = has_draft & (coin < p_x)  # min(1, p(x) / q(x)) with q(x) = 1
    sampled = np.where(accepted, x, race_rows(residual(probs, q), info, info.greedy | accepted))
    tokens = np.where(info.greedy, greedy_ids, sampled)
    return tokens, np.where(info.greedy, greedy_ids == drafts, accepted)
