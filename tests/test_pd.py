"""Prefill/decode disaggregation, in process: a prefill and a decode scheduler (each with its
own KV pool and radix cache) paired through the ZMQ transfer backend give the same greedy
tokens as one colocated scheduler, send only the KV the decode side lacks, and free KV on both
sides on abort and timeout."""

from __future__ import annotations

import random
import socket
import time

import pytest

from tests.runtime_helpers import Result, greedy, make_scheduler, run_all, submit


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def _pair(model, page_size=1, timeout=30.0):
    port = _free_port()
    kw = dict(
        page_size=page_size, disaggregation_bootstrap_port=port, disaggregation_timeout=timeout
    )
    p = make_scheduler(model, disaggregation_mode="prefill", **kw)
    d = make_scheduler(model, disaggregation_mode="decode", **kw)
    return p, d, port


def _submit_pd(p, d, port, rid, ids, params, room, to_prefill=True, to_decode=True, **kw):
    boot = ("127.0.0.1", port, room)
    if to_prefill:
        submit(p, rid, ids, params, bootstrap=boot, **kw)
    if to_decode:
        submit(d, rid, ids, params, bootstrap=boot, **kw)


def _run_pair(p, d, deadline: float = 60.0) -> tuple[dict, dict]:
    """Step both until idle; returns (prefill results, decode results)."""
    res_p: dict[str, Result] = {}
    res_d: dict[str, Result] = {}
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        for sched, res in ((p, res_p), (d, res_d)):  # idle ones too, as the loop's 1 s poll
            for rid, r in run_all_once(sched).items():
                acc = res.setdefault(rid, Result())
                acc.ids.extend(r.ids)
                acc.finish_reason = r.finish_reason
                acc.cached_tokens = r.cached_tokens
                acc.output_logprobs.extend(r.output_logprobs)
                acc.input_logprobs = r.input_logprobs or acc.input_logprobs
        if p.is_idle and d.is_idle and not p.pending_outputs and not d.pending_outputs:
            p.check_integrity()
            d.check_integrity()
            return res_p, res_d
        time.sleep(0.0005)
    raise AssertionError("the PD pair did not become idle")


def run_all_once(sched) -> dict[str, Result]:
    """One scheduler step's outputs (token ids, finish reason)."""
    out: dict[str, Result] = {}
    for o in sched.step():
        r = out.setdefault(o.rid, Result())
        r.ids.extend(o.new_ids)
        r.finish_reason = o.finished_reason
        r.cached_tokens = o.cached_tokens
        r.output_logprobs.extend(o.output_token_logprobs or [])
        if o.input_token_logprobs is not None:
            r.input_logprobs = o.input_token_logprobs
    return out


def _kv_clean(sched) -> None:
    """Nothing owned by a request: free + cached == total, and a flush empties the cache."""
    assert sched.is_idle
    ok, msg = sched.flush_cache()
    assert ok, msg
    assert sched.kv.available() == sched.kv.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_pd_greedy_matches_colocated_and_sends_only_missing_kv(model, page_size):
    prompts = _prompts(4, 20, 70, seed=page_size)
    shared = _prompts(1, 60, 60, seed=9)[0]
    follow = [shared + q for q in _prompts(2, 5, 12, seed=11)]
    colo = make_scheduler(model, page_size=page_size)
    for i, ids in enumerate(prompts + follow):
        submit(colo, f"r{i}", ids, greedy(12))
    want = run_all(colo)

    p, d, port = _pair(model, page_size)
    for i, ids in enumerate(prompts):
        _submit_pd(p, d, port, f"r{i}", ids, greedy(12), room=100 + i)
    res_p, res_d = _run_pair(p, d)
    for i in range(len(prompts)):
        assert res_d[f"r{i}"].ids == want[f"r{i}"].ids, i
        assert res_p[f"r{i}"].ids == want[f"r{i}"].ids[:1]  # the prefill side: one token
        assert res_d[f"r{i}"].finish_reason["type"] == "length"
    sent = sum(len(ids) for ids in prompts)
    assert d.stats["disagg_kv_tokens"] == p.stats["disagg_kv_tokens"] == sent
    bytes_per_token = p.stats["disagg_kv_bytes"] / sent
    assert bytes_per_token == p.runner.token_to_kv_pool.bytes_per_token()

    # the follow-ups share a 60-token prefix: the first computes it, the second finds it in
    # the decode side's radix cache, and only its own tail crosses
    for j, ids in enumerate(follow):
        before = p.stats["disagg_kv_tokens"]
        rid = f"r{len(prompts) + j}"
        _submit_pd(p, d, port, rid, ids, greedy(12), room=200 + j)
        _, res_d = _run_pair(p, d)
        assert res_d[rid].ids == want[rid].ids
        moved = p.stats["disagg_kv_tokens"] - before
        cached = shared_cached = res_d[rid].cached_tokens
        assert moved == len(ids) - cached
        if j == 1:
            assert shared_cached >= 60 // page_size * page_size - page_size, shared_cached
            assert moved < len(ids) - 40
    _kv_clean(p)
    _kv_clean(d)


def test_pd_logprobs_and_stop_match_colocated(model):
    ids = _prompts(1, 30, 30, seed=3)[0]
    params = greedy(6, stop_token_ids=[])
    colo = make_scheduler(model)
    submit(colo, "a", ids, params, return_logprob=True, logprob_start_len=0)
    want = run_all(colo)["a"]
    p, d, port = _pair(model)
    _submit_pd(p, d, port, "a", ids, params, room=1, return_logprob=True, logprob_start_len=0)
    _, res_d = _run_pair(p, d)
    got = res_d["a"]
    assert got.ids == want.ids
    assert [t for _, t in got.output_logprobs] == [t for _, t in want.output_logprobs]
    for (a, _), (b, _) in zip(got.output_logprobs, want.output_logprobs):
        assert abs(a - b) < 1e-4
    assert len(got.input_logprobs) == len(want.input_logprobs) == len(ids)


