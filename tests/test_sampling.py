"""Sampling behaviour as SGLang documents it, on a tiny random model."""

from __future__ import annotations

import random

import pytest
import torch

from loom.runtime.sampler import sample
from loom.runtime.sampling.info import SamplingInfo
from loom.runtime.sampling.rng import hashed_uniform
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

EOS = 2  # the tiny models' eos_token_id


@pytest.fixture(scope="module")
def sched(tiny_model_dir):
    return make_scheduler(tiny_model_dir("llama"))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


def _one(sched, params, prompt=None, **kw):
    submit(sched, "x", prompt or _prompt(12, 1), params, **kw)
    return run_all(sched)["x"]


def test_same_seed_same_output_whatever_the_batch(sched):
    params = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True}
    prompt = _prompt(10, 7)
    alone = _one(sched, params, prompt, seed=1234).ids
    for i in range(6):
        submit(sched, f"other{i}", _prompt(5 + 13 * i, i), params, seed=i)
    submit(sched, "x", prompt, params, seed=1234)
    batched = run_all(sched)["x"].ids
    assert alone == batched
    assert _one(sched, params, prompt, seed=99).ids != alone


def test_sampling_seed_param_and_top_k_one_is_greedy(sched):
    prompt = _prompt(9, 3)
    g = _one(sched, greedy(16), prompt).ids
    assert (
        _one(sched, {"max_new_tokens": 16, "top_k": 1, "ignore_eos": True}, prompt, seed=5).ids == g
    )


def test_stop_string_across_tokens_is_caught_and_trimmed(sched):
    prompt = _prompt(15, 11)
    full = _one(sched, greedy(40), prompt)
    tok = sched.tokenizer
    pieces = [tok.decode(full.ids[:k]) for k in range(len(full.ids) + 1)]
    # a stop string that starts inside token 5 and ends inside token 6 (or later)
    start = len(pieces[5]) - 1
    stop = full.text[start : start + 3]
    assert len(stop) == 3 and full.text.find(stop) == start
    res = _one(sched, greedy(40, stop=[stop]), prompt)
    assert res.finish_reason == {"type": "stop", "matched": stop}
    assert res.text == full.text[:start]
    kept = _one(sched, greedy(40, stop=[stop], no_stop_trim=True), prompt)
    assert kept.text.startswith(full.text[:start] + stop)


def test_streamed_chunks_never_show_a_partial_stop(sched):
    prompt = _prompt(15, 11)
    full = _one(sched, greedy(40), prompt)
    stop = full.text[20:24]
    res = _one(sched, greedy(40, stop=[stop]), prompt, stream=True)
    assert "".join(res.chunks) == res.text == full.text[: full.text.find(stop)]


def test_stop_token_ids(sched):
    prompt = _prompt(12, 2)
    full = _one(sched, greedy(30), prompt).ids
    target = full[7]
    res = _one(sched, greedy(30, stop_token_ids=[target]), prompt)
    assert res.ids == full[: full.index(target) + 1]
    assert res.finish_reason == {"type": "stop", "matched": target}


def test_min_new_tokens_and_ignore_eos(sched):
    favour_eos = {"logit_bias": {str(EOS): 100.0}, "temperature": 0, "max_new_tokens": 20}
    assert _one(sched, favour_eos).ids == [EOS]
    res = _one(sched, {**favour_eos, "min_new_tokens": 5})
    assert len(res.ids) == 6 and res.ids[-1] == EOS and EOS not in res.ids[:5]
    assert res.finish_reason == {"type": "stop", "matched": EOS}
    res = _one(sched, {**favour_eos, "ignore_eos": True})
    assert len(res.ids) == 20 and res.finish_reason == {"type": "length", "length": 20}


def test_max_new_tokens_zero_returns_prompt_logprobs(sched):
    prompt = _prompt(12, 4)
    res = _one(sched, {"max_new_tokens": 0}, prompt, return_logprob=True, logprob_start_len=0)
    assert res.ids == [] and res.text == ""
    assert res.finish_reason == {"type": "length", "length": 0}
    assert len(res.input_logprobs) == len(prompt)
    assert res.input_logprobs[0] == (None, prompt[0])
    assert all(lp < 0 for lp, _ in res.input_logprobs[1:])
    assert [t for _, t in res.input_logprobs] == prompt
    res3 = _one(sched, {"max_new_tokens": 0}, prompt, return_logprob=True, logprob_start_len=3)
    # the second run reads 2 prompt tokens' KV from the cache (another attention path)
    assert [t for _, t in res3.input_logprobs] == prompt[3:]
    assert all(
        abs(a - b) < 1e-5 for (a, _), (b, _) in zip(res3.input_logprobs, res.input_logprobs[3:])
    )


