"""The sampler's numpy path (issue 32's port, layer 3: the CPU path without torch) against its
torch path: numpy float32 logits with the numpy `SamplingInfo` that `from_reqs` builds, and
the same logits as a tensor with the same info through `SamplingInfo.to`. Greedy ids and
acceptances are bit for bit the torch path's; the noise is too (integer hashing); sampled
tokens are the same on these cases (float rounding could move a sample whose race is within a
last bit, which none of them is); logprobs agree to float32 rounding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loom.runtime import sampler
from loom.runtime.req import Req
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling.logprobs import token_logprobs
from loom.runtime.sampling.rng import hashed_uniform, hashed_uniform_column, hashed_uniform_columns
from loom.runtime.sampling.verify import target_probs
from loom.runtime.sampling_params import make_sampling_params
from tests.runtime_helpers import run_child

EOS = 1


def _reqs(params: list[dict], seed0: int = 0) -> list[Req]:
    reqs = []
    for i, p in enumerate(params):
        r = Req(f"r{i}", [5, 6, 7 + i], make_sampling_params(p), seed0 + 31 * i,
                eos_token_ids=frozenset({EOS}))  # fmt: skip
        r.output_ids = [3, 9, 3, 4 + i]
        reqs.append(r)
    return reqs


def _logits(n: int, vocab: int, seed: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * scale).astype(np.float32)


def _both(fn, logits: np.ndarray, info: SamplingInfo):
    """fn on the numpy path and on the torch path (fresh copies: the logits change in place)."""
    return fn(logits.copy(), info), fn(torch.from_numpy(logits.copy()), info)


def _as_list(x):
    if x is None:
        return None
    return x if isinstance(x, list) else x.tolist()


SAMPLED = {"temperature": 0.8}
GREEDY = {"temperature": 0}
CASES = {  # name: (per-request params, from_reqs keywords)
    "plain": ([SAMPLED, GREEDY, {"temperature": 1.3}], {}),
    "top_k_p": ([{"temperature": 0.7, "top_k": 40, "top_p": 0.9}, {"top_p": 0.5}, GREEDY], {}),
    "min_p": ([{"min_p": 0.05}, {"min_p": 0.3, "top_k": 7}], {}),
    "wide_top_p": ([{"top_p": 0.999}, {"top_k": 2000}], {}),  # the cut past 1024 candidates
    "bias_bans_penalties": (
        [
            {"logit_bias": {"3": 4.0, "10": -2.0}, "min_new_tokens": 9, "repetition_penalty": 1.3},
            {"frequency_penalty": 0.5, "presence_penalty": 0.7, "temperature": 0.9},
            GREEDY,
        ],
        {},
    ),  # fmt: skip
    "chain_drafts": ([SAMPLED, GREEDY, {"top_k": 5}], {"drafts": [[3, 4, 5], [9, 2], []]}),
    "greedy_drafts": ([GREEDY, {**GREEDY, "repetition_penalty": 1.2}], {"drafts": [[3, 4], [7]]}),
}


@pytest.mark.parametrize("vocab", [300, 5000])
@pytest.mark.parametrize("case", list(CASES))
def test_sample_verify_is_the_torch_paths(case, vocab):
    params, kw = CASES[case]
    for seed in range(3):
        info = SamplingInfo.from_reqs(_reqs(params, seed), vocab, **kw)
        rows = info.greedy.shape[0]
        logits = _logits(rows, vocab, seed)
        if case == "chain_drafts":  # some drafts likely enough to be accepted
            logits[0, 3] = logits[1, 4] = 8.0
        if seed == 1:  # a grammar mask: the first 64 tokens refused on row 0, odd ones on 1
            mask = np.full((rows, (vocab + 31) // 32), -1, np.int32)
            mask[0, :2] = 0
            mask[min(1, rows - 1)] = 0x55555555
            info.vocab_mask = mask
        (tn, an, _), (tt, at, _) = _both(sampler.sample_verify_trees, logits, info)
        assert isinstance(tn, np.ndarray) and tn.dtype == np.int64
        assert tn.tolist() == tt.tolist(), (case, seed)
        assert _as_list(an) == _as_list(at)
        ids_n, ids_t = _both(sampler.greedy_rows, logits, info)
        assert ids_n == ids_t and all(type(i) is int for i in ids_n)
        assert sampler.greedy_accepts(ids_n, info) == sampler.greedy_accepts(ids_t, info.to("cpu"))
        if not info.all_greedy:
            pn, pt = _both(target_probs, logits, info)
            np.testing.assert_allclose(pn, pt.numpy(), rtol=2e-6, atol=1e-9)


def test_greedy_is_bitwise_on_ties_nan_and_masked_rows():
    info = SamplingInfo.from_reqs(_reqs([GREEDY] * 4), 50, drafts=[[7], [], [2], []])
    x = _logits(info.greedy.shape[0], 50, 0)
    x[0, 7] = x[0, 30] = 100.0  # a tie: the first wins (and the draft 7 is accepted)
    x[2, 5] = x[2, 9] = np.nan
    x[3] = -np.inf
    (tn, an), (tt, at) = _both(sampler.greedy_verify, x, info)
    assert tn == tt and an == at and an[0] is True
    (sn, acc_n), (st, acc_t) = _both(sampler.sample_and_verify, x, info)
    assert sn.tolist() == st.tolist() == tn and acc_n.tolist() == acc_t.tolist()


def test_trees_verify_as_on_the_torch_path():
    params = [SAMPLED, GREEDY, {"top_k": 6, "temperature": 1.5}]
    tokens = [[3, 4, 7, 2, 1], [3, 4, 7], [5, 6]]
    parents = [[-1, -1, 1, 2, 2], [-1, 0, 1], [-1, -1]]
    q = torch.softmax(torch.arange(40, dtype=torch.float32) / 9, -1).expand(2, 40)
    for seed in range(6):
        info = SamplingInfo.from_reqs(
            _reqs(params, seed), 40, drafts=tokens, parents=parents, draft_probs=[None, None, q]
        )
        logits = _logits(info.greedy.shape[0], 40, seed, scale=1.0)
        logits[:, [3, 4, 5, 7]] += 1.5  # draft tokens likely enough to be accepted sometimes
        (tn, _, trees_n), (tt, _, trees_t) = _both(sampler.sample_verify_trees, logits, info)
        assert trees_n == trees_t and tn.tolist() == tt.tolist()


def test_race_over_the_support_is_the_dense_race():
    """`race_rows` hashes noise only for a filtered row's nonzero probabilities: the same
    tokens as the dense race over the whole row (ties to the lower id), for sparse rows,
    dense rows and rows left out."""
    from loom.runtime.sampling.verify import race, race_rows

    vocab, n = 4000, 64
    info = SamplingInfo.from_reqs(_reqs([SAMPLED] * n), vocab)
    rng = np.random.default_rng(7)
    probs = rng.random((n, vocab)).astype(np.float32)
    for i in range(n):
        keep = vocab if i % 4 == 0 else int(rng.integers(1, 300))  # dense or filtered rows
        probs[i, rng.permutation(vocab)[keep:]] = 0
    probs[1, :] = 0
    probs[1, [5, 900]] = 0.5  # a tie between two tokens
    probs /= probs.sum(-1, keepdims=True)
    want = race(probs, hashed_uniform(info.seeds, info.steps, vocab))
    skip = np.zeros(n, bool)
    skip[3] = True
    got = race_rows(probs, info, skip)
    assert got[3] == 0 and np.array_equal(np.delete(got, 3), np.delete(want, 3))
    assert all(probs[i, t] > 0 for i, t in enumerate(got.tolist()) if i != 3)


def test_noise_is_bitwise_torchs():
    seeds = np.array([0, 1, 2**62 + 12345, -5, 123456789], np.int64)
    steps = np.array([0, 5, 7, 2**40, 3], np.int64)
    ts, tp = torch.from_numpy(seeds), torch.from_numpy(steps)
    a, b = hashed_uniform(seeds, steps, 70_000), hashed_uniform(ts, tp, 70_000).numpy()
    assert a.dtype == np.float32 and np.array_equal(a.view(np.int32), b.view(np.int32))
    cols = np.array([-1, -2, -7, 3])
    a = hashed_uniform_columns(seeds, steps, cols)
    b = hashed_uniform_columns(ts, tp, torch.from_numpy(cols)).numpy()
    assert np.array_equal(a.view(np.int32), b.view(np.int32))
    a, b = hashed_uniform_column(seeds, steps, -1), hashed_uniform_column(ts, tp, -1).numpy()
    assert np.array_equal(a.view(np.int32), b.view(np.int32))


@pytest.mark.parametrize("top", [0, 5, 300])
def test_logprobs_agree_with_torch(top):
    x = _logits(6, 300, 4)
    x[1, 17] = x[1, 40] = 9.0  # a tie in the top entries: the lower id first on both
    ids = np.array([0, 17, 40, 299, 5, 6])
    cn, vn, in_ = token_logprobs(x, ids, top)
    ct, vt, it = token_logprobs(torch.from_numpy(x), torch.from_numpy(ids), top)
    np.testing.assert_allclose(cn, ct.numpy(), rtol=1e-5, atol=1e-5)
    if top == 0:
        assert vn is None and vt is None and in_ is None
        return
    np.testing.assert_allclose(vn, vt.numpy(), rtol=1e-5, atol=1e-5)
    assert in_[:, :2].tolist() == it[:, :2].tolist() and in_[1, :2].tolist() == [17, 40]
    assert in_.dtype == np.int64 and in_.shape == (6, top)


def test_to_is_zero_copy_and_idempotent():
    info = SamplingInfo.from_reqs(_reqs([SAMPLED, {"repetition_penalty": 1.1}]), 64)
    assert info.is_numpy() and isinstance(info.penalty[0], np.ndarray)
    t = info.to("cpu")
    assert not t.is_numpy() and t.to("cpu") is t and t.to_numpy().seeds.tolist() == [0, 31]
    assert t.temperatures.data_ptr() == info.temperatures.ctypes.data  # a view, no copy
    assert torch.equal(t.penalty[1], torch.from_numpy(info.penalty[1]))


_SCRIPT = r"""
import sys

