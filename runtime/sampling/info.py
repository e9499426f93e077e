"""The state a step samples with: one row per sampled position, built on the CPU as numpy
arrays (this module never imports torch: the scheduler builds it). `SamplingInfo.to` gives the
torch-backed info the torch runner samples with (zero-copy on the CPU)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from loom.runtime.sampling.params import row_params
from loom.runtime.sampling.penalties import penalty_tensors

if TYPE_CHECKING:
    from loom.runtime.req import Req

# an array of either kind: numpy from `from_reqs`, torch after `to` (or built by hand)
Array = Any


@dataclass
class SamplingInfo:
    """One row per sampled position, built on the CPU by the scheduler (`from_reqs`, numpy
    arrays) and made torch tensors on the runner's device by `to` (the numpy sampler takes the
    numpy info itself). A request verifying a draft of k tokens has k + 1 rows:
    row j checks `draft_tokens[row]` (the draft's j-th token; -1 on its last row, which only
    samples) with the sampling state that holds once the j tokens before it are accepted
    (noise counter, penalty counts, min_new_tokens, grammar mask)."""

    temperatures: Array  # [N, 1] float32
    top_ps: Array  # [N] float32
    top_ks: Array  # [N] int64
    min_ps: Array  # [N] float32
    greedy: Array  # [N] bool
    seeds: Array  # [N] int64
    steps: Array  # [N] int64 sequence position of the token sampled (the noise counter)
    need_top_filter: bool
    need_min_p: bool
    all_greedy: bool
    logit_bias: Array | None  # [N, V] float32
    # (output counts [N, V] float32, seen [N, V] bool, frequency, presence, repetition [N, 1])
    penalty: tuple[Array, Array, Array, Array, Array] | None
    banned: tuple[Array, Array] | None  # (rows, token ids) int64, masked to -inf
    vocab_mask: Array | None = None  # grammar bitmask [N, words] int32
    draft_tokens: Array | None = None  # [N] int64 token each row verifies, -1: none
    # tree drafts: per tree (its root row, node tokens, node parents, node draft probs or None);
    # row root + 1 + i holds the state after node i's path (see `verify_trees`)
    trees: list[tuple[int, list[int], list[int], Any]] | None = None

    @classmethod
    def from_reqs(
        cls,
        reqs: list[Req],
        vocab_size: int,
        device: str = "cpu",
        *,
        drafts: list[list[int]] | None = None,
        parents: list[list[int] | None] | None = None,
        draft_probs: list | None = None,
    ) -> SamplingInfo:
        """`parents[i]` (optional): request i's draft is a tree (`loom.runtime.spec.DraftTree`
        parents), verified by `verify_trees`; `draft_probs[i]`: its nodes' draft
        distributions (None: one-hot). The arrays are numpy; a `device` other than the CPU
        returns `to(device)` of them."""
        drafts = drafts or [[] for _ in reqs]
        parents = parents or [None] * len(reqs)
        # per row: (request, the draft tokens before it on its path, the token it verifies);
        # a request's rows are consecutive (`counts` of them) and share its parameters, so the
        # per-request facts below are read once a request, not once a row
        rows: list[tuple[Req, list[int], int]] = []
        steps: list[int] = []  # per row: the sequence position it samples (the noise counter)
        trees = []
        if not any(drafts) and all(p is None for p in parents):  # one row per request
            rows = [(r, [], -1) for r in reqs]
            steps = [r.seq_len for r in reqs]
            drafts = parents = ()
            counts = [1] * len(reqs)
        else:
            counts = [1 + len(d) for d in drafts]
        for i, (r, d, par) in enumerate(zip(reqs, drafts, parents)):
            seq = r.seq_len
            if par is None:
                rows.extend((r, d[:j], d[j] if j < len(d) else -1) for j in range(1 + len(d)))
                steps.extend(range(seq, seq + 1 + len(d)))
                continue
            trees.append((len(rows), d, par, draft_probs[i] if draft_probs else None))
            rows.append((r, [], -1))
            steps.append(seq)
            paths: list[list[int]] = []
            for t, pa in zip(d, par):
                paths.append((paths[pa] if pa >= 0 else []) + [t])
                rows.append((r, paths[-1], -1))
                steps.append(seq + len(paths[-1]))
        params = [r.sampling_params for r in reqs]
        greedy = [p.is_greedy for p in params]
        temps, top_ps, min_ps, top_ks, seeds, greedy_a = row_params(
            reqs, params, greedy, counts, vocab_size, "cpu", shared=not trees
        )
        steps_a = np.array(steps, np.int64)
        logit_bias = None
        if any(p.logit_bias for p in params):
            logit_bias = np.zeros((len(rows), vocab_size), np.float32)
            for i, (r, _, _) in enumerate(rows):
                for tok, bias in (r.sampling_params.logit_bias or {}).items():
                    logit_bias[i, tok] = bias
        banned_rows, banned_ids = [], []
        for i, (r, path, _) in enumerate(rows if any(p.min_new_tokens > 0 for p in params) else ()):
            if len(r.output_ids) + len(path) < r.sampling_params.min_new_tokens:
                stops = set(r.sampling_params.stop_token_ids or ()) | set(r.eos_token_ids)
                for t in stops:
                    if t < vocab_size:
                        banned_rows.append(i)
                        banned_ids.append(t)
        banned = None
        if banned_rows:
            banned = (np.array(banned_rows, np.int64), np.array(banned_ids, np.int64))
        draft_tokens = None
        tokens = [x for _, _, x in rows]
        if max(tokens, default=-1) >= 0:
            draft_tokens = np.array(tokens, np.int64)
        all_greedy = all(greedy)
        penalty = None
        if any(
            p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1
            for p in params
        ):
            penalty = penalty_tensors(rows, vocab_size)
        info = cls(
            temperatures=temps,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            greedy=greedy_a,
            seeds=seeds,
            steps=steps_a,
            need_top_filter=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
            all_greedy=all_greedy,
            logit_bias=logit_bias,
            penalty=penalty,
            banned=banned,
            draft_tokens=draft_tokens,
            trees=trees or None,
        )
        return info if str(device) == "cpu" else info.to(device)

    def is_numpy(self) -> bool:
        """Whether the arrays are numpy (`from_reqs`) rather than torch tensors (`to`)."""
        return isinstance(self.greedy, np.ndarray)

    def to(self, device) -> SamplingInfo:
        """The info as torch tensors on `device`: numpy arrays through `torch.from_numpy`
        (zero-copy; on another device then copied), tensors moved where they are elsewhere.
        Cheap and idempotent: a torch info already on `device` is returned as it is. Imports
        torch (the torch runner's side of the seam)."""
        import torch

        device = torch.device(device)
        if not self.is_numpy() and self.greedy.device == device and not _has_numpy(self):
            return self

        def move(x):
            if isinstance(x, np.ndarray):
                x = torch.from_numpy(x)
            if isinstance(x, torch.Tensor):
                return x if x.device == device else x.to(device, non_blocking=True)
            if isinstance(x, tuple):
                return tuple(move(t) for t in x)
            return x

        return SamplingInfo(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def to_numpy(self) -> SamplingInfo:
        """The info as numpy arrays on the host (a torch info's tensors copied to the CPU,
        zero-copy where they are there already); a numpy info is returned as it is."""
        if self.is_numpy() and not _has_tensor(self):
            return self

        def host(x):
            if isinstance(x, tuple):
                return tuple(host(t) for t in x)
            if x is None or isinstance(x, (np.ndarray, bool, list)):
                return x
            return x.detach().cpu().numpy()

        return SamplingInfo(**{f.name: host(getattr(self, f.name)) for f in fields(self)})


_ARRAY_FIELDS = ("vocab_mask", "draft_tokens", "logit_bias", "banned", "penalty")


def _has_numpy(info: SamplingInfo) -> bool:
    """Whether any optional field of a torch info is still numpy (e.g. a grammar mask set
    after `to`)."""
    for name in _ARRAY_FIELDS:
        x = getattr(info, name)
        if isinstance(x, np.ndarray) or (isinstance(x, tuple) and isinstance(x[0], np.ndarray)):
            return True
    return False


def _has_tensor(info: SamplingInfo) -> bool:
    """Whether any optional field of a numpy info is not numpy (a torch grammar mask)."""
    for name in _ARRAY_FIELDS:
        x = getattr(info, name)
        if x is not None and not isinstance(x, (np.ndarray, tuple)):
            return True
        if isinstance(x, tuple) and not isinstance(x[0], np.ndarray):
            return True
    return False
