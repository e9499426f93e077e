"""Speculative verification at temperature > 0 keeps the target distribution.

A 16-token vocabulary: each of N rows verifies a draft token x (q one-hot, the n-gram
drafter's case) against the same target logits with its own seed. The token each row yields
(x when accepted, else the residual sample) must follow p exactly: a chi-square test at a
fixed seed. The broken variant (the residual left as p, forgetting to take q out) must FAIL
the same test: it over-produces x. Each test runs on the torch path and on the numpy one
(numpy logits and info: the CPU path without torch).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.runtime import sampler
from loom.runtime.sampler import sample_and_verify
from loom.runtime.sampling import verify
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling.verify import target_probs

V = 16
N = 40_000
# chi-square critical value, 15 degrees of freedom, p = 0.001
CRITICAL = 37.70


def _info(draft: int, temperature: float, top_p: float) -> SamplingInfo:
    f32 = dict(dtype=torch.float32)
    return SamplingInfo(
        temperatures=torch.full((N, 1), temperature, **f32),
        top_ps=torch.full((N,), top_p, **f32),
        top_ks=torch.full((N,), V),
        min_ps=torch.zeros(N, **f32),
        greedy=torch.zeros(N, dtype=torch.bool),
        seeds=torch.arange(N) * 7919 + 11,
        steps=torch.full((N,), 42),
        need_top_filter=top_p < 1.0,
        need_min_p=False,
        all_greedy=False,
        logit_bias=None,
        penalty=None,
        banned=None,
        draft_tokens=torch.full((N,), draft),
    )


PATHS = ["torch", "numpy"]


def _on(path: str, logits: torch.Tensor, info: SamplingInfo):
    """The logits and info of `path` (numpy: copies as numpy arrays)."""
    if path == "numpy":
        return logits.numpy().copy(), info.to_numpy()
    return logits, info


def _chi_square(
    draft: int, temperature: float, top_p: float, path: str = "torch"
) -> tuple[float, torch.Tensor]:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    info = _info(draft, temperature, top_p)
    p = target_probs(logits.expand(N, V).clone(), info)[0]
    tokens, accepted = sample_and_verify(*_on(path, logits.expand(N, V).clone(), info))
    tokens, accepted = torch.as_tensor(tokens), torch.as_tensor(accepted)
    tokens = torch.where(accepted, info.draft_tokens, tokens)
    observed = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * N
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token outside the target's support"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, accepted


CASES = [(6, 1.0, 1.0), (2, 1.0, 1.0), (12, 0.7, 0.9)]  # p(x) about 0.35, 0.01; top-p


def _broken_residual(p, q):
    if isinstance(p, np.ndarray):
        return p / p.sum(axis=-1, keepdims=True)
    return p / p.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("draft, temperature, top_p", CASES)
@pytest.mark.parametrize(
    "residual",
    [
        "correct",
        pytest.param(
            "broken", marks=pytest.mark.xfail(strict=True, reason="the residual must take q out")
        ),
    ],
)
def test_verified_tokens_follow_the_target_distribution(
    monkeypatch, draft, temperature, top_p, residual, path
):
    if residual == "broken":
        monkeypatch.setattr(sampler, "residual", _broken_residual)
    stat, accepted = _chi_square(draft, temperature, top_p, path)
    assert 0 < accepted.float().mean() < 1  # both branches were exercised
    assert stat < CRITICAL, f"chi-square {stat:.1f} >= {CRITICAL} (df 15, p 0.001)"


def test_same_seed_same_tokens():
    a = _chi_square(3, 1.0, 1.0)
    b = _chi_square(3, 1.0, 1.0)
    assert a[0] == b[0]
    c = _chi_square(3, 1.0, 1.0, "numpy")  # the numpy path: the same tokens here
    assert c[0] == a[0] and torch.equal(c[1], a[1])


# --------------------------------------------------------------------------- draft trees
NT = 4_000  # trees per case (the tree walk runs per tree on the host)


def _tree_info(trees: list, temperature: float) -> SamplingInfo:
    """One tree per request, each with one root row and one row per node, all rows with the
    same target logits; request r's seed is its own."""
    rows = sum(1 + len(t[0]) for t in trees)
    seeds, roots, row = [], [], 0
    for r, (tokens, _, _) in enumerate(trees):
        seeds += [r * 7919 + 11] * (1 + len(tokens))
        roots.append(row)
        row += 1 + len(tokens)
    f32 = dict(dtype=torch.float32)
    return SamplingInfo(
        temperatures=torch.full((rows, 1), temperature, **f32),
        top_ps=torch.ones(rows, **f32),
        top_ks=torch.full((rows,), V),
        min_ps=torch.zeros(rows, **f32),
        greedy=torch.zeros(rows, dtype=torch.bool),
        seeds=torch.tensor(seeds),
        steps=torch.full((rows,), 42),
        need_top_filter=False,
        need_min_p=False,
        all_greedy=False,
        logit_bias=None,
        penalty=None,
        banned=None,
        trees=[(root, *t) for root, t in zip(roots, trees)],
    )


