"""bench_engine_room's step split and its "missed:" lines (benchmarks/bench_engine_room.py),
without llama.cpp: the figures the #19 table's text quotes must come from what was measured."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors import safe_open

from loom.runtime.server_args import BUNDLED_MODEL_PATH
from tests.file_modules import load_file


@pytest.fixture(scope="module")
def room():
    return load_file("benchmarks/bench_engine_room.py", "bench_engine_room")


def test_step_split_counts_the_checkpoint_matmul_weights(room):
    """The weights a decode step's matmuls stream are the checkpoint's projection matrices and
    the LM head (the embedding when tied), counted here from the safetensors file itself; the
    parts of the decode step and of the prefill nest (matmuls + attention <= forward <= step)."""
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(3)]
    split = room.step_split(str(BUNDLED_MODEL_PATH), prompts, tg=4, threads=1)
    with safe_open(str(Path(BUNDLED_MODEL_PATH) / "model.safetensors"), "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    proj = sum(s[0] * s[1] for k, s in shapes.items() if k.endswith("proj.weight") and len(s) == 2)
    head = shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])
    assert split["matmul_params"] == proj + head[0] * head[1]
    assert split["weight_mb"] == pytest.approx(split["matmul_params"] * 4 / 1e6)
    for pre in ("", "prefill_"):
        step = split[f"{pre}step_ms" if pre == "" else "prefill_ms"]
        fwd = split[f"{pre}forward_ms"]
        assert 0 < fwd <= step
        assert 0 < split[f"{pre}matmul_ms"] and 0 <= split[f"{pre}attention_ms"]
        assert split[f"{pre}other_ms"] == pytest.approx(
            fwd - split[f"{pre}matmul_ms"] - split[f"{pre}attention_ms"]
        )


def _row(b: int, decode: float, prefill: float) -> dict:
    """A measured row where loom's median decode / prefill are these multiples of llama.cpp's
    (llama.cpp: 1000 decode tok/s, 4000 prefill tok/s; 3 rounds)."""
    split = {
        "step_ms": 2.0, "forward_ms": 1.5, "attention_ms": 0.2, "matmul_ms": 1.0,
        "other_ms": 0.3, "prefill_ms": 40.0, "prefill_forward_ms": 38.0,
        "prefill_attention_ms": 3.0, "prefill_matmul_ms": 30.0, "prefill_other_ms": 5.0,
        "matmul_params": 1_000_000, "weight_mb": 4.0,
    }  # fmt: skip
    return {
        "B": b, "pp": 128, "tg": 32, "load": 0.5, "seconds": 1.0, "split": split,
        "cpu_paged_decode": [1000 * decode] * 3, "llama_decode": [1000.0] * 3,
        "cpu_paged_prefill": [4000 * prefill] * 3, "llama_prefill": [4000.0] * 3,
    }  # fmt: skip


def test_misses_name_each_missed_target_with_its_figures(room):
    """Batch 1 decode at 0.5x (< 0.6x): llama.cpp's step is 1 / 1000 tok/s = 1.00 ms, the
    target needs <= 1.67 ms, loom's is 2.00 ms wall; its matmuls stream 4 MB in 1.0 ms = 4.0
    GB/s. Prefill at 0.8x: 128 tokens x 2 x 1M parameters = 0.256 GFLOP in 30 ms = 8.5
    GFLOP/s; llama.cpp's 32 ms = 8.0."""
    lines = room.misses(_row(1, 0.5, 0.8))
    assert len(lines) == 2
    dec, pre = lines
    assert dec.startswith("B=1 decode 0.50x < 0.6x")
    for figure in (
        "2.00 ms wall", "llama.cpp 1.00", "<= 1.67", "at 4.0 GB/s", "step at 4.0 GB/s",
        "0.00 GFLOP at 2.0 GFLOP/s", "whole step at 2.0 (",
    ):  # fmt: skip
        assert figure in dec, (figure, dec)
    assert pre.startswith("B=1 prefill 0.80x < 1.0x")
    for figure in ("128 tokens in 40 ms", "llama.cpp 32)", "0.3 GFLOP at 8.5", "prefill at 8.0"):
        assert figure in pre, (figure, pre)


def test_misses_only_where_a_target_is_set(room):
    """No decode target at batch 8, 1.2x at 32 and 64; prefill >= 1.0x everywhere."""
    assert room.misses(_row(8, 0.5, 1.0)) == []
    assert room.misses(_row(32, 1.2, 1.5)) == []
    assert [m.split(":")[0] for m in room.misses(_row(64, 1.19, 0.99))] == [
        "B=64 decode 1.19x < 1.2x",
        "B=64 prefill 0.99x < 1.0x",
    ]
    row = _row(1, 0.1, 0.1)
    del row["cpu_paged_decode"], row["cpu_paged_prefill"]  # the default side not run
    assert room.misses(row) == []


def test_the_stall_guard_passes_a_stream_and_fails_a_stalled_one(room):
    """bench_offline's guard around a timed stream: every item through, in order, and a
    TimeoutError (not a hang) when the stream stops; both forms (the main thread's interval
    timer, which adds no thread hop per token, and the pump thread used elsewhere)."""
    import signal
    import sys
    import time

    offline = sys.modules["bench_offline"]
    before = signal.getsignal(signal.SIGALRM)

    def stalls():
        yield 1
        time.sleep(30)
        yield 2

    for guard in (offline._alarm_guard, offline._thread_guard):
        assert list(guard(iter([1, 2, 3]), 5.0)) == [1, 2, 3]
        got = []
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="sent nothing"):
            for item in guard(stalls(), 0.3):
                got.append(item)
        assert got == [1] and time.monotonic() - started < 20
    assert signal.getsignal(signal.SIGALRM) is before  # the timer's handler is put back


def test_the_faster_fa_setting_is_quoted_and_both_are_shown(room):
    """The issue's own run: -fa auto faster at decode (349 vs 304 tok/s), -fa off at prefill:
    each measure quotes its faster setting, and the table shows both."""
    row = _row(8, 1.0, 1.0)
    row.update(llama_decode_fa_off=[304.0, 300.0, 310.0], llama_decode_fa_auto=[349.0, 340.0, 355.0],
               llama_prefill_fa_off=[900.0] * 3, llama_prefill_fa_auto=[850.0] * 3)  # fmt: skip
    room.quote_faster_fa(row)
    assert row["llama_decode_fa"] == "auto" and row["llama_decode"] == [349.0, 340.0, 355.0]
    assert row["llama_prefill_fa"] == "off" and row["llama_prefill"] == [900.0] * 3
    assert room._fa_both(row, "decode") == "-fa off 304 / -fa auto 349*"
    table = room.markdown([{"model": "bundled", "pp": 128, "tg": 32, "kv": "auto", "threads": 1,
                            "rows": [row]}])  # fmt: skip
    assert "-fa off 304 / -fa auto 349*" in table and "(-fa off)" not in table


def test_alternate_turns_the_order_every_round():
    """No side always runs first: the order rotates each round, and each side's values stay
    in round order."""
    common = load_file("benchmarks/common.py", "bench_common")
    calls: list[str] = []

    def side(name):
        def run():
            calls.append(name)
            return len(calls)

        return run

    out = common.alternate({"loom": side("loom"), "peer": side("peer")}, 4)
    assert calls == ["loom", "peer", "peer", "loom", "loom", "peer", "peer", "loom"]
    assert out == {"loom": [1, 4, 5, 8], "peer": [2, 3, 6, 7]}
    calls.clear()
    common.alternate({k: side(k) for k in "abc"}, 3)
    assert calls == list("abcbcacab")
