"""Engine: the runtime behind a Python API, with its scheduler and detokenizer processes."""

from __future__ import annotations

import asyncio
import os

import pytest

import loom


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = loom.Engine(tiny_model_dir("llama"), max_total_tokens=4096, dtype="float32")
    yield eng
    eng.shutdown()


def test_generate_single_and_batch_shapes(engine):
    out = engine.generate(
        "hello world", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["finish_reason"] == {
        "type": "length",
        "length": 6,
    }
    for key in ("id", "prompt_tokens", "cached_tokens", "e2e_latency"):
        assert key in meta
    # ignore_eos: at the default temperature the model may sample EOS early (a
    # clean-clone CI run once got [3, 3]); this checks per-request lengths.
    outs = engine.generate(
        ["a b", "c d e"],
        [{"max_new_tokens": 3, "ignore_eos": True}, {"max_new_tokens": 5, "ignore_eos": True}],
    )
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5]
    ids = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert ids["meta_info"]["prompt_tokens"] == 3


def test_n_greater_than_one(engine):
    sampled = {"max_new_tokens": 8, "n": 3, "temperature": 1.0, "ignore_eos": True}
    outs = engine.generate("once upon", sampled)
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    batch = engine.generate(["x", "y"], {"max_new_tokens": 2, "n": 2})
    assert len(batch) == 4


