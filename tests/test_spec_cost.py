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


def test_cell_table_interpolates_is_monotone_in_depth_and_round_trips(tmp_path):
    """A measured table is read cell by cell (a quantized target's per-row cost, which no
    bilinear fit through other batch sizes reproduces), linear between cells and batch sizes,
    0 at no drafts, never cheaper for a deeper draft (a noisy cell is pooled with its
    neighbour), the last slope carried on past the deepest cell and the largest batch."""
    cells = [(1, 1, 0.25), (1, 3, 0.5), (1, 5, 0.4), (1, 7, 1.9), (4, 1, 1.0), (4, 7, 3.0)]
    c = cost.VerifyCost((9.0, 9.0, 9.0, 9.0), "test", cells)  # the fit is not read
    assert c(1, 0) == 0.0 and c(1, 1) == pytest.approx(0.25)
    assert c(1, 2) == pytest.approx(0.35)  # halfway to the pooled 3/5 cells (0.45)
    assert c(1, 3) == c(1, 5) == pytest.approx(0.45)  # 0.5 then 0.4: pooled
    assert c(1, 6) == pytest.approx((0.45 + 1.9) / 2)
    assert c(1, 8) == pytest.approx(1.9 + (1.9 - 0.45) / 2)  # the last slope past 7
    assert [c(1, d) for d in range(8)] == sorted(c(1, d) for d in range(8))
    assert c(2, 1) == pytest.approx(0.25 + (1.0 - 0.25) / 3)  # linear in the batch size
    assert c(7, 1) == pytest.approx(1.0 + (1.0 - 0.25) / 3 * 3)  # the last two rows' slope
    path = tmp_path / "t.json"
    cost.save(c, path)
    back = cost.VerifyCost.load(path)
    assert back.table.cells == c.table.cells and back(3, 4) == c(3, 4)
    with pytest.raises(ValueError, match="drafts >= 1"):
        cost.VerifyCost((0, 0, 0, 0), "t", [(1, 0, 0.1)])


def test_head_gate_cuts_where_the_tables_cost_stops_paying():
    """The head gate's chain length is the one whose expected tokens less the verify's cost
    at that length (and the head's levels) is largest: with a verify whose first rows are
    cheap and later ones dear, a chain accepting 0.5 then 0.3 per position stops at 2; a
    table whose every draft costs more than it earns declines (until a probe)."""
    from loom.runtime.spec.head_policy import HeadGate

    gate = HeadGate(5, per_level=0.0)
    gate.rates = [0.5, 0.6, 0.6, 0.6, 0.6]  # chances 0.5, 0.3, 0.18, 0.108, 0.065
    gate.set_cost(cost.VerifyCost((0, 0, 0, 0), "t", [(1, 1, 0.1), (1, 2, 0.2), (1, 5, 1.5)]))
    assert gate._cut(1, 5)[0] == 2 and gate.enabled(1, 5)
    assert gate.levels(5) == 2
    gate.set_cost(cost.VerifyCost((0, 0, 0, 0), "t", [(1, 1, 0.6), (1, 5, 3.0)]))
    assert gate._cut(1, 5)[1] < 0
    # declines in a row probe at the 1st, 17th, 49th, 113th ... (the gap doubling from
    # PROBE_EVERY to PROBE_MAX); a length that pays again resets the gap
    from loom.runtime.spec.head_policy import PROBE_EVERY, PROBE_MAX

    probes = []
    while gate.declined < 300:
        if gate.enabled(1, 5) and gate.probe:
            probes.append(gate.declined)
            assert gate.enabled(1, 5)  # the probe's second step
    assert probes == [1, 17, 49, 113, 241], probes
    assert gate.probe_gap == PROBE_MAX
    gate.set_cost(cost.VerifyCost((0, 0, 0, 0), "t", [(1, 1, 0.1), (1, 5, 1.5)]))
    assert gate.enabled(1, 5) and gate.probe_gap == PROBE_EVERY
    # the head's own levels count: free verifies, a head level dearer than any chance
    gate.set_cost(cost.VerifyCost((0, 0, 0, 0), "t", [(1, 1, 0.0), (1, 5, 0.0)]))
    gate.per_level = 0.6
    assert gate._cut(1, 5)[1] < 0
    # the head's cost per level follows its measured rounds: a round of 4 levels (+ the
    # catch-up) taking 2 decode steps of a batch-1 verify of 4 drafts costing 0.5 extra
    gate = HeadGate(5, per_level=0.05)
    gate.set_cost(cost.VerifyCost((0, 0, 0, 0), "t", [(1, 4, 0.5), (1, 5, 0.6)]))
    for _ in range(60):
        gate.observe(0.02, 4, 0.015, 1, 4)  # a decode step: 0.015 / 1.5 = 0.01 s
    assert gate.per_level == pytest.approx(0.02 / 5 / 0.01, rel=1e-3)
    gate.per_level, gate.pinned = 0.0, True
    gate.observe(0.02, 4, 0.015, 1, 4)
    assert gate.per_level == 0.0


