"""Sampling: prepared on the CPU once per step, applied on the device with no host sync.
Randomness is counter-based (`loom.runtime.sampling.rng`): a request's samples depend only on
its own seed and position."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from loom.runtime.forward_batch import host_tensor
from loom.runtime.req import Req
from loom.runtime.sampling.params import row_params
from loom.runtime.sampling.penalties import apply_penalties, apply_vocab_mask_, penalty_tensors
from loom.runtime.sampling.rng import hashed_uniform, hashed_uniform_column, hashed_uniform_columns


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
    # greedy chains whose grammar rows were left all-allowed (`vocab_mask` rows unfilled, or
    # no mask at all; a plain decode row is a chain with no draft tokens):
    # (first row, the request's grammar, its draft tokens, its EOS ids);
    # `greedy_verify` masks at most the row that decides the chain (`_resolve_lazy_grammars`)
    lazy_grammars: list[tuple[int, Any, list[int], frozenset]] | None = None

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


def sample(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """logits [B, V] float32 (modified in place) -> next token ids [B] (no drafts)."""
    return sample_and_verify(logits, info)[0]


def greedy_verify(logits: torch.Tensor, info: SamplingInfo) -> tuple[list[int], list[bool] | None]:
    """`sample_and_verify` for rows that are all greedy with no draft tree, as Python lists:
    bias, penalties, bans and the grammar mask applied, then each row's argmax; a chain's row
    accepts its draft token when it is that argmax (so the token kept is the argmax either
    way). A decode or verify step at temperature 0 builds no token tensors."""
    apply_penalties(logits, info)
    ids = greedy_ids(logits)
    if info.lazy_grammars:
        _resolve_lazy_grammars(logits, ids, info.lazy_grammars)
    if info.draft_tokens is None:
        return ids, None
    return ids, [i == d for i, d in zip(ids, info.draft_tokens.tolist())]


def _resolve_lazy_grammars(logits: torch.Tensor, ids: list[int], lazy: list) -> None:
    """Greedy chains verified without their grammar rows. Row j of a chain accepts draft
    token d_j when the masked argmax is d_j; the walk that drafted d_j found it legal, so when
    the unmasked argmax is d_j the masked one is too (masking only removes tokens, and no
    allowed token before d_j reaches its logit). The first row whose argmax is not its draft
    token decides the chain: an argmax the grammar accepts there is the masked argmax as well
    (one accept and rollback, no mask); otherwise that row gets its mask and its masked
    argmax, and the walk goes on from it when that is d_j after all. So the ids and
    acceptances are exactly those of the fully masked rows, with at most one mask per chain
    instead of one per row (each a fresh grammar state, the costly kind). A plain decode row
    is a chain with no draft: its argmax is kept when the grammar accepts it, else masked.
    EOS and ids past the vocabulary always take the mask (a grammar is not asked to accept
    EOS; the mask allows it only where the grammar may end), and so does every row whose
    state has forced bytes next (`is_forced()`): llguidance's mask then allows only the
    forced text's own tokenization while its accept (the walk's check) takes any token
    spelling a prefix of it (after `{"name` the mask allows `":` alone, accept also takes
    `"`). A draft token there that is that tokenization's first token
    (`grammar.forced_token()`) is allowed by the mask, so as the argmax it is the masked
    argmax too: accepted without the mask (a schema's keys and punctuation arrive as such
    drafts, one mask each before)."""
    from loom.grammar.base import allocate_token_bitmask

    vocab = logits.shape[-1]
    for row, grammar, draft, stops in lazy:
        n = 0  # draft tokens the grammar has been advanced by
        for j in range(len(draft) + 1):
            r = row + j
            forced = grammar.is_forced()
            if (
                j < len(draft)
                and ids[r] == draft[j]
                and (not forced or grammar.forced_token() == draft[j])
            ):
                grammar.accept_token(draft[j])
                n += 1
                continue
            if ids[r] not in stops and ids[r] < vocab and not forced:
                try:
                    grammar.accept_token(ids[r])
                except Exception:  # noqa: BLE001 - refused (GrammarError) or the engine's own
                    pass  # error: the mask decides; result processing's accept reports the latter
                else:
                    grammar.rollback(1)
                    break
            mask = allocate_token_bitmask(1, vocab)
            grammar.fill_mask(mask, 0)
            apply_vocab_mask_(logits[r : r + 1], mask)
            ids[r] = greedy_ids(logits[r : r + 1])[0]
            if j < len(draft) and ids[r] == draft[j]:
                grammar.accept_token(draft[j])
                n += 1
                continue
            break
        grammar.rollback(n)


def fill_lazy_grammars(info: SamplingInfo, vocab_size: int) -> None:
    """Every row of `info.lazy_grammars` masked in `info.vocab_mask` (the sampling paths that
    read every row's mask: temperature, trees, logprobs), and the list cleared."""
    from loom.grammar.base import allocate_token_bitmask

    if info.vocab_mask is None:
        info.vocab_mask = allocate_token_bitmask(info.greedy.shape[0], vocab_size)
    for row, grammar, draft, _ in info.lazy_grammars:
        fill_draft_rows(grammar, draft, info.vocab_mask, row)
    info.lazy_grammars = None


def fill_draft_rows(grammar, draft: list[int], mask: torch.Tensor, row: int) -> None:
    """mask[row + j] = what the grammar allows after draft[:j], for j = 0 .. len(draft) (the
    draft legal: walked by the drafter); the grammar ends where it started."""
    for j, t in enumerate(draft):
        grammar.fill_mask(mask, row + j)
        grammar.accept_token(t)
    grammar.fill_mask(mask, row + len(draft))
    grammar.rollback(len(draft))


def sample_and_verify(
    logits: torch.Tensor, info: SamplingInfo
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chain drafts only: `sample_verify_trees` without the trees' results."""
    tokens, accepted, _ = sample_verify_trees(logits, info)
    return tokens, accepted


def sample_verify_trees(
    logits: torch.Tensor, info: SamplingInfo
) -> tuple[torch.Tensor, torch.Tensor | None, list[tuple[list[int], int]] | None]:
    """logits [N, V] float32 (modified in place) -> (token ids [N], accepted [N] or None,
    per tree of `info.trees` (accepted node indices, the token sampled after them) or None).

    Without drafts: one token per row. With chain drafts (`info.draft_tokens`), row j verifies
    the draft token x: greedy rows accept x when it is the argmax; sampled rows accept it with
    probability min(1, p(x) / q(x)) = p(x) (the n-gram drafter is deterministic: q one-hot),
    and otherwise take a sample of the residual max(p - q, 0), renormalized. The caller keeps
    the accepted run and the token of the first rejected row (or the last row's sample).
    Tree rows are verified by `verify_trees`. Noise is counter-based (seed, position), so a
    request's output is reproducible."""
    if info.lazy_grammars:
        fill_lazy_grammars(info, logits.shape[-1])
    apply_penalties(logits, info)
    greedy_ids = argmax_rows(logits)
    drafts = info.draft_tokens
    if info.all_greedy:
        tree_out = verify_trees(None, greedy_ids, info) if info.trees else None
        return greedy_ids, (None if drafts is None else greedy_ids == drafts), tree_out
    probs = target_probs(logits, info)
    tree_out = verify_trees(probs, greedy_ids, info) if info.trees else None
    noise = hashed_uniform(info.seeds, info.steps, probs.shape[-1])
    if drafts is None:
        sampled = race(probs, noise)
        return torch.where(info.greedy, greedy_ids, sampled), None, tree_out
    has_draft = drafts >= 0
    x = drafts.clamp(min=0)
    q = torch.zeros_like(probs).scatter_(1, x[:, None], 1.0) * has_draft[:, None]
    coin = hashed_uniform_column(info.seeds, info.steps, -1)
    p_x = probs.gather(1, x[:, None]).squeeze(1)
    accepted = has_draft & (coin < p_x)  # min(1, p(x) / q(x)) with q(x) = 1
    sampled = torch.where(accepted, x, race(residual(probs, q), noise))
    tokens = torch.where(info.greedy, greedy_ids, sampled)
    return tokens, torch.where(info.greedy, greedy_ids == drafts, accepted), tree_out


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


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_num: int):
    """Raw-model logprobs of `token_ids` and the top-`top_num` entries per row: one
    log_softmax over all the rows given (the caller gathers every row that needs one)."""
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, token_ids[:, None]).squeeze(1)
    if top_num > 0:
        top_vals, top_ids = logp.topk(min(top_num, logp.shape[-1]), dim=-1)
        return chosen, top_vals, top_ids
    return chosen, None, None
