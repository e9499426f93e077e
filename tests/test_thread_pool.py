"""The decode path's thread pool (kernels/cpu/pool.c loom_par_for): the quantized decode
matmuls (quant_bi.c's 16-row-lane passes, quant.c's f32 GEMV groups) and the forward's
per-token attention run their chunks on whichever of the caller and the pool's helpers claims
them. Each output element is computed inside one chunk, so results are the same bits for any
thread count, with the pool or with OpenMP (loom_pool = 0); checked here on the kernels (every
block type, ragged row counts, 1..8 tokens, accumulating into a strided output with a bias) and
on a real model's decode steps, and in a process forked after the pool started.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp

import pytest
import torch

from loom.runtime.forward_batch import ForwardMode
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import BLOCKS
from tests.test_quant_kernels import random_blocks

pytest.importorskip("gguf")


@contextlib.contextmanager
def _threads(n: int, pool: int, lib):
    """pool 1: pool.c, 0: OpenMP, 2: pool.c with loom_pool_tail (the last chunks in quarters)"""
    knob = ctypes.c_int.in_dll(lib, "loom_pool")
    tail = ctypes.c_int.in_dll(lib, "loom_pool_tail")
    prev = torch.get_num_threads(), knob.value, tail.value
    torch.set_num_threads(n)
    knob.value, tail.value = min(pool, 1), int(pool == 2)
    try:
        yield
    finally:
        torch.set_num_threads(prev[0])
        knob.value, tail.value = prev[1], prev[2]


def _matmul(lib, qt, x, bias, out, t: int, mode: str, threads: int) -> torch.Tensor:
    rows, cols = qt.shape
    y = out[:t].clone()
    rc = lib.loom_q_matmul(
        quant_ops.QTYPES[qt.qtype], quant_ops.MODES[mode], qt.data.data_ptr(), rows, cols,
        qt.row_bytes, x.data_ptr(), t, cols, bias.data_ptr(), y[:, 1:].data_ptr(), y.stride(0),
        1, threads,
    )  # fmt: skip
    assert rc == 0
    return y


@pytest.mark.parametrize("qtype", list(BLOCKS))
@pytest.mark.parametrize("mode", ["auto", "f32"])
def test_decode_matmuls_same_bits_on_any_thread_count(qtype, mode):
    """1..8 token rows ("auto": the lane kernel for Q8_0 / Q4_x / Q5_x, the f32 GEMV for Q4_K /
    Q6_K; "f32": the f32 GEMV for all) on 1, 2 and 3 threads, pool (equal chunks and the last
    ones in quarters) and OpenMP: the output equals
    the one-thread output bit for bit, rows past the matrix untouched. Row counts: one 16-row
    pass or 4-row group (partly masked), a few, and enough for several chunks a thread."""
    lib = quant_ops.load()
    if lib is None:
        pytest.skip("no C compiler")
    for rows, cols in ((5, 256), (45, 512), (300, 256)):
        qt = random_blocks(qtype, rows, cols, rows)
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(8, cols, generator=g)
        bias = torch.randn(rows, generator=g)
        base = torch.randn(8, rows + 3, generator=g)
        for t in range(1, 9):
            want = _matmul(lib, qt, x, bias, base, t, mode, 1)
            # accumulated into the strided output with the bias
            assert not torch.equal(want, base[:t])
            for threads in (2, 3):
                for pool in (1, 0, 2):
                    with _threads(threads, pool, lib):
                        got = _matmul(lib, qt, x, bias, base, t, mode, threads)
                    assert torch.equal(got, want), (qtype, mode, rows, t, threads, pool)
                    assert torch.equal(got[:, 0], base[:t, 0])
                    assert torch.equal(got[:, 1 + rows :], base[:t, 1 + rows :])


_FORKED: dict = {}  # the fork test's inputs, made before the fork (the child only multiplies)


def _child_matmul(conn) -> None:
    f = _FORKED
    y = _matmul(quant_ops.load(), f["qt"], f["x"], f["bias"], f["base"], 1, "auto", 2)
    conn.send(y.tolist())  # plain floats (a tensor would travel as shared memory)


def test_pool_restarts_its_helpers_after_a_fork():
    """A process forked after the parent's pool started (its helper asleep on the condition
    variable) has none of the parent's threads, and copies of the pool's mutexes and condition
    variable that they used: its two-thread loops still finish, with the same bits."""
    lib = quant_ops.load()
    if lib is None:
        pytest.skip("no C compiler")
    qt = random_blocks("Q4_1", 300, 256, 1)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2))
    bias, base = torch.zeros(300), torch.zeros(1, 303)
    _FORKED.update(qt=qt, x=x, bias=bias, base=base)
    with _threads(2, 1, lib):
        want = _matmul(lib, qt, x, bias, base, 1, "auto", 2)  # the parent's helpers start
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        child = ctx.Process(target=_child_matmul, args=(theirs,))
        child.start()
        assert ours.poll(60), "the forked child's matmul did not finish"
        got = ours.recv()
        child.join(10)
    assert child.exitcode == 0
    assert got == want.tolist()  # float32 values as Python floats: exact


@torch.inference_mode()
def test_real_model_decode_same_bits_on_any_thread_count(real_gguf):
    """SmolLM2's Q4_1 GGUF: a 100-token prompt, then batch-1 decode steps (and a 3-request
    decode batch) on 1, 2 and 3 threads, pool and OpenMP: the logits are the one-thread
    logits bit for bit. Past 76 context columns the one-token attention runs over the threads
    too (loom_forward_f32's attn_threads), so both the matmuls' and the attention's split are
    covered."""
    from loom.runtime.model_runner import ModelRunner
    from loom.runtime.server_args import ServerArgs
    from tests.test_cpu_forward import _Steps

    try:
        path = real_gguf("smollm2")
    except Exception as e:  # noqa: BLE001 - no file and no registry: nothing to run on
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    runner = ModelRunner(ServerArgs(model_path=path, quantization="gguf", max_total_tokens=4096))
    if runner.cpu_forward is None:
        pytest.skip("the compiled forward is off here")
    lib = runner.cpu_forward.lib
    st = _Steps(runner, 3, seed=3)
    runner.cpu_forward(st.batch([0, 1, 2], [100, 90, 80], ForwardMode.EXTEND))
    pool = runner.token_to_kv_pool
    for reqs in ([0], [0, 1, 2], [1]):
        batch = st.batch(reqs, [1] * len(reqs), ForwardMode.DECODE, all_logits=False)
        slots = batch.out_cache_loc
        outs = []
        for threads, p in ((1, 1), (2, 1), (3, 1), (2, 0), (2, 2)):
            with _threads(threads, p, lib):
                logits = runner.cpu_forward(batch)
            kv = [b[slots].clone() for b in pool.k_buffers + pool.v_buffers]
            outs.append((logits.clone(), kv))
        for (logits, kv), cfg in zip(outs[1:], ((2, 1), (3, 1), (2, 0), (2, 2))):
            assert torch.equal(logits, outs[0][0]), (reqs, cfg)
            assert all(torch.equal(a, b) for a, b in zip(kv, outs[0][1])), (reqs, cfg)
