"""The state a step samples with: one row per sampled position, built on the CPU."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from loom.runtime.forward_batch import host_tensor
from loom.runtime.req import Req
from loom.runtime.sampling.params import row_params
from loom.runtime.sampling.penalties import penalty_tensors


@dataclass
class SamplingInfo:
    """One row per sampled position, built on the CPU by the scheduler (`from_reqs`) and moved
    to the runner's device (`to`). A request verifying a draft of k tokens has k + 1 rows:
    row j checks `draft_tokens[row]` (the draft's j-th token; -1 on its last row, which only
    samples) with the sampling state that holds once the j tokens before it are accepted
    (noise counter, penalty counts, min_new_tokens, grammar mask)."""

    temperatures: torch.Tensor  # [N, 1]
    top_ps: torch.Tensor
    top_ks: torch.Tensor
    min_ps: torch.Tensor
    greedy: torch.Tensor  # [N] bool
    seeds: torch.Tensor
    steps: torch.Tensor  # [N] sequence position of the token sampled (the noise counter)
    need_top_filter: bool
    need_min_p: bool
    all_greedy: bool
    logit_bias: torch.Tensor | None  # [N, V]
    penalty: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) masked to -inf
    vocab_mask: torch.Tensor | None = None  # grammar bitmask [N, words]
    draft_tokens: torch.Tensor | None = None  # [N] token each row verifies, -1: none
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
        distributions (None: one-hot)."""
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
        dev = torch.device(device)
        temps, top_ps, min_ps, top_ks, seeds, greedy_t = row_params(
            reqs, params, greedy, counts, vocab_size, dev, shared=not trees
        )
        steps_t = host_tensor(steps, torch.int64)
        f32 = dict(dtype=torch.float32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        logit_bias = None
        if any(p.logit_bias for p in params):
            logit_bias = torch.zeros(len(rows), vocab_size, **f32)
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
            banned = (torch.tensor(banned_rows, **i64), torch.tensor(banned_ids, **i64))
        draft_tokens = None
        tokens = [x for _, _, x in rows]
        if max(tokens, default=-1) >= 0:
            draft_tokens = host_tensor(tokens, torch.int64)
            if dev.type != "cpu":
                draft_tokens = draft_tokens.to(dev, non_blocking=True)
        all_greedy = all(greedy)
        penalty = None
        if any(
            p.frequency_penalty != 0 or p.presence_penalty != 0 or p.repetition_penalty != 1
            for p in params
        ):
            penalty = penalty_tensors(rows, vocab_size, dev)
        return cls(
            temperatures=temps,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            greedy=greedy_t,
            seeds=seeds,
            steps=steps_t if dev.type == "cpu" else steps_t.to(dev, non_blocking=True),
            need_top_filter=any(p.top_p < 1.0 or p.top_k > 0 for p in params),
            need_min_p=any(p.min_p > 0 for p in params),
            all_greedy=all_greedy,
            logit_bias=logit_bias,
            penalty=penalty,
            banned=banned,
            draft_tokens=draft_tokens,
            trees=trees or None,
        )

    def to(self, device: torch.device | str) -> SamplingInfo:
        if torch.device(device) == self.greedy.device:  # built where it samples (the CPU)
            return self

        def move(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if isinstance(x, tuple):
                return tuple(move(t) for t in x)
            return x

        return SamplingInfo(**{f.name: move(getattr(self, f.name)) for f in fields(self)})