import numpy as np

from loom.runtime import sampler
from loom.runtime.req import Req
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling.logprobs import token_logprobs
from loom.runtime.sampling_params import make_sampling_params

params = [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "repetition_penalty": 1.2},
          {"min_p": 0.1, "logit_bias": {"3": 2.0}, "min_new_tokens": 5}]
reqs = [Req(f"r{i}", [5, 6, 7], make_sampling_params(p), i, eos_token_ids=frozenset({1}))
        for i, p in enumerate(params)]
for drafts, parents in ((None, None), ([[3, 4], [], [2]], None), ([[3, 4], [5], []], [[-1, -1], [-1], None])):
    info = SamplingInfo.from_reqs(reqs, 2000, drafts=drafts, parents=parents)
    n = info.greedy.shape[0]
    logits = np.random.default_rng(0).standard_normal((n, 2000)).astype(np.float32)
    info.vocab_mask = np.full((n, 63), -1, np.int32)
    tokens, accepted, trees = sampler.sample_verify_trees(logits.copy(), info)
    assert tokens.shape == (n,)
    assert isinstance(sampler.greedy_rows(logits.copy(), info), list)
    token_logprobs(logits, tokens, 3)
assert "torch" not in sys.modules, "the sampler imported torch"
print("ok")
"""


def test_sampling_without_torch():
    """Building a `SamplingInfo` from `Req`s and sampling numpy logits never imports torch."""
    assert run_child(_SCRIPT, timeout=120) == ["ok"]


_GRAMMAR_SCRIPT = r"""
import sys

