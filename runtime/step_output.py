"""A step's tokens from its logits: sampling, draft verification and logprobs, then the
per-request `ForwardOutput` (both runners' last stage: runtime/model_runner.py's torch
`ModelRunner`, runtime/array_runner.py's torch-free `ArrayRunner`).

Torch-free at import. Logits come as a torch tensor (the torch runner) or a numpy float32
array (the torch-free runner); a numpy-backed `SamplingInfo` (`SamplingInfo.from_reqs`) is
sampled in numpy by runtime/sampler.py. A step that needs what only the torch sampler does
(logprobs, draft trees, sampled rows where the sampler takes torch, a torch-backed info) takes
its numpy logits with `torch.from_numpy` (zero-copy), torch imported then, in that process.
"""

from __future__ import annotations

import numpy as np

from loom.runtime.forward_batch import ForwardOutput, ModelInput
from loom.runtime.sampler import greedy_accepts, greedy_rows, sample_verify_trees
from loom.runtime.sampling.logprobs import token_logprobs


def _numpy_info(info) -> bool:
    """Whether `info` holds numpy arrays (what the numpy sampler reads), not tensors."""
    return info is not None and isinstance(getattr(info, "greedy", None), np.ndarray)


def sample_step(inp: ModelInput, logits, n_sample: int, lp_targets: list[int]) -> ForwardOutput:
    """`logits` [n_sample + len(lp_targets), vocab] float32 (a tensor or a numpy array,
    modified in place): the sampled rows, then the prompt-logprob rows (`logits_rows`)."""
    info = inp.sampling
    if not n_sample and not lp_targets:  # a prompt chunk: nothing sampled, nothing scored
        return assemble(inp, [], None, None, [], None, None)
    on_numpy = isinstance(logits, np.ndarray)
    if on_numpy and not _numpy_info(info):  # a torch-backed info: the torch sampler
        logits, on_numpy = _from_numpy(logits), False
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
    import torch  # what follows is the torch sampler's (see the module's docstring)

    if on_numpy:
        logits = torch.from_numpy(logits)
    if inp.lazy_rows is not None:  # a path that reads every row's mask: fill them all
        inp.lazy_rows.fill(info, logits.shape[-1])
    counts = [c for c in inp.sample_counts if c]
    # rows whose logprobs were asked for: sampled rows of such requests, then prompt rows
    want = [n is not None for n, c in zip(inp.logprob_top_nums, inp.sample_counts) if c]
    lp_sample_rows = [r for r, w in zip(range(n_sample), repeat_rows(want, counts)) if w]
    lp_logits = None
    if lp_sample_rows or lp_targets:
        rows = torch.tensor(lp_sample_rows, dtype=torch.int64, device=logits.device)
        lp_logits = torch.cat([logits[rows], logits[n_sample:]])  # raw, before sampling
    sampled: list[int] = []
    accepted: list[bool] | None = None
    sampled_t = None
    trees = None
    if n_sample:
        info = info.to(logits.device)
        sampled_t, accepted_t, trees = sample_verify_trees(logits[:n_sample], info)
        if accepted_t is not None:  # accepted rows carry the draft token
            sampled_t = torch.where(accepted_t, info.draft_tokens, sampled_t)
            accepted = accepted_t.tolist()
        if trees:  # a tree's emitted tokens go to the rows that score them (logprobs)
            rows, toks = [], []
            for (root, tokens, _, _), (path, last) in zip(info.trees, trees):
                emitted = [tokens[a] for a in path] + [last]
                rows.extend(root + r for r in [0] + [1 + a for a in path])
                toks.extend(emitted)
            sampled_t = sampled_t.clone()
            sampled_t[torch.tensor(rows, device=logits.device)] = torch.tensor(
                toks, dtype=sampled_t.dtype, device=logits.device
            )
        sampled = sampled_t.tolist()
    chosen, top_v, top_i = [], None, None
    if lp_logits is not None:
        parts = [torch.tensor(lp_targets, dtype=torch.int64, device=logits.device)]
        if lp_sample_rows:
            parts.insert(0, sampled_t[torch.tensor(lp_sample_rows, device=logits.device)])
        targets = torch.cat(parts)
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


def _from_numpy(logits: np.ndarray):
    import torch

    return torch.from_numpy(logits)
