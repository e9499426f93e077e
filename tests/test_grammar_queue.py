"""GrammarQueue timing rules with a compile that can be made slow: the timeout counts from the
compile's start, one spec compiles once however many requests ask for it, and a spec that timed
out fails fast afterwards instead of starting another runaway compile."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from loom.grammar.backend import GrammarBackend
from loom.grammar.base import GrammarError
from loom.runtime.scheduler.grammar_queue import GrammarQueue
from tests.conftest_grammar import byte_bpe


def _req(rid: str, kind: str, spec: str):
    return SimpleNamespace(
        rid=rid, grammar=None, sampling_params=SimpleNamespace(grammar_spec=(kind, spec))
    )


def _drain(queue: GrammarQueue, limit: float = 10.0):
    ready, failed = {}, {}
    t0 = time.monotonic()
    while len(queue) and time.monotonic() - t0 < limit:
        r, f = queue.poll()
        ready.update({x.rid: x for x in r})
        failed.update({x.rid: msg for x, msg in f})
        time.sleep(0.01)
    return ready, failed


def test_timeout_counts_from_compile_start_and_timed_out_specs_fail_fast():
    tok = byte_bpe()
    queue = GrammarQueue(tok, len(tok), {tok.eos_token_id}, timeout=0.4)
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, max_workers=1)
    queue._backend = backend
    calls, release = [], threading.Event()
    real = backend._compile

    def compile_(kind, spec):
        calls.append(spec)
        if spec == "slow":
            release.wait(1.5)  # a runaway compile: far past the 0.4 s timeout
            return real(kind, "[a-z]+")
        return real(kind, spec)

    backend._compile = compile_
    queue.add(_req("a", "regex", "slow"), "regex", "slow")
    queue.add(_req("b", "regex", "[0-9]+"), "regex", "[0-9]+")  # waits for the one worker
    queue.add(_req("c", "regex", "[0-9]+"), "regex", "[0-9]+")  # shares b's compile
    ready, failed = _drain(queue)
    assert "longer than 0.4 s" in failed["a"]
    # b and c waited ~1.5 s for the worker (more than the timeout) and still compiled
    assert set(ready) == {"b", "c"} and ready["b"].grammar is not ready["c"].grammar
    assert calls == ["slow", "[0-9]+"]
    # after a timeout the spec fails at once (no new compile) until a compile succeeds
    release.set()
    queue.add(_req("d", "regex", "bad["), "regex", "bad[")
    ready, failed = _drain(queue)
    assert "d" in failed and calls.count("bad[") == 1
    backend.shutdown()


def test_given_up_spec_fails_without_a_second_compile():
    tok = byte_bpe()
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, max_workers=1)
    hold = threading.Event()
    real, calls = backend._compile, []

    def compile_(kind, spec):
        calls.append(spec)
        hold.wait(5)
        return real(kind, spec)

    backend._compile = compile_
    first = backend.compile_async("regex", "[a-c]+")
    time.sleep(0.1)
    backend.give_up("regex", "[a-c]+", "compiling took longer than 1 s")
    # a new request while the runaway compile still runs fails at once, starting nothing
    second = backend.compile_async("regex", "[a-c]+")
    assert second.done() and "longer than 1 s" in str(second.exception())
    hold.set()
    first.result(5)  # the runaway compile finishes: its result replaces the entry
    assert backend.compile_async("regex", "[a-c]+").result(1) is not None
    assert calls == ["[a-c]+"]
    backend.shutdown()


def test_a_short_budget_waits_for_its_closer_and_a_long_one_starts_without(monkeypatch):
    """Closing by default ("auto"): a request whose closer is slow starts after CLOSER_WAIT
    and gets the closer attached late, unless its budget is short enough to be spent before
    that (max_new_tokens <= SHORT_BUDGET): then it waits, so it closes within its budget."""
    from concurrent.futures import Future

    from loom.runtime.scheduler import grammar_queue

    monkeypatch.setattr(grammar_queue, "CLOSER_WAIT", 0.1)
    tok = byte_bpe()
    queue = GrammarQueue(tok, len(tok), {tok.eos_token_id}, timeout=5.0)
    backend = GrammarBackend(tok, len(tok), {tok.eos_token_id}, max_workers=1)
    queue._backend = backend
    slow: Future = Future()
    backend.closer_async = lambda kind, spec: slow

    def req(rid, budget):
        r = _req(rid, "regex", "[a-z]+")
        r.output_ids, r.finished = [], False
        r.sampling_params.closes_within_budget = True
        r.sampling_params.close_within_budget = "auto"
        r.sampling_params.max_new_tokens = budget
        return r

    queue.add(req("short", grammar_queue.SHORT_BUDGET), "regex", "[a-z]+")
    queue.add(req("long", grammar_queue.SHORT_BUDGET + 1), "regex", "[a-z]+")
    started: dict = {}
    t0 = time.monotonic()
    while len(started) < 1 and time.monotonic() - t0 < 3:
        started.update({r.rid: r for r in queue.poll()[0]})
        time.sleep(0.01)
    time.sleep(0.3)  # three times CLOSER_WAIT: "short" must still be waiting
    started.update({r.rid: r for r in queue.poll()[0]})
    assert set(started) == {"long"} and [r.rid for r, _ in queue.late] == ["long"]
    from loom.grammar.closing import Closer, closing_regex

    slow.set_result(Closer(closing_regex("regex", "[a-z]+", backend.json_options), backend.vocab))
    ready, failed = _drain(queue)
    assert set(ready) == {"short"} and not failed
    assert type(ready["short"].grammar).__name__ == "ClosingGrammar"


def test_requests_before_the_build_wait_for_it_then_compile():
    """Without --grammar-backend-eager the backend is built by the first constrained request:
    requests that arrive while it builds wait (no compile yet) and compile once it is done;
    a build that fails fails each of them with its error, and one slower than a queue wait
    (QUEUE_WAIT_FACTOR timeouts) fails them without waiting forever."""
    tok = byte_bpe()
    queue = GrammarQueue(tok, len(tok), {tok.eos_token_id}, timeout=5.0)
    assert not queue.ready and queue._building is None  # nothing built before a request
    gate = threading.Event()
    real = queue._build

    def slow_build(warm=False):
        gate.wait(5.0)
        return real(warm)

    queue._build = slow_build
    queue.add(_req("a", "regex", "[0-9]+"), "regex", "[0-9]+")
    queue.add(_req("b", "regex", "[a-z]+"), "regex", "[a-z]+")
    assert queue._building is not None and [f for _, f, _ in queue.pending] == [None, None]
    assert queue.poll() == ([], [])  # still building: both keep waiting
    gate.set()
    ready, failed = _drain(queue)
    assert failed == {} and set(ready) == {"a", "b"}
    digit, letter = tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("x")
    ready["b"].grammar.accept_token(letter)  # each request got its own spec's grammar
    ready["a"].grammar.accept_token(digit)
    with pytest.raises(GrammarError):
        ready["a"].grammar.accept_token(letter)
    assert queue.ready
    queue.close()

    broken = GrammarQueue(tok, len(tok), {tok.eos_token_id}, timeout=5.0)

    def fail(warm=False):
        raise RuntimeError("no tables")

    broken._build = fail
    broken.add(_req("c", "regex", "[0-9]+"), "regex", "[0-9]+")
    ready, failed = _drain(broken)
    assert ready == {} and failed == {"c": "regex: the grammar backend failed to build: no tables"}
    assert broken.add(_req("c2", "regex", "[0-9]+"), "regex", "[0-9]+") == (
        "regex: the grammar backend failed to build: no tables"
    )  # later requests: at once

    stuck = GrammarQueue(tok, len(tok), {tok.eos_token_id}, timeout=0.05)
    hold = threading.Event()
    stuck._build = lambda warm=False: hold.wait(5.0)
    stuck.add(_req("d", "regex", "[0-9]+"), "regex", "[0-9]+")
    ready, failed = _drain(stuck, limit=3.0)
    hold.set()
    assert ready == {} and failed == {
        "d": "regex: building the grammar backend took longer than 0.2 s"
    }
