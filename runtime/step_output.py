"""A step's tokens from its logits: sampling, draft verification and logprobs, then the
per-request `ForwardOutput` (both runners' last stage: runtime/model_runner.py's torch
`ModelRunner`, runtime/array_runner.py's torch-free `ArrayRunner`).

Torch-free at import. Logits come as a torch tensor (the torch runner) or a numpy float32
array (the torch-free runner), which runtime/sampler.py's numpy path samples (greedy, sampled,
chain and tree verification, logprobs, grammar mask rows) without torch; the torch runner's
numpy `SamplingInfo` becomes tensors on its device here (`SamplingInfo.to`, zero-copy on the
CPU).
"""

from __future__ import annotations

import numpy as np

from loom.runtime.forward_batch import ForwardOutput, ModelInput
from loom.runtime.sampler import greedy_accepts, greedy_rows, sample_verify_trees
from loom.runtime.sampling.logprobs import token_logprobs


def sample_step(inp: ModelInput, logits, n_sample: int, lp_targets: list[int]) -> ForwardOutput:
    """`logits` [n_sample + len(lp_targets), vocab] float32 (a tensor or a numpy array,
    modified in place): the sampled rows, then the prompt-logprob rows (`logits_rows`)."""
    info = inp.sampling
    if not n_sample and not lp_targets:  # a prompt chunk: nothing sampled, nothing scored
        return assemble(inp, [], None, None, [], None, None)
    on_numpy = isinstance(logits, np.ndarray)
    if (
        n_sample
        and not lp_targets
        and info.all_greedy
        and not info.trees
        and inp.logprob_top_nums.count(None) == len(inp.logprob_top_nums)
    ):  # greedy decode or chain verify with nothing to score: ids as Python lists
        if not on_numpy:
            info = info.to(logits.device)
        sampled = greedy_rows(logits[:n_sample], info)
        if inp.lazy_rows is not None:  # the masked argmax where a lazy row needs it
            inp.lazy_rows.resolve(logits[:n_sample], sampled)
        return assemble(inp, sampled, greedy_accepts(sampled, info), None, [], None, None)
    if inp.lazy_rows is not None:  # a path that reads every row's mask: fill them all
        inp.lazy_rows.fill(info, logits.shape[-1])
    ops = _NUMPY if on_numpy else _torch_ops(logits.device)
    counts = [c for c in inp.sample_counts if c]
    # rows whose logprobs were asked for: sampled rows of such requests, then prompt rows
    want = [n is not None for n, c in zip(inp.logprob_top_nums, inp.sample_counts) if c]
    lp_sample_rows = [r for r, w in zip(range(n_sample), repeat_rows(want, counts)) if w]
    lp_logits = None
    if lp_sample_rows or lp_targets:  # raw, before sampling
        lp_logits = ops.cat([logits[ops.ids(lp_sample_rows)], logits[n_sample:]])
    sampled: list[int] = []
    accepted: list[bool] | None = None
    sampled_t = None
    trees = None
    if n_sample:
        if not on_numpy:
            info = info.to(logits.device)
        sampled_t, accepted_t, trees = sample_verify_trees(logits[:n_sample], info)
        if accepted_t is not None:  # accepted rows carry the draft token
            sampled_t = ops.where(accepted_t, info.draft_tokens, sampled_t)
            accepted = accepted_t.tolist()
        if trees:  # a tree's emitted tokens go to the rows that score them (logprobs)
            rows, toks = [], []
            for (root, tokens, _, _), (path, last) in zip(info.trees, trees):
                emitted = [tokens[a] for a in path] + [last]
                rows.extend(root + r for r in [0] + [1 + a for a in path])
                toks.extend(emitted)
            sampled_t = ops.copy(sampled_t)
            sampled_t[ops.ids(rows)] = ops.ids(toks)
        sampled = sampled_t.tolist()
    chosen, top_v, top_i = [], None, None
    if lp_logits is not None:
        parts = [ops.ids(lp_targets)]
        if lp_sample_rows:
            parts.insert(0, sampled_t[ops.ids(lp_sample_rows)])
        targets = ops.cat(parts)
        top = max((n or 0) for n in inp.logprob_top_nums)
        chosen_t, top_vt, top_it = token_logprobs(lp_logits, targets, top)
        chosen = chosen_t.tolist()
        if top_vt is not None:
            top_v, top_i = top_vt.tolist(), top_it.tolist()
    return assemble(inp, sampled, accepted, trees, chosen, top_v, top_i)