import numpy as np

from loom.grammar.base import unpack_bitmask
from loom.grammar.regex_grammar import CompiledRegex, RegexGrammar
from loom.grammar.vocab import TokenVocabulary
from loom.runtime import sampler
from loom.runtime.req import Req
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.step_grammar import StepGrammar
from tests.conftest_grammar import byte_bpe, encode

tok = byte_bpe()
vocab = TokenVocabulary.from_tokenizer(tok, vocab_size=1300)
compiled = CompiledRegex(r"[0-9]{4}-[0-9]{2}", vocab)
text = encode(tok, "2024-01")
owner = StepGrammar(tok, 1300, eos_token_ids=vocab.eos_token_ids)
reqs = []
for i, params in enumerate(({"temperature": 0}, {"temperature": 0.9, "top_k": 20})):
    req = Req(f"r{i}", [5, 6], make_sampling_params(params), i, eos_token_ids=vocab.eos_token_ids)
    req.grammar = RegexGrammar(compiled)
    req.draft_ids = owner.walk(req, list(text[:2]))  # legal: walked, kept whole
    assert req.draft_ids == text[:2]
    reqs.append(req)
info = SamplingInfo.from_reqs(reqs, 1300, drafts=[r.draft_ids for r in reqs])
lazy = owner.rows(reqs, info, lazy_ok=True)
assert lazy is None and isinstance(info.vocab_mask, np.ndarray)  # a sampled row: every mask
allowed = unpack_bitmask(info.vocab_mask, 1300)
logits = np.random.default_rng(0).standard_normal((6, 1300)).astype(np.float32)
tokens, accepted, _ = sampler.sample_verify_trees(logits.copy(), info)
assert all(allowed[row, t] for row, t in enumerate(tokens.tolist()))
greedy = [reqs[0]]
reqs[0].draft_ids, reqs[0].draft_masks = [], None
info = SamplingInfo.from_reqs(greedy, 1300)
lazy = owner.rows(greedy, info, lazy_ok=True)
ids = sampler.greedy_rows(logits[:1].copy(), info)
lazy.resolve(logits[:1].copy(), ids)
reqs[0].grammar.accept_token(ids[0])  # raises GrammarError where the masked argmax is not legal
assert "torch" not in sys.modules, "the grammar path imported torch"
print("ok")
"""


def test_grammar_rows_without_torch():
    """A regex grammar's draft walk, mask rows and lazy rows (StepGrammar, numpy int32
    words) and sampling under them never import torch; the sampled tokens are allowed."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert run_child(_GRAMMAR_SCRIPT, cwd=str(root)) == ["ok"]