def test_output_logprobs_and_top_logprobs(sched):
    res = _one(sched, greedy(6), return_logprob=True, top_logprobs_num=3)
    assert [t for _, t in res.output_logprobs] == res.ids
    for (lp, tok), top in zip(res.output_logprobs, res.output_top):
        assert len(top) == 3 and top[0][1] == tok and abs(top[0][0] - lp) < 1e-5


def test_penalties_change_the_distribution(sched):
    prompt = _prompt(8, 5)
    base = _one(sched, greedy(30), prompt).ids
    rep = _one(sched, greedy(30, repetition_penalty=2.0), prompt).ids
    freq = _one(sched, greedy(30, frequency_penalty=2.0), prompt).ids
    assert len(set(freq)) >= len(set(base))
    assert rep != base or len(set(base)) == len(base)


def test_hashed_noise_is_uniform_and_batch_independent():
    u = hashed_uniform(torch.tensor([1, 2]), torch.tensor([5, 5]), 50_000)
    assert 0.49 < float(u.mean()) < 0.51 and float(u.min()) > 0 and float(u.max()) < 1
    alone = hashed_uniform(torch.tensor([2]), torch.tensor([5]), 50_000)
    assert torch.equal(alone[0], u[1])


def test_top_p_min_p_keep_only_the_head():
    from loom.runtime.req import Req
    from loom.runtime.sampling_params import make_sampling_params

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = torch.zeros(4)
    for seed in range(300):
        req = Req("r", [1], make_sampling_params({"top_p": 0.7}), seed)
        info = SamplingInfo.from_reqs([req], 4, "cpu")
        counts[int(sample(logits.clone(), info)[0])] += 1
    assert counts[2] == 0 and counts[3] == 0 and counts[0] > counts[1] > 0
    for seed in range(200):
        req = Req("r", [1], make_sampling_params({"min_p": 0.5}), seed)
        info = SamplingInfo.from_reqs([req], 4, "cpu")
        assert int(sample(logits.clone(), info)[0]) in (0, 1)


def test_top_filters_without_a_full_sort_match_the_full_sort(monkeypatch):
    """target_probs looks at each row's TOP_CANDIDATES largest probabilities only when every
    row's top-k / top-p / min-p cut falls inside them, else sorts the whole vocabulary: both
    give the same distribution, and the short path is taken exactly when it is exact."""
    from loom.runtime.req import Req
    from loom.runtime.sampling import verify
    from loom.runtime.sampling_params import make_sampling_params

    vocab = 3000
    monkeypatch.setattr(verify, "TOP_CANDIDATES", 64)
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=g) * 6  # most mass in a few tokens
    flat = torch.randn(vocab, generator=g) * 0.1  # mass spread over the whole vocabulary
    cases = [  # (params, logits row, whether the 64 largest decide the cut)
        ({"top_k": 20}, flat, True),
        ({"top_p": 0.5}, peaked, True),
        ({"min_p": 0.2}, peaked, True),
        ({"top_k": 40, "top_p": 0.9, "temperature": 0.7}, flat, True),
        ({"top_p": 0.9}, flat, False),  # the cut lies past the 64 largest
        ({"min_p": 0.7}, flat, False),
        ({"top_k": 500}, flat, False),
    ]
    for group in ([c for c in cases if c[2]], cases, [cases[4]]):
        reqs = [
            Req("r", [1], make_sampling_params({"temperature": 1.0, **p}), 0) for p, *_ in group
        ]
        info = SamplingInfo.from_reqs(reqs, vocab, "cpu")
        logits = torch.stack([row for _, row, _ in group])
        short = all(ok for *_, ok in group)
        assert verify._head(torch.softmax(logits, -1), info)[0].shape[-1] == (
            64 if short else vocab
        )
        got = verify.target_probs(logits, info)
        monkeypatch.setattr(verify, "TOP_CANDIDATES", vocab)  # the full sort
        want = verify.target_probs(logits, info)
        monkeypatch.setattr(verify, "TOP_CANDIDATES", 64)
        torch.testing.assert_close(got, want, atol=1e-7, rtol=0)
        assert ((got > 0).sum(-1) < vocab).all()  # every row really was filtered


