"""The speculative benchmarks' protocol (benchmarks/spec_protocol.py): the warm-up leakage
check, the token-by-token comparison, distinct timed prompts, and bench_spec's warm-ups on the
bundled model (issue 33: the old warm-up jobs produced the timed answers)."""

from __future__ import annotations

import random

import pytest

from tests.file_modules import benchmark_module, load_file


@pytest.fixture(scope="module")
def proto():
    return load_file("benchmarks/spec_protocol.py", "spec_protocol")


def test_leak_share_counts_timed_ngrams_seen_in_warmups(proto):
    rng = random.Random(0)
    warm = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    timed = [[rng.randrange(50) for _ in range(30)] for _ in range(4)]
    timed[1][5:15] = warm[2][10:20]  # 10 shared tokens: 3 shared 8-grams at least
    share, hits, total = proto.leak_share(timed, warm)
    seen = {tuple(w[i : i + 8]) for w in warm for i in range(len(w) - 7)}
    want = sum(tuple(t[i : i + 8]) in seen for t in timed for i in range(len(t) - 7))
    assert (hits, total) == (want, 4 * 23) and hits >= 3
    assert share == pytest.approx(want / 92)
    assert proto.leak_share([[1, 2, 3]], warm) == (0.0, 0, 0)  # shorter than an 8-gram


def test_check_leak_fails_above_the_limit(proto):
    warm = [list(range(100))]
    assert "0.0%" in proto.check_leak([list(range(200, 260))], warm, "x")
    with pytest.raises(SystemExit, match="FAILED"):
        proto.check_leak([list(range(10, 40))], warm, "x")


def test_compare_outputs_names_the_first_difference(proto):
    off = {"a": [1, 2, 3, 4], "b": [5, 6]}
    proto.compare_outputs(off, {"a": [1, 2, 3, 4], "b": [5, 6]}, "row")
    with pytest.raises(SystemExit, match="request a differs .* at output token 2"):
        proto.compare_outputs(off, {"a": [1, 2, 9, 4], "b": [5, 6]}, "row")
    with pytest.raises(SystemExit, match="request b differs .* at output token 2"):
        proto.compare_outputs(off, {"a": [1, 2, 3, 4], "b": [5, 6, 7]}, "row")
    with pytest.raises(SystemExit, match="different requests"):
        proto.compare_outputs(off, {"a": [1, 2, 3, 4]}, "row")


def test_check_distinct(proto):
    proto.check_distinct(["x", "y"])
    with pytest.raises(SystemExit, match="1 prompt"):
        proto.check_distinct(["x", "y", "x"])


@pytest.fixture(scope="module")
def bench_spec():
    with benchmark_module("bench_spec") as mod:  # bench_spec imports spec_protocol by name
        yield mod


def _outputs(proto, sched, jobs):
    tok = sched.tokenizer
    outs = proto.run_scheduler(sched, [(tok.encode(p), q) for p, q in jobs], len(jobs))[0]
    return list(outs.values())


def test_bench_spec_warmups_do_not_teach_the_timed_answers(proto, bench_spec):
    """The bundled model's timed chat / JSON outputs against bench_spec's warm-up outputs are
    under the limit, while the old protocol's warm-up job ("a kind bear", the last of the chat
    list) produces the timed stories' 8-grams far above it."""
    sched = bench_spec.make(False)
    try:
        tok = sched.tokenizer
        loads = bench_spec.workloads(tok)
        for name in ("chat", "json"):
            timed = _outputs(proto, sched, loads[name][:4])
            warm = _outputs(proto, sched, bench_spec.warmups(tok, name))
            assert proto.leak_share(timed, warm)[0] <= proto.LEAK_MAX, name
        stories = [j for j in loads["chat"] if "short story" in j[0]]
        old_warm = [j for j in stories if "kind bear" in j[0]]
        timed = _outputs(proto, sched, [j for j in stories if j not in old_warm])
        with pytest.raises(SystemExit, match="FAILED"):
            proto.check_leak(timed, _outputs(proto, sched, old_warm), "old warm-up")
    finally:
        sched.close()


def test_run_scheduler_outputs_match_with_speculation(proto, bench_spec):
    """run_scheduler's outputs (jump-forward rewinds applied) are the same tokens with NGRAM
    drafting on as off, on JSON jobs where forced text arrives as drafts or jumps."""
    off, on = bench_spec.make(False), bench_spec.make(True)
    try:
        tok = off.tokenizer
        jobs = [(tok.encode(p), q) for p, q in bench_spec.workloads(tok)["json"][:4]]
        a = proto.run_scheduler(off, jobs, 1)[0]
        b = proto.run_scheduler(on, jobs, 1)[0]
        assert all(len(v) > 5 for v in a.values())
        proto.compare_outputs(a, b, "json")
        assert on.get_state()["spec_verify_ct"] > 0  # drafts were verified
    finally:
        off.close()
        on.close()


def test_specbench_sides_take_turns_per_category():
    """bench_specbench times the two sides category by category, the first side alternating
    by category and by round (session 18 timed one whole side, then the other, and one
    round's drift read as a 1.80x ratio where the CPU time read 1.27x)."""
    with benchmark_module("bench_specbench") as bench:
        groups = [(c, [c]) for c in ("a", "b", "c", "d")]
        for rnd in (0, 1):
            order = list(bench.interleaved(groups, rnd))
            # each category: both sides, one right after the other, on the same jobs
            assert [(c, g) for _, c, g in order[::2]] == groups
            assert [(c, g) for _, c, g in order[1::2]] == groups
            assert all({order[i][0], order[i + 1][0]} == {"on", "off"} for i in range(0, 8, 2))
            firsts = [side for side, _, _ in order[::2]]
            assert firsts.count("on") == firsts.count("off") == 2
            assert firsts[0] == ("off" if rnd == 0 else "on")
        # a round later, every category's first side is the other one
        r0 = [s for s, _, _ in bench.interleaved(groups, 0)]
        r1 = [s for s, _, _ in bench.interleaved(groups, 1)]
        assert all(a != b for a, b in zip(r0, r1))
