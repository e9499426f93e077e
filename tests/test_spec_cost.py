"""The verify cost table per model (runtime/spec/cost.py): the fit, the file format, where a
scheduler's table comes from (`--speculative-verify-cost`), and that measuring it at start-up
leaves the scheduler as it found it."""

from __future__ import annotations

import json

import pytest

from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs
from loom.runtime.spec import cost
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit


def test_fit_recovers_the_coefficients_of_exact_cells():
    true = (0.3, 0.05, 0.02, 0.04)
    cells = [(b, d, true[0] + true[1] * b + true[2] * d + true[3] * b * d)
             for b in (1, 3, 6) for d in (3, 7)]  # fmt: skip
    assert cost.fit(cells) == pytest.approx(true, abs=1e-9)
    with pytest.raises(ValueError, match="two batch sizes"):
        cost.fit([(1, 3, 0.2), (1, 7, 0.4)])


def test_cost_is_never_negative_and_round_trips_through_its_file(tmp_path):
    c = cost.VerifyCost((-0.5, 0.0, 0.1, 0.0), "test")
    assert c(1, 1) == 0.0 and c(1, 7) == pytest.approx(0.2)
    path = tmp_path / "c.json"
    cost.save(c, path)
    back = cost.VerifyCost.load(path)
    assert back.coef == c.coef and back(4, 7) == c(4, 7)
    (tmp_path / "bad.json").write_text(json.dumps({"coef": [1, 2]}))
    with pytest.raises(ValueError, match="4 coefficients"):
        cost.VerifyCost.load(tmp_path / "bad.json")


def test_the_flag_names_itself_on_a_missing_file():
    with pytest.raises(ValueError, match="speculative_verify_cost"):
        ServerArgs(speculative_algorithm="NGRAM", speculative_verify_cost="/no/such/cost.json")


def test_bundled_model_keeps_the_bundled_fit_and_a_file_overrides_it(tmp_path):
    from loom.runtime.spec import speculator

    sched = make_scheduler(BUNDLED_MODEL_PATH, speculative_algorithm="NGRAM")
    try:
        spec = sched.decode.drafter
        assert spec.cost is None and spec._extra(2, 5) == speculator.extra_cost(2, 5)
    finally:
        sched.close()
    path = tmp_path / "c.json"
    cost.save(cost.VerifyCost((0.1, 0.0, 0.01, 0.0)), path)
    sched = make_scheduler(
        BUNDLED_MODEL_PATH, speculative_algorithm="NGRAM", speculative_verify_cost=str(path)
    )
    try:
        assert sched.decode.drafter._extra(1, 7) == pytest.approx(0.17)
    finally:
        sched.close()


def test_measured_at_start_up_once_then_read_from_the_cache(llama, tmp_path, monkeypatch):
    """`auto` on a model above MEASURE_MIN_WEIGHTS (lowered so the tiny llama counts): the
    first scheduler measures (alternating decode and verify steps) and caches the table, the
    second reads it without measuring; measuring leaves the scheduler idle, its drafter back
    and its cache empty, and the drafts it then verifies keep greedy output exact."""
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(cost, "MEASURE_MIN_WEIGHTS", 0)
    calls = []
    real = cost.measure

    def counted(sched, **kw):
        calls.append(kw)
        return real(sched, **kw)

    monkeypatch.setattr(cost, "measure", counted)
    spec_args = dict(speculative_algorithm="NGRAM")
    sched = make_scheduler(llama, **spec_args)
    try:
        from loom.runtime.spec.speculator import NgramSpeculator

        assert len(calls) == 1
        assert isinstance(sched.decode.drafter, NgramSpeculator)
        assert sched.decode.drafter is sched.output.drafter is sched.prefill.drafter
        measured = sched.decode.drafter.cost
        assert isinstance(measured, cost.VerifyCost) and measured.source == "measured at start-up"
        assert sched.is_idle and sched.tree_cache.total_size() == 0
        assert sched.step() == []  # no output of the measurement's requests is left
        files = list(tmp_path.glob("*.json"))
        assert len(files) == 1 and cost.VerifyCost.load(files[0]).coef == measured.coef
        prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
        submit(sched, "a", prompt, greedy(24))
        got = run_all(sched)["a"].ids
    finally:
        sched.close()
    ref = make_scheduler(llama)
    try:
        submit(ref, "a", prompt, greedy(24))
        assert run_all(ref)["a"].ids == got
    finally:
        ref.close()
    again = make_scheduler(llama, **spec_args)
    try:
        assert len(calls) == 1 and again.decode.drafter.cost.coef == measured.coef
    finally:
        again.close()