def test_argmax_rows_matches_torch_argmax_on_ties_nan_and_strided_rows():
    """The CPU greedy pick goes through numpy: the same ids as torch.argmax, the first index
    of the maximum on a tie and of the first NaN, for contiguous and strided logits."""
    from loom.runtime.sampling.verify import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=g)
    x[1, 7] = x[1, 30] = 100.0  # a tie: the first wins
    x[2, 5] = x[2, 9] = float("nan")  # NaN counts as the maximum
    x[3] = float("-inf")  # a fully masked row
    x[4, 49] = float("inf")
    for t in (x, x[:, ::2], torch.randn(50, 6, generator=g).t()):
        got = argmax_rows(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.argmax(dim=-1))


def test_row_parameter_tensors_are_shared_only_for_equal_values():
    """Consecutive steps with the same rows reuse the parameter tensors (the decode fast
    path); other values, or a draft tree's info (its own, writable), get new ones."""
    from loom.runtime.req import Req
    from loom.runtime.sampling_params import make_sampling_params

    def reqs(temp, seed=0):
        return [Req("r", [1, 2], make_sampling_params({"temperature": temp, "top_k": 3}), seed)]

    a = SamplingInfo.from_reqs(reqs(0.5), 8)
    b = SamplingInfo.from_reqs(reqs(0.5), 8)
    assert a.temperatures is b.temperatures and a.seeds is b.seeds
    c = SamplingInfo.from_reqs(reqs(0.7), 8)
    assert float(c.temperatures[0, 0]) == pytest.approx(0.7) and int(c.top_ks[0]) == 3
    d = SamplingInfo.from_reqs(reqs(0.7, seed=5), 8)
    assert int(d.seeds[0]) == 5 and int(c.seeds[0]) == 0
    tree = SamplingInfo.from_reqs(reqs(0.7, seed=5), 8, drafts=[[4, 5]], parents=[[-1, -1]])
    tree.greedy[:] = True
    again = SamplingInfo.from_reqs(reqs(0.7, seed=5), 8)
    assert not bool(again.greedy.any()) and int(again.steps[0]) == 2


def test_row_parameter_tensors_are_reused_across_draft_lengths():
    """A request whose verify steps alternate between draft lengths (its rows per step vary)
    gets the tensors built for the same rows before, with each row's values; the memo stays
    bounded."""
    from loom.runtime.req import Req
    from loom.runtime.sampling import params
    from loom.runtime.sampling_params import make_sampling_params

    params._ROW_PARAMS.clear()  # earlier tests' rows may have filled it (cleared when full)
    req = Req("r", [1, 2], make_sampling_params({"temperature": 0.5, "top_p": 0.9}), 7)
    two = SamplingInfo.from_reqs([req], 8, drafts=[[4, 5]])
    one = SamplingInfo.from_reqs([req], 8)
    again = SamplingInfo.from_reqs([req], 8, drafts=[[6, 3]])
    assert again.temperatures is two.temperatures and again.seeds is two.seeds
    assert one.seeds is not two.seeds and len(one.seeds) == 1 and len(two.seeds) == 3
    assert two.top_ps.tolist() == pytest.approx([0.9] * 3) and two.seeds.tolist() == [7] * 3
    assert again.draft_tokens.tolist() == [6, 3, -1] and again.steps.tolist() == [2, 3, 4]
    for k in range(2 * params.ROW_PARAMS_KEPT):
        SamplingInfo.from_reqs([req], 8, drafts=[[4] * (k % 9)])
        req.seed = k  # new values every ninth call
        assert len(params._ROW_PARAMS) <= params.ROW_PARAMS_KEPT