def test_a_quantized_model_counts_the_weights_its_step_reads(llama):
    """`auto` measures a table for models whose decode step reads MEASURE_MIN_WEIGHTS or
    more: a quantized model's parameters hold no float storage (their blocks hang off
    `.quant`), and counting numel() made SmolLM2's Q4_1 file (134M weights) read as 1.08M,
    priced by the bundled model's fit. Kept quantized, the tiny llama counts every matmul
    weight its float twin does."""
    from loom.runtime.spec.head_policy import matmul_numel

    plain = make_scheduler(llama)
    try:
        weights = matmul_numel([plain.runner.model])
    finally:
        plain.close()
    quant = make_scheduler(llama, quantization="int4")
    try:
        held = [p for p in quant.runner.model.parameters() if getattr(p, "quant", None)]
        assert held and all(p.numel() == 0 for p in held)  # the float storage is released
        assert cost._step_weights(quant.runner) >= weights
    finally:
        quant.close()


def test_the_cache_key_follows_the_kernels(tmp_path, monkeypatch):
    """A table measured with other C kernels (a verify pass's prefetch) prices other steps:
    changing a kernel source gives another cache file."""
    from loom.runtime import native

    src = tmp_path / "cpu"
    src.mkdir()
    (src / "forward.c").write_text("int a;\n")
    (src / "blocks.h").write_text("#define B 1\n")
    monkeypatch.setattr(native, "source_dir", lambda: src)
    args = ServerArgs(model_path=BUNDLED_MODEL_PATH, speculative_algorithm="NGRAM")
    first = cost.cache_path(args)
    assert cost.cache_path(args) == first
    (src / "blocks.h").write_text("#define B 2\n")
    second = cost.cache_path(args)
    assert second != first and second.parent == first.parent


def test_a_long_context_row_prices_drafts_by_the_batchs_context(tmp_path):
    """A verify's extra rows attend over the whole context: the table's long-context row
    (batch 1 at LONG_CONTEXT tokens) adds its difference from the short row, per token, past
    the short row's length; no context (a head gate) or a short one reads the table alone.
    The n-gram speculator passes the batch's mean tokens a request, so a draft that pays
    after a short prompt is declined after a long one."""
    from loom.runtime.req import Req
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.spec.ngram import NgramState
    from loom.runtime.spec.speculator import NgramSpeculator

    short, long_ = cost.SHORT_CONTEXT, cost.LONG_CONTEXT
    c = cost.VerifyCost((0, 0, 0, 0), "t", [(1, 1, 0.1), (1, 7, 1.0), (2, 1, 0.3)],
                        [(1, 1, 0.5), (1, 7, 1.2)])  # fmt: skip
    assert c(1, 1) == c(1, 1, None) == c(1, 1, short / 2) == pytest.approx(0.1)
    assert c(1, 1, long_) == pytest.approx(0.5)
    assert c(1, 1, (short + long_) / 2) == pytest.approx(0.3)
    assert c(1, 1, 2 * long_ - short) == pytest.approx(0.9)  # linear past the long row
    assert c(2, 1, long_) == pytest.approx(0.3 + 0.4)  # the batch-1 growth on the batch's cell
    assert c(1, 7, long_) == pytest.approx(1.2)
    path = tmp_path / "t.json"
    cost.save(c, path)
    back = cost.VerifyCost.load(path)
    assert back.long.cells == c.long.cells and back(1, 4, 700) == c(1, 4, 700)

    spec = NgramSpeculator(ServerArgs(speculative_algorithm="NGRAM"), None, 384, [2])
    spec.set_verify_cost(c)

    def verifies(n_tokens: int) -> bool:
        req = Req("r", [5] * n_tokens, make_sampling_params({}), seed=0)
        req.spec_state = NgramState(7)
        req.spec_state.gains = [0.3]
        req.draft_forced = 0
        return spec.worth_verifying([req], [[9]])

    assert verifies(short) and not verifies(long_)  # 0.3 accepted against 0.1, then 0.5
