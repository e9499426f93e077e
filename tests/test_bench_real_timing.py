"""bench_real's loom timing from one streamed run (benchmarks/bench_real.py, `LoomSide.point`):
the decode window counts B * (tg - 1) tokens only when the batch decoded in lockstep, which
`check_decode_window` reads from the scheduler's step counters and refuses otherwise (and
when a prompt was found cached: then no prefill was timed)."""

from __future__ import annotations

import math

import pytest

from loom.runtime.server_args import BUNDLED_MODEL_PATH
from tests.file_modules import load_file


@pytest.fixture(scope="module")
def bench():
    return load_file("benchmarks/bench_real.py", "bench_real")


def _meta(first, last, batch):
    return {"first_decode_step": first, "last_decode_step": last, "decode_batch_max": batch}


def test_the_window_check_refuses_a_batch_that_did_not_decode_in_lockstep(bench):
    bench.check_decode_window([_meta(3, 9, 2), _meta(3, 9, 2)], 2, 8)  # 7 steps of both
    for metas, tg in (
        ([_meta(3, 9, 2), _meta(4, 10, 2)], 8),  # one request prefilled while the other decoded
        ([_meta(3, 9, 2), _meta(3, 9, 1)], 8),  # a step without the whole batch
        ([_meta(3, 9, 2), _meta(3, 9, 2)], 9),  # fewer decode steps than tg - 1
        ([_meta(None, None, 0), _meta(3, 9, 2)], 8),  # a request never decoded
    ):
        with pytest.raises(SystemExit, match="lockstep"):
            bench.check_decode_window(metas, 2, tg)
    cached = [_meta(3, 9, 2), {**_meta(3, 9, 2), "cached_tokens": 64}]  # no prefill to time
    with pytest.raises(SystemExit, match="cached"):
        bench.check_decode_window(cached, 2, 8)


def test_a_streamed_run_of_the_engine_passes_it(bench):
    # tg 24: the bundled model's steps take about a millisecond, and with tg 6 a client thread
    # starved for the 5 decode steps (seen once at load 4.6) got every token with the first
    # ones, an empty window that point() refuses
    side = bench.LoomSide(str(BUNDLED_MODEL_PATH), 1, 3, None, 3 * (8 + 24) + 64)
    try:
        prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(3)]
        prefill, decode = side.point(prompts, 24)  # raises unless 23 lockstep steps of 3
        assert math.isfinite(prefill) and prefill > 0
        assert math.isfinite(decode) and decode > 0
    finally:
        side.close()