def test_greedy_verify_picks_and_accepts_what_the_full_sampler_does():
    """The runner's path for all-greedy rows without a tree (`greedy_verify`: Python lists)
    gives the full sampler's ids and acceptances: plain rows (ties, NaN and -inf rows
    included), logit bias, penalties, min_new_tokens bans, a grammar mask and chain drafts."""
    from loom.runtime.req import Req
    from loom.runtime.sampler import greedy_verify, sample_and_verify
    from loom.runtime.sampling_params import make_sampling_params

    def info(params: dict, n: int = 3, **kw):
        reqs = [
            Req(f"r{i}", [1, 2], make_sampling_params(params), i, eos_token_ids=frozenset({EOS}))
            for i in range(n)
        ]
        for r in reqs:
            r.output_ids = [3, 3]
        return SamplingInfo.from_reqs(reqs, 50, **kw)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g)
    x[0, 7] = x[0, 30] = 100.0  # a tie: the first wins
    x[1, 5] = x[1, 9] = float("nan")
    x[2] = float("-inf")
    mask = torch.full((3, 2), -1, dtype=torch.int32)
    mask[0, 0] = 0  # tokens 0-31 refused in row 0
    cases = [
        (info({"temperature": 0}), [x, torch.randn(50, 3, generator=g).t()]),
        (info({"temperature": 0, "logit_bias": {"3": 5.0}}), [torch.randn(3, 50, generator=g)]),
        (info({"temperature": 0, "repetition_penalty": 1.5}), [torch.randn(3, 50, generator=g)]),
        (info({"temperature": 0, "min_new_tokens": 4}), [torch.randn(3, 50, generator=g)]),
        (info({"temperature": 0}), [torch.randn(3, 50, generator=g)]),
    ]
    cases[-1][0].vocab_mask = mask
    chain = info({"temperature": 0}, n=1, drafts=[[4, 5]])
    y = torch.randn(3, 50, generator=g)
    y[0, 4] = y[2, 11] = 50.0  # row 0 accepts 4, row 1 rejects 5
    cases.append((chain, [y, torch.where(torch.arange(50) == 5, 60.0, y)]))
    for inf, logits in cases:
        for t in logits:
            ids, acc = sample_and_verify(t.clone(), inf)
            got, got_acc = greedy_verify(t.clone(), inf)
            assert got == ids.tolist() and all(type(i) is int for i in got)
            assert got_acc == (None if acc is None else acc.tolist())
    assert greedy_verify(y.clone(), chain)[1] == [True, False, False]


class _ModGrammar:
    """A toy grammar over 40 tokens: after the tokens `s`, token t is allowed unless
    (t + len(s) + sum(s)) % 3 == 0 (a third refused, a different third at every state). Where
    (len(s) + sum(s)) % 5 == 0 text is forced (`jump_forward`) and, as llguidance does, the
    mask allows only its own tokenization (here the first allowed token) while `accept_token`
    takes any allowed token."""

    def __init__(self):
        self.tokens: list[int] = []
        self.masks = 0  # fill_mask calls

    def _accepts(self, t: int) -> bool:
        return (t + len(self.tokens) + sum(self.tokens)) % 3 != 0

    def jump_forward(self) -> str | None:
        return "forced" if (len(self.tokens) + sum(self.tokens)) % 5 == 0 else None

    def is_forced(self) -> bool:
        return self.jump_forward() is not None

    def forced_token(self) -> int | None:
        """At a forced state, the one token its mask allows (as llguidance names its forced
        text's first token)."""
        if self.jump_forward() is None:
            return None
        self.named = getattr(self, "named", 0) + 1
        return next(u for u in range(40) if self._accepts(u))

    def allowed(self, t: int) -> bool:
        if self.jump_forward() is not None:
            return t == next(u for u in range(40) if self._accepts(u))
        return self._accepts(t)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.masks += 1
        bits = [self.allowed(t) for t in range(bitmask.shape[1] * 32)]
        for w in range(bitmask.shape[1]):
            v = sum(1 << b for b in range(32) if bits[32 * w + b])
            bitmask[row, w] = v - (1 << 32) if v >= 1 << 31 else v

    def accept_token(self, t: int) -> None:
        from loom.grammar.base import GrammarError

        if not self._accepts(t):
            raise GrammarError(f"token {t} is not allowed here")
        self.tokens.append(t)

    def rollback(self, k: int) -> None:
        del self.tokens[len(self.tokens) - k :]