def test_stream_chunks_are_cumulative(engine):
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    final = engine.generate("the quick", params)
    chunks = list(engine.generate("the quick", params, stream=True))
    assert chunks[-1]["text"] == final["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_async_generate_and_stream(engine):
    async def main():
        one = await engine.async_generate("abc", {"max_new_tokens": 4, "ignore_eos": True})
        many = await asyncio.gather(
            *(
                engine.async_generate(f"p{i}", {"max_new_tokens": 4, "ignore_eos": True})
                for i in range(8)
            )
        )
        stream = await engine.async_generate(
            "abc", {"max_new_tokens": 4, "ignore_eos": True}, stream=True
        )
        chunks = [c async for c in stream]
        return one, many, chunks

    one, many, chunks = asyncio.run(main())
    assert one["meta_info"]["completion_tokens"] == 4 and len(many) == 8
    assert chunks[-1]["meta_info"]["completion_tokens"] == 4


def test_logprobs_shape(engine):
    out = engine.generate(
        "hello there",
        {"max_new_tokens": 3, "ignore_eos": True},  # 3 output logprobs whatever is sampled
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    first = meta["input_token_logprobs"][0]
    assert first[0] is None and isinstance(first[1], int) and isinstance(first[2], str)
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == 3
    assert meta["input_top_logprobs"][0] is None and len(meta["output_top_logprobs"][0]) == 2
    zero = engine.generate(
        "hello there", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )
    assert zero["text"] == "" and zero["meta_info"]["finish_reason"]["length"] == 0
    assert zero["meta_info"]["input_token_logprobs"] == [
        [lp, t, None] for lp, t, _ in meta["input_token_logprobs"]
    ]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt": "x", "sampling_params": {"top_p": 2}}, "top_p"),
        ({"prompt": "x", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
        ({"prompt": "", "sampling_params": {}}, "empty"),
        ({"prompt": "x" * 5000, "sampling_params": {}}, "context length"),
        ({"input_ids": [1, 99999], "sampling_params": {}}, "input_ids"),
        ({"prompt": "x", "sampling_params": {"nope": 1}}, "nope"),
    ],
)
def test_bad_input_raises_naming_the_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    assert (
        engine.generate("still alive", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
    )


def test_flush_cache_and_server_info(engine):
    engine.generate("cache me " * 10, {"max_new_tokens": 2})
    info = engine.get_server_info()
    assert info["model_path"] and info["max_total_tokens"] == 4096 and "cache_hit_rate" in info
    assert engine.flush_cache() is True
    assert engine.get_server_info()["cache_size_tokens"] == 0


def test_bad_model_path_fails_fast():
    with pytest.raises(ValueError, match="model_path"):
        loom.Engine("/nonexistent/model")


def test_context_manager_shuts_down(tiny_model_dir):
    with loom.Engine(tiny_model_dir("qwen3"), max_total_tokens=1024) as eng:
        procs = list(eng._procs)
        assert (
            eng.generate("hi", {"max_new_tokens": 2, "ignore_eos": True})["meta_info"][
                "completion_tokens"
            ]
            == 2
        )
    assert all(not p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("hi")


# --------------------------------------------------------------------------- lost requests
class _DroppingSocket:
    """Stands in for the TokenizerManager's send socket and drops the generate requests of
    one rid on purpose (a request lost between the TokenizerManager and the scheduler)."""

    def __init__(self, sock, rid: str):
        from loom.runtime.io_struct import ToScheduler, decoder

        self.sock, self.rid, self.dropped = sock, rid, 0
        self.dec = decoder(ToScheduler)

    def send(self, data, *args, **kwargs):
        from loom.runtime.io_struct import TokenizedGenerateReq

        msg = self.dec.decode(data)
        if isinstance(msg, TokenizedGenerateReq) and msg.rid == self.rid:
            self.dropped += 1
            return None
        return self.sock.send(data, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def _run(engine, coro, timeout: float = 120):
    return asyncio.run_coroutine_threadsafe(coro, engine._loop).result(timeout)


def test_a_lost_request_fails_instead_of_waiting_forever(engine):
    """The watchdog's probe lists the scheduler's rids: a request it does not hold, with no
    final output, fails with a clear error (streamed or not) and the engine keeps serving."""
    tm = engine.tokenizer_manager
    real = tm.send_sock
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    try:
        tm.send_sock = _DroppingSocket(real, "lost-plain")
        with pytest.raises(RuntimeError, match="'lost-plain' was lost"):
            _run(engine, _collect(engine, "lost-plain", params, stream=False))
        tm.send_sock = _DroppingSocket(real, "lost-stream")
        with pytest.raises(RuntimeError, match="'lost-stream' was lost"):
            _run(engine, _collect(engine, "lost-stream", params, stream=True))
    finally:
        tm.send_sock = real
    assert tm.lost_requests == 2 and not tm.rid_to_state
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert out["meta_info"]["completion_tokens"] == 3


async def _collect(engine, rid: str, params: dict, stream: bool):
    from loom.runtime.io_struct import GenerateReqInput

    tm = engine.tokenizer_manager
    obj = GenerateReqInput(input_ids=[5, 6, 7], sampling_params=params, rid=rid)
    if not stream:
        return await tm.generate(obj)
    return [item async for item in tm.generate_stream(obj)]


def test_outputs_arrive_when_the_receive_wakeup_is_lost(engine):
    """A lost fd wake-up of the receive socket (the loop never told that outputs wait) costs
    at most a watchdog tick: the tick drains the socket, so the request still completes."""
    tm = engine.tokenizer_manager
    _run(engine, _async(tm._loop.remove_reader, tm._recv_fd))
    try:
        out = engine.generate(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
        )
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        _run(engine, _async(tm._loop.add_reader, tm._recv_fd, tm._drain))


def test_a_failing_output_hook_costs_no_output(engine):
    tm = engine.tokenizer_manager

    def broken(*_):
        raise KeyError("metrics bug")

    tm.on_output = broken
    try:
        out = engine.generate(
            input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2, "ignore_eos": True}
        )
    finally:
        tm.on_output = None
    assert out["meta_info"]["completion_tokens"] == 2


async def _async(fn, *args):
    return fn(*args)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_streamed_chain_yields_to_the_scheduler(engine):
    """On a CPU device the per-token threads (the detokenizer, the engine's event loop) are
    SCHED_BATCH, so their wake-ups never preempt the forward; the scheduler stays
    SCHED_NORMAL, and so does the caller's own thread."""
    policy = {p.name: os.sched_getscheduler(p.pid) & ~os.SCHED_RESET_ON_FORK for p in engine._procs}
    assert policy.pop("detokenizer") == os.SCHED_BATCH
    assert set(policy.values()) == {os.SCHED_OTHER}, policy  # the scheduler rank(s)
    loop_tid = engine._thread.native_id
    assert os.sched_getscheduler(loop_tid) & ~os.SCHED_RESET_ON_FORK == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    # the chain still delivers every token
    chunks = list(engine.generate("Hi", {"max_new_tokens": 6, "ignore_eos": True}, stream=True))
    assert chunks[-1]["meta_info"]["completion_tokens"] == 6


def test_the_scheduler_froze_its_startup_heap(engine):
    """The scheduler's start-up objects (torch, the model) are out of the collector's sight
    (process.freeze_startup_heap), so no full collection rescans them mid-stream."""
    info = engine.get_server_info()
    assert info["gc_frozen_objects"] > 10_000, info["gc_frozen_objects"]
    assert len(info["gc_collections"]) == 3


def test_shutdown_removes_the_ipc_folder(engine):
    # the last test of this module: it shuts the module's engine down
    folder = os.path.dirname(engine.ipc.scheduler.removeprefix("ipc://"))
    assert os.path.isdir(folder) and os.listdir(folder)  # the live endpoints are there
    engine.shutdown()
    assert not os.path.exists(folder)