def repeat_rows(values: list, counts: list[int]) -> list:
    return [v for v, c in zip(values, counts) for _ in range(c)]


def logits_rows(inp: ModelInput) -> tuple[list[int], list[int], list[int]]:
    """Hidden-state rows that need logits: every request's sampled positions (its last
    sample_counts rows) first, then the prompt-logprob rows; and the prompt tokens scored."""
    sample_rows, lp_rows, lp_targets = [], [], []
    start = 0
    for prefix, seq, count, lp_start, targets in zip(
        inp.prefix_lens,
        inp.seq_lens,
        inp.sample_counts,
        inp.input_logprob_starts,
        inp.input_logprob_targets,
    ):
        end = start + seq - prefix
        sample_rows.extend(range(end - count, end))
        if targets:
            lp_rows.extend(range(start + lp_start, start + lp_start + len(targets)))
            lp_targets.extend(targets)
        start = end
    return sample_rows, lp_rows, lp_targets


def assemble(inp: ModelInput, sampled, accepted, trees, chosen, top_v, top_i) -> ForwardOutput:
    """Per-request lists from the flat rows: each request's draft tokens up to the first row
    the sampler rejected, then that row's token (the residual sample, or the last row's
    sample when every draft token was accepted); a tree's accepted root path, then the token
    sampled after it. Greedy, this is exactly plain decoding."""
    n = len(inp.sample_counts)
    if accepted is None and trees is None and not chosen:
        # no drafts and no logprobs (a plain decode or prefill step): one token per sampling
        # request, the rows in request order
        tokens = iter(sampled)
        return ForwardOutput([[next(tokens)] if c else [] for c in inp.sample_counts],
                             [[] for _ in range(n)], [[] for _ in range(n)],
                             [[] for _ in range(n)], [[] for _ in range(n)],
                             accepted_nodes=[[] for _ in range(n)])  # fmt: skip
    out = ForwardOutput([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)],
                        [[] for _ in range(n)], [[] for _ in range(n)],
                        accepted_nodes=[[] for _ in range(n)])  # fmt: skip
    parents = inp.drafts.parents
    tree_iter = iter(trees or ())
    row = lp = 0
    pending_lp = []
    for i, (count, top_n) in enumerate(zip(inp.sample_counts, inp.logprob_top_nums)):
        if not count:
            continue
        draft = inp.drafts.tokens[i]
        if parents[i] is not None:
            path, _ = next(tree_iter)
            keep_rows = [0] + [1 + a for a in path]
            out.accepted_nodes[i] = list(path)
        else:
            k = 0
            while k < len(draft) and accepted[row + k]:
                k += 1
            keep_rows = list(range(k + 1))
            out.accepted_nodes[i] = list(range(k))
        out.next_ids[i] = [sampled[row + r] for r in keep_rows]
        if top_n is not None:
            pending_lp.append((i, [lp + r for r in keep_rows], top_n))
            lp += count
        row += count
    for i, lp_rows, top_n in pending_lp:
        out.logprobs[i] = [chosen[r] for r in lp_rows]
        if top_n:
            out.top_logprobs[i] = [list(zip(top_v[r][:top_n], top_i[r][:top_n])) for r in lp_rows]
    for i, targets in enumerate(inp.input_logprob_targets):
        if not targets:
            continue
        out.input_logprobs[i] = chosen[lp : lp + len(targets)]
        top_n = inp.logprob_top_nums[i]
        if top_n:
            out.input_top_logprobs[i] = [
                list(zip(top_v[r][:top_n], top_i[r][:top_n])) for r in range(lp, lp + len(targets))
            ]
        lp += len(targets)
    return out


class _NumpyOps:
    """The few array operations the sampled path needs, on numpy arrays."""

    @staticmethod
    def ids(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    cat = staticmethod(np.concatenate)
    where = staticmethod(np.where)

    @staticmethod
    def copy(a: np.ndarray) -> np.ndarray:
        return a.copy()


_NUMPY = _NumpyOps()


def _torch_ops(device):
    """`_NumpyOps`' operations on torch tensors on `device` (torch imported here)."""
    ops = _TORCH_OPS.get(device)
    if ops is not None:
        return ops
    import torch

    class _TorchOps:
        @staticmethod
        def ids(values: list[int]):
            return torch.tensor(values, dtype=torch.int64, device=device)

        cat = staticmethod(torch.cat)
        where = staticmethod(torch.where)

        @staticmethod
        def copy(t):
            return t.clone()

    ops = _TORCH_OPS[device] = _TorchOps()
    return ops


_TORCH_OPS: dict = {}  # device -> its ops