@pytest.mark.parametrize("path", ["torch", "numpy"])
def test_lazy_grammar_rows_verify_as_fully_masked_rows(path):
    """A greedy chain verified with its grammar rows left lazy (`step_grammar.LazyRows`:
    at the row whose argmax is not its draft token, the grammar's accept of that argmax, or
    else that row's mask) keeps the same accepted run and tokens as the same chain with every
    row masked, over random logits and legal drafts that the masked argmax accepts at random
    depths; the grammar ends where it started. Fails when the deciding row is not masked (an
    illegal argmax then becomes the next token), when the walk does not go on after a masked
    row that accepts its draft, or when the accept check is not rolled back. `path` numpy:
    the lazy rows on numpy logits (the torch-free CPU path), against the torch path's
    fully masked ones."""
    from loom.grammar.base import allocate_token_bitmask
    from loom.runtime.req import Req
    from loom.runtime.sampler import greedy_accepts, greedy_rows, sample_and_verify
    from loom.runtime.sampling.penalties import apply_vocab_mask_
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.step_grammar import LazyRows, fill_draft_rows

    vocab, rng = 40, random.Random(0)
    g = torch.Generator().manual_seed(1)
    masks_lazy = masks_full = went_on = named = 0
    for trial in range(300):
        grammar = _ModGrammar()
        grammar.tokens = [rng.randrange(vocab) for _ in range(rng.randrange(3))]
        start = list(grammar.tokens)
        logits = torch.randn(8, vocab, generator=g)
        # a legal draft: at each depth the masked argmax (accepted) or another allowed token
        draft = []
        for j in range(rng.randrange(1, 8)):
            row = allocate_token_bitmask(1, vocab)
            grammar.fill_mask(row, 0)
            masked = logits[j].clone()
            apply_vocab_mask_(masked[None], row)
            best = int(masked.argmax())
            # legal as the greedy walk checks it (accept_token: laxer than the mask where
            # text is forced, as llguidance's)
            legal = [t for t in range(vocab) if grammar._accepts(t)]
            t = best if rng.random() < 0.7 else rng.choice(legal)
            went_on += t == best != int(logits[j].argmax())
            grammar.accept_token(t)
            draft.append(t)
        grammar.rollback(len(draft))
        grammar.masks = 0
        req = Req("r", [1, 2], make_sampling_params({"temperature": 0}), 0)
        rows = logits[: 1 + len(draft)]

        full = SamplingInfo.from_reqs([req], vocab, drafts=[draft])
        full.vocab_mask = allocate_token_bitmask(1 + len(draft), vocab)
        fill_draft_rows(grammar, draft, full.vocab_mask, 0)
        masks_full += grammar.masks
        ids, acc = sample_and_verify(rows.clone(), full)
        ids, acc = ids.tolist(), acc.tolist()
        k = next((j for j, a in enumerate(acc[: len(draft)]) if not a), len(draft))

        lazy = SamplingInfo.from_reqs([req], vocab, drafts=[draft])
        grammar.masks = 0
        lazy_logits = rows.clone() if path == "torch" else rows.numpy().copy()
        got = greedy_rows(lazy_logits, lazy)
        LazyRows([(0, grammar, draft, frozenset({EOS}))]).resolve(lazy_logits, got)
        got_acc = greedy_accepts(got, lazy)
        masks_lazy += grammar.masks
        got_k = next((j for j, a in enumerate(got_acc[: len(draft)]) if not a), len(draft))
        assert (got_k, got[: k + 1]) == (k, ids[: k + 1]), trial
        assert grammar.tokens == start
        named += getattr(grammar, "named", 0)
    assert went_on > 20  # masked rows that accepted their draft after an illegal argmax
    assert named > 3  # forced states whose argmax draft token was checked by forced_token
    assert masks_lazy <= 300 + went_on < masks_full


