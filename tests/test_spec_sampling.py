"""Speculative verification at temperature > 0 keeps the target distribution.

A 16-token vocabulary: each of N rows verifies a draft token x (q one-hot, the n-gram
drafter's case) against the same target logits with its own seed. The token each row yields
(x when accepted, else the residual sample) must follow p exactly: a chi-square test at a
fixed seed. The broken variant (the residual left as p, forgetting to take q out) must FAIL
the same test: it over-produces x.
"""

from __future__ import annotations

import pytest
import torch

from loom.runtime import sampler
from loom.runtime.sampler import SamplingInfo, sample_and_verify, target_probs

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


def _chi_square(draft: int, temperature: float, top_p: float) -> tuple[float, torch.Tensor]:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5
    info = _info(draft, temperature, top_p)
    p = target_probs(logits.expand(N, V).clone(), info)[0]
    tokens, accepted = sample_and_verify(logits.expand(N, V).clone(), info)
    tokens = torch.where(accepted, info.draft_tokens, tokens)
    observed = torch.bincount(tokens, minlength=V).double()
    expected = p.double() * N
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token outside the target's support"
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, accepted


CASES = [(6, 1.0, 1.0), (2, 1.0, 1.0), (12, 0.7, 0.9)]  # p(x) about 0.35, 0.01; top-p


def _broken_residual(p, q):
    return p / p.sum(dim=-1, keepdim=True)


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
    monkeypatch, draft, temperature, top_p, residual
):
    if residual == "broken":
        monkeypatch.setattr(sampler, "residual", _broken_residual)
    stat, accepted = _chi_square(draft, temperature, top_p)
    assert 0 < accepted.float().mean() < 1  # both branches were exercised
    assert stat < CRITICAL, f"chi-square {stat:.1f} >= {CRITICAL} (df 15, p 0.001)"


def test_same_seed_same_tokens():
    a = _chi_square(3, 1.0, 1.0)
    b = _chi_square(3, 1.0, 1.0)
    assert a[0] == b[0]