def _tree_chi_square(make_tree, path: str = "torch") -> tuple[float, float]:
    """(chi-square of the first emitted token against p, share of trees accepting a node)."""
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    p = torch.softmax(logits, -1)
    gen = torch.Generator().manual_seed(5)
    trees = [make_tree(p, gen) for _ in range(NT)]
    info = _tree_info(trees, 1.0)
    n_rows = info.seeds.shape[0]
    _, _, out = sampler.sample_verify_trees(*_on(path, logits.expand(n_rows, V).clone(), info))
    first = torch.tensor([tokens[path[0]] if path else last for (tokens, _, _), (path, last) in
                          zip(trees, out)])  # fmt: skip
    observed = torch.bincount(first, minlength=V).double()
    expected = p.double() * NT
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, sum(bool(path) for path, _ in out) / NT


def _deterministic_tree(p, gen):
    """Three distinct first-level candidates (one rare), each with a child: q one-hot."""
    return [6, 2, 12, 6, 3], [-1, -1, -1, 0, 2], None


def _sampled_tree(p, gen):
    """Two first-level candidates drawn i.i.d. from a draft distribution q (SpecInfer's
    case; the two may be the same token), q given per node."""
    q = torch.softmax(torch.arange(V, dtype=torch.float32) / 6, -1)
    x = torch.multinomial(q, 2, replacement=True, generator=gen).tolist()
    return x, [-1, -1], q.expand(2, V)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("make_tree", [_deterministic_tree, _sampled_tree])
@pytest.mark.parametrize(
    "residual",
    [
        "correct",
        pytest.param(
            "broken", marks=pytest.mark.xfail(strict=True, reason="the residual must take q out")
        ),
    ],
)
def test_tree_verified_tokens_follow_the_target_distribution(
    monkeypatch, make_tree, residual, path
):
    """Multi-candidate rejection sampling over a tree keeps the target distribution; leaving
    q in the residual (each rejected candidate stays as likely) fails the same test."""
    if residual == "broken":  # the tree walk's own residual (verify_trees)
        monkeypatch.setattr(verify, "residual", _broken_residual)
    stat, accepted = _tree_chi_square(make_tree, path)
    assert 0 < accepted < 1  # both acceptance and rejection exercised
    assert stat < CRITICAL, f"chi-square {stat:.1f} >= {CRITICAL} (df 15, p 0.001)"


def test_greedy_tree_walk_takes_the_argmax_path():
    """Greedy: the accepted path follows the argmax at every node; a sibling that is not the
    argmax is never taken, and the token after the path is the argmax of its last row."""
    logits = torch.full((6, V), -5.0)
    # rows: root, node0 (tok 3), node1 (tok 4), node2 (tok 7, child of 1), node3, node4
    for row, best in enumerate([4, 9, 7, 1, 0, 0]):
        logits[row, best] = 5.0
    tokens, parents = [3, 4, 7, 2, 1], [-1, -1, 1, 2, 2]
    info = _tree_info([(tokens, parents, None)], 1.0)
    info.greedy[:] = True
    info.all_greedy = True
    _, _, out = sampler.sample_verify_trees(logits.clone(), info)
    assert out == [([1, 2, 4], 0)]
    assert sampler.sample_verify_trees(*_on("numpy", logits, info))[2] == out