@pytest.mark.parametrize("path", ["torch", "numpy"])
def test_lazy_grammar_plain_rows_decode_as_fully_masked_rows(path):
    """Plain decode rows (no draft) of greedy requests with a grammar, left to the sampler by
    `StepGrammar.rows(..., lazy_ok=True)`: the argmax is kept where the grammar accepts it,
    else that row alone is masked. Over random batches mixing constrained and free requests,
    with penalties, logit_bias and min_new_tokens EOS bans (applied before the argmax) and
    EOS often the argmax (always masked: the grammar may or may not end there), the tokens are
    those of every grammar row masked; each grammar ends where it started, and fewer masks
    are computed. Fails when the refused argmax is kept unmasked, when EOS skips the mask, or
    when the accept check is not rolled back, or when a state with forced text is not masked
    (the toy's accept is laxer there, as llguidance's). `path` numpy: the lazy rows on numpy
    logits against the torch path's fully masked ones."""
    from loom.runtime.req import Req
    from loom.runtime.sampler import greedy_accepts, greedy_rows
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.step_grammar import StepGrammar

    vocab, rng = 40, random.Random(5)
    g = torch.Generator().manual_seed(6)
    masks_lazy = masks_full = refused = eos_masked = 0
    for trial in range(300):
        reqs, grammars = [], []
        for i in range(rng.randrange(1, 7)):
            params: dict = {"temperature": 0}
            if rng.random() < 0.3:
                params["frequency_penalty"] = rng.choice([0.5, 2.0])
            if rng.random() < 0.3:
                params["logit_bias"] = {str(rng.randrange(vocab)): rng.choice([3.0, -3.0])}
            if rng.random() < 0.2:
                params["min_new_tokens"] = 3
            req = Req(
                f"r{i}", [5, 6], make_sampling_params(params), i, eos_token_ids=frozenset({EOS})
            )
            req.output_ids = [rng.randrange(3, vocab) for _ in range(rng.randrange(4))]
            if rng.random() < 0.7:
                req.grammar = _ModGrammar()
                req.grammar.tokens = [rng.randrange(vocab) for _ in range(rng.randrange(3))]
            grammars.append(req.grammar)
            reqs.append(req)
        starts = [None if gr is None else list(gr.tokens) for gr in grammars]
        logits = torch.randn(len(reqs), vocab, generator=g)
        logits[:, EOS] += torch.rand(len(reqs), generator=g) * 4  # EOS the argmax at times

        owner = StepGrammar(None, vocab)
        full = SamplingInfo.from_reqs(reqs, vocab)
        assert owner.rows(reqs, full) is None
        masks_full += sum(gr.masks for gr in grammars if gr is not None)
        want = sample(logits.clone(), full).tolist()

        for gr in grammars:
            if gr is not None:
                gr.masks = 0
        lazy = SamplingInfo.from_reqs(reqs, vocab)
        lazy_rows = owner.rows(reqs, lazy, lazy_ok=True)
        assert lazy.vocab_mask is None
        assert len(lazy_rows.chains if lazy_rows else ()) == sum(gr is not None for gr in grammars)
        rows = logits.clone() if path == "torch" else logits.numpy().copy()
        got = greedy_rows(rows, lazy)
        if lazy_rows is not None:
            lazy_rows.resolve(rows, got)
        acc = greedy_accepts(got, lazy)
        assert (got, acc) == (want, None), trial
        assert [None if gr is None else gr.tokens for gr in grammars] == starts
        masks_lazy += sum(gr.masks for gr in grammars if gr is not None)
        for i, gr in enumerate(grammars):
            if gr is not None and gr.masks:
                refused += int(logits[i].argmax()) != EOS
                eos_masked += int(logits[i].argmax()) == EOS
    assert refused > 50 and eos_masked > 20  # both kinds of masked rows were compared
    assert masks_lazy < masks_full


def test_greedy_grammar_decode_is_the_same_with_lazy_rows(tiny_model_dir, monkeypatch):
    """End to end with llguidance on the tiny random model (whose argmax the grammar often
    refuses): greedy JSON-schema, regex and free requests in one batch, and alone, give the
    same tokens with the plain rows' grammar masks left to the sampler as with every row
    masked (the reference: `StepGrammar.rows` fills every row when more than one rank
    holds the plan), with fewer masks; jump-forward on, EOS allowed where the grammar ends."""
    import json

    from loom.grammar.engines.llguidance_engine import LLGuidanceGrammar
    from loom.runtime import step_grammar as grammar_mod
    from loom.runtime.distributed import ParallelState
    from tests.runtime_helpers import make_scheduler

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"],
    }
    masks = [0]
    real = LLGuidanceGrammar.fill_mask

    def counted(self, bitmask, row):
        masks[0] += 1
        real(self, bitmask, row)

    monkeypatch.setattr(LLGuidanceGrammar, "fill_mask", counted)

    def generate():
        s = make_scheduler(tiny_model_dir("llama"))
        masks[0] = 0
        out = {}
        for batch in ([0, 1, 2, 3], [0], [2]):
            for i in batch:
                grammar = [
                    {"json_schema": json.dumps(schema), "ignore_eos": False},
                    {"regex": "[a-z]{2,6}-[0-9]{1,4}( [a-z]+)?", "ignore_eos": False},
                    {"json_schema": json.dumps(schema), "frequency_penalty": 1.0},
                    {},
                ][i]
                submit(s, f"{len(batch)}-{i}", _prompt(6 + i, i), greedy(40, **grammar))
            out.update({k: (v.ids, v.finish_reason) for k, v in run_all(s).items()})
        s.close()
        return out, masks[0]

    lazy, masks_lazy = generate()
    monkeypatch.setattr(grammar_mod, "get_parallel_state", lambda: ParallelState(world_size=2))
    full, masks_full = generate()
    assert lazy == full
    assert masks_lazy < masks_full
