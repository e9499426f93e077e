"""Constrained requests under the head drafters (`head_policy.NgramPolicy`): which
requests the head runs for, and that a request it skips costs no head work (no features
kept, no catch-up, no draft loop) while its outputs stay those of plain decoding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from loom.runtime.spec.head_policy import PROBE_EVERY, _net_gain
from loom.runtime.spec.medusa import save_medusa_heads
from tests.runtime_helpers import free_head, make_scheduler, run_all, submit
from tests.test_eagle import _prompts, _target, save_reduced_eagle3
from tests.test_medusa import _random_heads


@pytest.fixture(scope="module")
def heads(llama, tmp_path_factory):
    """Random EAGLE-3 and Medusa heads for the tiny llama, as folders."""
    target = _target(llama)
    root = tmp_path_factory.mktemp("lookup_heads")
    save_reduced_eagle3(target, root / "eagle3")
    save_medusa_heads(_random_heads(target, k=3, scale=0.05), root / "medusa")
    return {"EAGLE3": str(root / "eagle3"), "MEDUSA": str(root / "medusa")}


def _sched(llama, **kw):
    return free_head(make_scheduler(llama, disable_jump_forward=True, **kw))


def test_net_gain_prices_the_head_against_the_ngram_draft():
    """The head's net gain a verify: its accepted length past the n-gram's (realised where
    the n-gram draft was verified: no gain; its estimate where the head's was), less the
    tokens the n-gram alone would have earned in the head's time."""
    assert _net_gain("ngram", 5, 2.0, 0.0, 1e-3) == 0.0
    # the n-gram draft verified: the head's time cost its rate, 0.2 step x (5 + 1) tokens
    assert _net_gain("ngram", 5, 2.0, 2e-4, 1e-3) == pytest.approx(-1.2)
    # the head's verified: 4 accepted against the n-gram's expected 1.5, less 0.1 x 2.5
    assert _net_gain("head", 4, 1.5, 1e-4, 1e-3) == pytest.approx(2.5 - 0.25)
    # a head draft that earns what the n-gram's would have does not pay its time
    assert _net_gain("head", 3, 3.0, 1e-4, 1e-3) < 0
    assert _net_gain("head", 3, 3.0, 1e-4, 0.0) == 0.0  # no forward time known: unpriced


def test_the_head_runs_for_constrained_requests_while_it_earns():
    """A free request always uses the head; a constrained one while the head earned such
    requests more than the n-gram draft it displaced, net of its time (`head_gain` >= 0), and
    every PROBE_EVERY-th constrained request anyway; the choice is per request, kept, and
    its row joins `headed` or `headless` (a finished request's row leaves both)."""
    from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs
    from loom.runtime.spec.head_policy import NgramPolicy

    args = ServerArgs(model_path=BUNDLED_MODEL_PATH, speculative_algorithm="EAGLE3")
    lk = NgramPolicy(args, None, 300, [0], 5)
    grammar = object()

    def req(row, constrained=True):
        return SimpleNamespace(  # the fields a Req declares for its drafter
            grammar=grammar if constrained else None, req_pool_idx=row, spec_state=None,
            spec_head=None, draft_source=None, draft_expected=0.0,
        )  # fmt: skip

    first = req(0)
    assert lk.uses_head(first) and lk.headed == {0}  # a fresh server tries the head
    # the head's verifies for it: its drafts earn what the n-gram's were expected to, or
    # lose to them, and each round costs a fifth of the verify's forward
    for source in ("head", "ngram", "head", "ngram", "head", "head", "ngram", "head"):
        first.draft_source, first.draft_forced, first.ngram_expected = source, 2, 2.0
        lk.charge([0, 7], 2e-4)
        lk.on_verified(first, 4, 2, 1e-3)
    assert lk.head_gain < 0 and 0 not in lk.head_seconds  # paid at each verify
    assert lk.priced == {0}  # row 7 (no request) was charged nothing
    assert lk.uses_head(first)  # decided once, kept
    uses = [lk.uses_head(req(1 + i)) for i in range(2 * PROBE_EVERY)]
    # the first request was the counter's 1st, so the probes are its 17th and 33rd
    assert [i for i, u in enumerate(uses) if u] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1], uses
    assert 2 in lk.headless and 2 not in lk.headed
    lk.charge([2], 1e-3)
    assert 2 not in lk.head_seconds  # a row the head skips is charged nothing
    free = req(2, constrained=False)  # a free request in a row a skipped one held
    assert lk.uses_head(free) and 2 in lk.headed and 2 not in lk.headless
    lk.charge([2], 1e-3)
    assert 2 not in lk.head_seconds and 2 not in lk.priced  # nor one of a free request
    lk.on_finished(free)
    assert 2 not in lk.headed and 2 not in lk.headless
    skipped = req(3)
    assert not lk.uses_head(skipped) and 3 in lk.headless
    lk.on_finished(skipped)
    assert 3 not in lk.headed and 3 not in lk.headless
    # a head whose drafts earn past the n-gram's by more than their time brings it back
    probe = req(40)
    probe.spec_head = True
    for _ in range(8):
        probe.draft_source, probe.draft_forced, probe.ngram_expected = "head", 1, 1.0
        lk.charge([40], 1e-4)
        lk.on_verified(probe, 5, 4, 1e-3)
    assert lk.head_gain >= 0 and lk.uses_head(req(41))