def test_decode_times_out_and_frees_kv_when_prefill_never_sends(model):
    p, d, port = _pair(model, timeout=0.5)
    ids = _prompts(1, 40, 40)[0]
    _submit_pd(p, d, port, "lost", ids, greedy(4), room=7, to_prefill=False)
    _, res_d = _run_pair(p, d)
    reason = res_d["lost"].finish_reason
    assert reason["type"] == "abort" and reason["status_code"] == 504
    assert "bootstrap_room 7" in reason["message"] and "did not arrive" in reason["message"]
    assert d.kv.available() == d.kv.size  # nothing cached: the slots were never written
    # both schedulers idle does not mean the decode side's cancel reached the prefill side
    # (a ZMQ message in flight); until it does, the handshake it cancels is still live there
    end = time.monotonic() + 30
    while 7 in p.disagg.asked and time.monotonic() < end:
        run_all_once(p)
        time.sleep(0.001)
    assert 7 not in p.disagg.asked, "the decode side's cancel never reached the prefill side"
    # a late prefill of room 7 fails (the cancel, or no handshake within the timeout), KV freed
    _submit_pd(p, d, port, "lost", ids, greedy(4), room=7, to_decode=False)
    res_p, _ = _run_pair(p, d)
    assert res_p["lost"].finish_reason["type"] == "abort"
    assert res_p["lost"].finish_reason["status_code"] in (502, 504)
    _kv_clean(p)


def test_prefill_frees_kv_when_decode_never_asks(model):
    p, d, port = _pair(model, timeout=0.5)
    ids = _prompts(1, 40, 40)[0]
    _submit_pd(p, d, port, "orphan", ids, greedy(4), room=8, to_decode=False)
    res_p, _ = _run_pair(p, d)
    reason = res_p["orphan"].finish_reason
    assert reason["status_code"] == 504 and "no decode server asked" in reason["message"]
    _kv_clean(p)


def test_abort_on_either_side_frees_kv_on_both(model):
    p, d, port = _pair(model, timeout=20)
    ids = _prompts(1, 50, 50)[0]
    # decode side aborts while its KV is outstanding; the prefill side holds the computed KV
    _submit_pd(p, d, port, "x", ids, greedy(4), room=21, to_decode=False)
    while not p.disagg.held:
        p.step()
    _submit_pd(p, d, port, "x", ids, greedy(4), room=21, to_prefill=False)
    d.step()  # admitted, handshake sent; abort before the KV arrives
    assert 21 in d.disagg.waiting
    d.abort("x")
    assert d.kv.available() + d.tree_cache.total_size() == d.kv.size
    res_p, res_d = _run_pair(p, d)
    assert res_d["x"].finish_reason["type"] == "abort"
    assert not p.disagg.held  # sent (the handshake won) or cancelled: either way KV released
    # prefill side aborts before computing: the decode side gets an error, frees its KV
    _submit_pd(p, d, port, "y", ids, greedy(4), room=22, to_prefill=False)
    d.step()
    _submit_pd(p, d, port, "y", ids, greedy(4), room=22, to_decode=False)
    p.abort("y")
    res_p, res_d = _run_pair(p, d)
    assert res_p["y"].finish_reason["type"] == "abort"
    reason = res_d["y"].finish_reason
    assert reason["status_code"] == 502 and "aborted" in reason["message"], reason
    _kv_clean(p)
    _kv_clean(d)


def test_decode_refuses_kv_that_does_not_fit_its_pool(model):
    """A prefill server of another model (wrong K/V shape) fails the request with a 502; the
    decode scheduler survives and frees the slots."""
    import torch
    import zmq

    from loom.runtime.disagg.messages import KVHeader, KVRequest
    from loom.runtime.disagg.transfer import ZmqTransfer
    from loom.runtime.io_struct import decoder

    port = _free_port()
    fake = zmq.Context.instance().socket(zmq.PULL)  # stands in for the prefill bootstrap port
    fake.bind(f"tcp://127.0.0.1:{port}")
    d = make_scheduler(model, disaggregation_mode="decode", disaggregation_bootstrap_port=port)
    ids = _prompts(1, 12, 12)[0]
    submit(d, "w", ids, greedy(4), bootstrap=("127.0.0.1", port, 5))
    d.step()
    assert fake.poll(10_000)
    ask = decoder(KVRequest).decode(fake.recv())
    fake.close(linger=0)
    assert (ask.room, ask.prefix_len, ask.num_tokens) == (5, 0, 12)
    k = torch.zeros(1, 12, 1, 3)
    header = KVHeader(room=5, num_tokens=12, dtype=str(k.dtype), first_token=7)
    header.k_shape = header.v_shape = list(k.shape)
    sender = ZmqTransfer("decode", "127.0.0.1", 0)
    sender.send_kv(ask.decode_addr, header, k, k)
    res = {}
    for _ in range(2000):
        res.update(run_all_once(d))
        if "w" in res:
            break
        time.sleep(0.005)
    sender.close()
    reason = res["w"].finish_reason
    assert reason["status_code"] == 502 and "this server's pool needs" in reason["message"]
    _kv_clean(d)