@pytest.mark.parametrize("radix_off", [False, True], ids=["radix-on", "radix-off"])
@pytest.mark.parametrize("algo", ["EAGLE3", "MEDUSA"])
def test_constrained_requests_the_head_skips_cost_no_head_work(llama, heads, algo, radix_off):
    """With the head's measured net gain below 0, constrained requests (regex, JSON schema, EBNF)
    draft n-gram chains only: outputs equal plain decoding, the head drafted none of them,
    and no forward of theirs kept features for the head or ran its catch-up (a batch of
    such requests alone runs like NGRAM's). Free requests beside them still draft from the
    head, their rows alone in the catch-up."""
    tok = make_scheduler(llama).tokenizer
    prompts = _prompts(tok, 2, 6)
    plain_sched = _sched(llama, disable_radix_cache=radix_off)
    for i, (ids, params) in enumerate(prompts):
        submit(plain_sched, f"p{i}", ids, params)
    plain = run_all(plain_sched)

    sched = _sched(
        llama, speculative_algorithm=algo, speculative_draft_model_path=heads[algo],
        speculative_disable_by_batch_size=64, disable_radix_cache=radix_off,
    )  # fmt: skip
    drafter = sched.decode.drafter
    drafter.policy.head_gain = -1.0  # the head earns less than the n-gram draft
    drafter.policy.requests = 1  # the next constrained request is no probe
    runner = drafter.runner
    seen = []  # per forward: (its request rows, whether it kept features)
    forward = runner.forward

    def spy(inp):
        if any(inp.sample_counts):  # not a finishing step (a finished request's last KV)
            seen.append(inp.capture is not None)  # features kept for the head
        return forward(inp)

    runner.forward = spy
    drafted, wrong = [], []  # request rows the head drafted for; those of skipped requests
    hook = drafter.after_forward

    def after(inp, out):
        before = list(drafter.pending)
        hook(inp, out)
        rows = [i for i, p in enumerate(drafter.pending) if p is not None and p is not before[i]]
        drafted.extend(rows)
        wrong.extend(r for r in rows if r in drafter.policy.headless)

    drafter.after_forward = after
    # three constrained requests alone, then the free ones beside the other three
    jobs = list(enumerate(prompts))
    for i, (ids, params) in jobs[2:5]:
        submit(sched, f"p{i}", ids, params)
    out = run_all(sched)
    alone = len(seen)
    assert alone and not any(seen), seen
    assert not drafted and drafter.summary()["spec_draft_seconds"] == 0.0
    for i, (ids, params) in jobs[:2] + jobs[5:]:
        submit(sched, f"p{i}", ids, params)
    out.update(run_all(sched))
    for i in range(len(prompts)):
        assert out[f"p{i}"].ids == plain[f"p{i}"].ids, (algo, i)
        assert out[f"p{i}"].finish_reason == plain[f"p{i}"].finish_reason
    state = sched.get_state()
    assert state["spec_constrained_head"] == 0 and state["spec_constrained_ngram"] > 0, state
    assert state["spec_verify_ct"] > 0
    assert drafted and not wrong, (drafted, wrong)
    assert any(seen[alone:])  # the free requests' forwards kept features


@pytest.mark.parametrize("algo", ["EAGLE3", "MEDUSA"])
def test_the_head_drafters_meet_the_step_through_one_seam(llama, heads, algo):
    """The scheduler asks the drafter what the forward keeps (`step_capture` ->
    `ModelInput.capture`), the runner returns those hidden states in `ForwardOutput.hidden`,
    and the scheduler hands the step to the drafter (`after_forward`): a forward that kept
    features returns them and one that kept none returns none; no hook sits on the runner and
    nothing is written onto the model. Constrained requests that use the head record, at
    their verify, the n-gram estimate of the same step's draft (`Req.ngram_expected`)."""
    tok = make_scheduler(llama).tokenizer
    sched = _sched(
        llama, speculative_algorithm=algo, speculative_draft_model_path=heads[algo],
        speculative_disable_by_batch_size=64,
    )  # fmt: skip
    drafter = sched.decode.drafter
    drafter.policy.head_gain = 10.0  # constrained requests use the head
    seen, hook = [], drafter.after_forward

    def after(inp, out):
        seen.append((inp.capture, out.hidden))
        hook(inp, out)

    drafter.after_forward = after
    estimates, verified = {}, []
    ngram_draft, on_verified = drafter.policy.ngram_draft, drafter.policy.on_verified

    def spy_draft(req, room):
        ngram, expected = ngram_draft(req, room)
        estimates[req.rid] = expected
        return ngram, expected

    def spy_verified(req, drafted, accepted, step_seconds=0.0):
        if req.grammar is not None and req.spec_head and req.rid in estimates:
            verified.append((req.draft_source, req.ngram_expected, estimates[req.rid]))
        on_verified(req, drafted, accepted, step_seconds)

    drafter.policy.ngram_draft, drafter.policy.on_verified = spy_draft, spy_verified
    for i, (ids, params) in enumerate(_prompts(tok, 2, 3)):
        submit(sched, f"p{i}", ids, params)
    run_all(sched)
    assert seen and any(cap is not None for cap, _ in seen)
    for cap, hidden in seen:
        assert (cap is None) == (hidden is None)
        if cap is not None:
            assert len(hidden[1]) == len(cap)  # one feature tensor per captured layer
    assert not hasattr(sched.runner, "spec_hook")
    assert not {"capture_layers", "captured"} & set(vars(sched.runner.model.model))
    assert verified and all(got == want for _, got, want in verified), verified
