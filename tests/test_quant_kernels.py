"""Quantized-weight kernels (kernels/cpu/quant.c) and their torch references (kernels/quant_ref.py).

The references are checked against ggml's own Python implementation (`gguf.quants`): the
dequantizer on random blocks of every type and on a real file's tensors, the quantizer byte for
byte. Each C kernel is checked against the reference at odd shapes, every block type, batch 1..8
and larger, both activation modes and both instruction-set builds (VNNI and portable).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from loom.kernels.quant_ref import (
    dequantize_ref,
    quantize_act16_ref,
    quantize_act_ref,
    quantize_ref,
)
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import BLOCKS, QuantizedTensor

gguf = pytest.importorskip("gguf")

QTYPES = list(BLOCKS)
GEMV_MAX = 8  # quant.c: token count up to which "int8" takes the int8 dot products
I16_MAX = 8  # quant.c: token count up to which "int16" takes the 16-bit kernels
I16_TYPES = ("Q8_0", "Q4_0", "Q4_1")  # the types with 16-bit kernels ("int16" on others: int8)
F32V_TYPES = QTYPES  # the types the f32 decode GEMV (quant.c matmul_f32v) reads: all of them
LANE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")  # quant_bi.c bi_lanes' types


def seen(x: torch.Tensor, qtype: str, mode: str, isa: str = "native") -> torch.Tensor:
    """The activations as `mode`'s kernel for `qtype` rounds them at this token count."""
    t = x.shape[0]
    if mode == "auto":  # quant.c: "bi" for loom_q_auto_bi's types, else the f32 GEMV (where
        # built) up to 8 tokens, else "bi"
        lib = quant_ops.load(isa)
        f32v = lib is not None and lib.loom_q_f32v() and qtype in F32V_TYPES and t <= 8
        mode = "f32" if f32v and not auto_bi(qtype, isa) else "bi"
    if mode == "bi":  # 16-bit activations for every type and token count
        return quantize_act16_ref(x)
    if mode == "int16" and qtype in I16_TYPES and t <= I16_MAX:
        return quantize_act16_ref(x)
    if mode in ("int8", "int16") and t <= GEMV_MAX:
        return quantize_act_ref(x)
    return x


def auto_bi(qtype: str, isa: str = "native") -> bool:
    """Whether mode "auto" takes "bi" at every token count for `qtype` in this build (quant_bi.c's
    16-row-lane kernel: LANE_TYPES with AVX-512 VNNI)."""
    lib = quant_ops.load(isa)
    return lib is not None and bool(lib.loom_q_auto_bi(quant_ops.QTYPES[qtype]))


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> QuantizedTensor:
    """Random codes with small finite f16 scales (random bytes there could be inf / nan)."""
    g = torch.Generator().manual_seed(seed)
    values, nbytes = BLOCKS[qtype]
    n = rows * (cols // values)
    data = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)

    def f16(lo: float, hi: float) -> torch.Tensor:
        x = torch.rand(n, generator=g) * (hi - lo) + lo
        return x.to(torch.float16).view(torch.uint8).view(n, 2)

    if qtype == "Q6_K":
        data[:, 208:210] = f16(0.001, 0.02)
    else:
        data[:, 0:2] = f16(0.001, 0.02)
        if qtype in ("Q4_1", "Q5_1", "Q4_K"):
            data[:, 2:4] = f16(0.0, 0.01) if qtype == "Q4_K" else f16(-0.01, 0.01)
    return QuantizedTensor(qtype, (rows, cols), data.view(rows, -1))


def gguf_dequant(qt: QuantizedTensor) -> torch.Tensor:
    kind = getattr(gguf.GGMLQuantizationType, qt.qtype)
    return torch.from_numpy(gguf.quants.dequantize(qt.data.numpy(), kind)).reshape(qt.shape)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_ref_equals_gguf(qtype):
    qt = random_blocks(qtype, 5, 3 * BLOCKS[qtype][0])
    torch.testing.assert_close(dequantize_ref(qt.qtype, qt.data, qt.shape), gguf_dequant(qt))


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantize_ref_equals_gguf_bytes(qtype):
    w = torch.randn(9, 96, generator=torch.Generator().manual_seed(1))
    ours = quantize_ref(w, qtype)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    theirs = torch.from_numpy(gguf.quants.quantize(w.numpy(), kind))
    assert torch.equal(ours, theirs)
    back = dequantize_ref(qtype, ours, (9, 96))
    step = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15}[qtype]
    bound = w.reshape(-1, 32).abs().amax(1, keepdim=True) * step * 1.01  # half a step, twice over
    assert ((back - w).reshape(-1, 32).abs() <= bound).all()


ISAS = ["native", "avx2"]


@pytest.fixture(scope="module", params=ISAS)
def isa(request):
    if quant_ops.load(request.param) is None:
        pytest.skip("no C compiler (LOOM_STRICT_NATIVE=1 makes this a failure)")
    return request.param


def test_native_build_takes_vnni_where_the_cpu_has_it(isa):
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    has = "avx512_vnni" in flags and "avx512bw" in flags
    avx512f = "avx512f" in flags
    # "avx2" is -mno-avx512f where the CPU has AVX-512F, else the native build itself
    assert quant_ops.vnni(isa) == (has and (isa == "native" or not avx512f))


def test_auto_mode_takes_the_f32_gemv_up_to_8_tokens_and_bi_above(isa):
    """The default mode, "auto", resolved per call in quant.c: bitwise "bi" at every token
    count for every block type in a build with AVX-512 VNNI (quant_bi.c's 16-row-lane kernel,
    LANE_TYPES); for the types outside LANE_TYPES bitwise "f32" (the register-expanded decode GEMV) up to
    8 tokens in a build with AVX-512F/BW; bitwise "bi" for more tokens or another build."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    f32v = "avx512f" in flags and "avx512bw" in flags and isa == "native"
    lanes = f32v and "avx512_vnni" in flags
    assert quant_ops.resolve_mode(None) == "auto"
    for qtype in ("Q4_1", "Q8_0", "Q4_0", "Q6_K", "Q5_0", "Q5_1", "Q4_K"):
        assert auto_bi(qtype, isa) == (lanes and qtype in LANE_TYPES), qtype
        qt = random_blocks(qtype, 24, 2 * BLOCKS[qtype][0], 3)
        for t in (1, 8, 9, 20):
            x = torch.randn(t, qt.shape[1], generator=torch.Generator().manual_seed(t))
            got = quant_ops.matmul(qt, x, mode="auto", isa=isa)
            small = f32v and qtype in F32V_TYPES and t <= 8 and not auto_bi(qtype, isa)
            expect = "f32" if small else "bi"
            assert torch.equal(got, quant_ops.matmul(qt, x, mode=expect, isa=isa)), (qtype, t)


@pytest.mark.parametrize("qtype", LANE_TYPES)
def test_bi_lanes_kernel_is_the_canonical_arithmetic(qtype, isa):
    """quant_bi.c's 16-row-lane kernel (mode "bi" at 1..8 tokens for LANE_TYPES; in AVX2
    builds without AVX-512, quant_bi2.c's 8-row-lane kernel for Q8_0 / Q4_0 / Q4_1): each
    row of a T-row call equals the 1-row call bitwise for T = 1..8, and every output equals
    the older "bi" kernels' (the per-row GEMV and the 8-token tile, or the portable C,
    loom_q_bi_lanes = 0) bit for bit: row counts below, at and past a 16-row pass (odd ones:
    masked lanes), units per row below, at and past the 16 partial sums, accumulating into a
    strided output with a bias, one and two threads."""
    lib = quant_ops.load(isa)
    if lib is None or not (
        auto_bi(qtype, isa) or lib.loom_q_bi_lanes2_type(quant_ops.QTYPES[qtype])
    ):
        pytest.skip(
            "this build has no lanes kernel for the type (AVX-512 VNNI, or AVX2 for Q8_0 / Q4_x)"
        )
    knob = ctypes.c_int.in_dll(lib, "loom_q_bi_lanes")
    prev = torch.get_num_threads()
    try:
        for rows, nb in ((1, 1), (15, 3), (16, 16), (17, 17), (37, 20), (45, 2)):
            # Q4_K / Q6_K: super-blocks of 256 (8 / 16 units, or 24 / 48: past the 16 partials)
            cols = 32 * nb if BLOCKS[qtype][0] == 32 else 256 * (1 + nb // 8)
            qt = random_blocks(qtype, rows, cols, rows + nb)
            x = torch.randn(8, cols, generator=torch.Generator().manual_seed(nb))
            x[2, 32:64] = 0.0  # an all-zero activation block
            x[5, :32] *= 1e4  # and a large one
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(rows))
            base = torch.randn(8, rows + 3, generator=torch.Generator().manual_seed(1))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                alone = torch.cat(
                    [quant_ops.matmul(qt, x[i : i + 1], bias, mode="bi", isa=isa) for i in range(8)]
                )
                for t in range(1, 9):
                    outs = []
                    for lanes in (1, 0):
                        knob.value = lanes
                        wide = base[:t].clone()
                        rc = lib.loom_q_matmul(
                            quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(),
                            rows, cols, qt.row_bytes, x.data_ptr(), t, cols, bias.data_ptr(),
                            wide[:, 1:].data_ptr(), wide.stride(0), 1, threads,
                        )  # fmt: skip
                        assert rc == 0
                        outs.append(wide)
                    knob.value = 1
                    assert torch.equal(outs[0], outs[1]), (qtype, rows, nb, t, threads)
                    plain = quant_ops.matmul(qt, x[:t], bias, mode="bi", isa=isa)
                    assert torch.equal(plain, alone[:t]), (qtype, rows, nb, t, threads)
                    # masked lanes write nothing past the rows
                    assert torch.equal(outs[0][:, 0], base[:t, 0])
                    assert torch.equal(outs[0][:, 1 + rows :], base[:t, 1 + rows :])
    finally:
        knob.value = 1
        torch.set_num_threads(prev)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("mode", ["f32", "int8", "int16", "bi", "auto"])
def test_matmul_matches_reference(qtype, mode, isa):
    values = BLOCKS[qtype][0]
    for rows, nblocks, seed in ((1, 1, 0), (7, 3, 1), (45, 2, 2)):
        cols = nblocks * values
        qt = random_blocks(qtype, rows, cols, seed)
        w = dequantize_ref(qt.qtype, qt.data, qt.shape)
        for t in (*range(1, 9), 13, 32, 33, 64):
            x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t))
            bias = (
                torch.randn(rows, generator=torch.Generator().manual_seed(99 + t))
                if t % 2
                else None
            )
            y = quant_ops.matmul(qt, x, bias, mode=mode, isa=isa)
            # int8 / int16 (decode): the kernel sees the activations rounded per block of 32,
            # as the reference does; larger T runs the f32 kernel in every mode
            xs = seen(x, qtype, mode, isa)
            err = _relative_error(y, xs, w, bias)
            assert err < 2e-5, (qtype, mode, rows, cols, t, err)


def _relative_error(y, xs, w, bias) -> float:
    """max |y - (xs @ w.T + bias)| over the largest sum |x| |w| + |bias|: rounding error scales
    with the terms summed, not with the sum (a single output that nearly cancels has a tiny
    |ref|)."""
    ref = xs @ w.T
    scale = xs.abs() @ w.abs().T
    if bias is not None:
        ref, scale = ref + bias, scale + bias.abs()
    return (y - ref).abs().max().item() / (scale.max().item() + 1e-6)


@pytest.mark.parametrize("qtype", QTYPES)
def test_int8_activations_stay_close_to_f32(qtype, isa):
    """The int8 path's only approximation is the activations' rounding: bounded by half a step
    of each block's scale, times the weights' magnitude."""
    qt = random_blocks(qtype, 33, 2 * BLOCKS[qtype][0], 3)
    x = torch.randn(4, qt.shape[1])
    exact = quant_ops.matmul(qt, x, mode="f32", isa=isa)
    approx = quant_ops.matmul(qt, x, mode="int8", isa=isa)
    w = dequantize_ref(qt.qtype, qt.data, qt.shape)
    step = x.reshape(4, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(4, -1) / 127
    bound = (step / 2) @ w.abs().T
    assert ((approx - exact).abs() <= bound * 1.001 + 1e-6).all()


@pytest.mark.parametrize("qtype", I16_TYPES)
def test_int16_activations_stay_close_to_f32(qtype, isa):
    """The 16-bit path rounds activations to 1/32512 of each block's max (256 times finer than
    int8), with weights of full range (Q8_0 codes of -127 and 127, 4-bit codes 0 and 15) so the
    two-halves split and the Q8_0 sign trick see their extremes."""
    qt = random_blocks(qtype, 33, 4 * 32, 5)
    x = torch.randn(T := 5, qt.shape[1]) * torch.logspace(-3, 3, qt.shape[1])
    x[0, :32] = 0.0  # an all-zero block: scale 0
    exact = quant_ops.matmul(qt, x, mode="f32", isa=isa)
    approx = quant_ops.matmul(qt, x, mode="int16", isa=isa)
    w = dequantize_ref(qt.qtype, qt.data, qt.shape)
    step = x.reshape(T, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(T, -1)
    bound = (step / 32512 / 2) @ w.abs().T
    assert ((approx - exact).abs() <= bound * 1.01 + 1e-4 * exact.abs() + 1e-6).all()


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_match_reference(qtype, isa):
    qt = random_blocks(qtype, 11, BLOCKS[qtype][0], 4)
    ids = torch.tensor([[0, 10, 3], [3, 3, 7]])
    got = quant_ops.rows(qt, ids, isa=isa)
    assert got.shape == (2, 3, qt.shape[1])
    torch.testing.assert_close(got, dequantize_ref(qt.qtype, qt.data, qt.shape)[ids])
    with pytest.raises(IndexError):
        quant_ops.rows(qt, torch.tensor([11]), isa=isa)


def test_strided_output_and_threads(isa):
    """A column slice of a wider output (how a fused weight's segments land) with several
    threads: the other columns stay untouched."""
    qt = random_blocks("Q4_1", 300, 256, 5)
    x = torch.randn(5, 256)
    out = torch.full((5, 310), 7.0)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quant_ops.matmul(qt, x, out=out[:, 4:304], mode="f32", isa=isa)
    finally:
        torch.set_num_threads(prev)
    ref = x @ dequantize_ref(qt.qtype, qt.data, qt.shape).T
    torch.testing.assert_close(out[:, 4:304], ref, rtol=1e-5, atol=1e-5)
    assert (out[:, :4] == 7).all() and (out[:, 304:] == 7).all()


def test_real_tensors_match_gguf(real_gguf):
    """Every block type the SmolLM2 file holds (Q8_0 embedding, Q4_1 projections): the
    reference equals gguf's dequantizer and the kernels equal the reference."""
    path = os.environ.get("LOOM_SMOLLM2_GGUF") or real_gguf("smollm2")  # fetched once if need be
    reader = gguf.GGUFReader(str(path))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in BLOCKS or kind in seen:
            continue
        seen.add(kind)
        data = torch.from_numpy(t.data.copy())
        rows = data.shape[0]
        cols = int(t.shape[0])
        qt = QuantizedTensor(kind, (rows, cols), data)
        ref = dequantize_ref(kind, qt.data, qt.shape)
        theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(rows, cols)
        assert torch.equal(ref, theirs.float()), t.name
        sub = QuantizedTensor(kind, (64, cols), qt.data[:64].contiguous())
        x = torch.randn(3, cols)
        torch.testing.assert_close(quant_ops.matmul(sub, x, mode="f32"), x @ ref[:64].T)
    assert seen == {"Q8_0", "Q4_1"}


@pytest.mark.parametrize("qtype", F32V_TYPES)
def test_f32_decode_gemv_long_rows(qtype, isa):
    """The f32 decode GEMV (T <= 8) over rows of several scale chunks (16 units of 32 values
    each: two K super-blocks) and a partial last one, row counts that leave 1-3 rows past the
    groups of four: against the dequantized weights in float64."""
    values = BLOCKS[qtype][0]
    shapes = ((9, 5), (6, 2), (3, 3)) if values == 256 else ((9, 37), (6, 16), (3, 18))
    for rows, nblocks in shapes:
        qt = random_blocks(qtype, rows, nblocks * values, rows)
        w = dequantize_ref(qt.qtype, qt.data, qt.shape).double()
        for t in range(1, 9):
            x = torch.randn(t, qt.shape[1], generator=torch.Generator().manual_seed(t))
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(t + 7))
            ref = x.double() @ w.T + bias.double()
            y = quant_ops.matmul(qt, x, bias, mode="f32", isa=isa).double()
            scale = (x.double().abs() @ w.abs().T).max().item()
            assert (y - ref).abs().max().item() / scale < 2e-6, (qtype, rows, nblocks, t)


@pytest.mark.parametrize("qtype", F32V_TYPES)
def test_f32_decode_gemv_is_batch_invariant(qtype, isa):
    """Mode "f32" up to 8 tokens: a token's outputs are bitwise the same alone and in a batch of
    2..8, whichever way the kernel groups rows and tokens (loom_q_wide_rows 1-3: one pass of
    5-8 tokens; 0: passes of four), on one or two threads. What lets a batch-1 decode and its
    verify steps of <= 8 rows agree bitwise under mode auto."""
    lib = quant_ops.load(isa)
    wide = ctypes.c_int.in_dll(lib, "loom_q_wide_rows")
    default, prev = wide.value, torch.get_num_threads()
    qt = random_blocks(qtype, 37, 5 * 256, 5)  # 40 units of 32: scale chunks 16 + 16 + 8
    x = torch.randn(8, qt.shape[1], generator=torch.Generator().manual_seed(5))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(6))
    try:
        torch.set_num_threads(1)
        alone = torch.cat([quant_ops.matmul(qt, x[i : i + 1], bias, mode="f32", isa=isa)
                           for i in range(8)])  # fmt: skip
        for rows, threads in ((0, 1), (1, 2), (2, 1), (3, 1), (3, 2)):
            wide.value = rows
            torch.set_num_threads(threads)
            for t in range(2, 9):
                got = quant_ops.matmul(qt, x[:t], bias, mode="f32", isa=isa)
                assert torch.equal(got, alone[:t]), (qtype, rows, threads, t)
    finally:
        wide.value = default
        torch.set_num_threads(prev)


@pytest.mark.parametrize("qtype", QTYPES)
def test_bi_rows_are_batch_invariant(qtype, isa):
    """Mode "bi" (quant_bi.c): a token's outputs are bitwise the same alone, in a batch of
    any size (the GEMV up to 4 tokens, the 16-token tile above, partial token groups) and on
    one or two threads; units per row below, at and above the 16 partial sums."""
    values = BLOCKS[qtype][0]
    nblocks = (1, 2, 3) if values == 256 else (3, 16, 18, 48)
    prev = torch.get_num_threads()
    try:
        for nb in nblocks:
            cols = nb * values
            qt = random_blocks(qtype, 37, cols, nb)
            x = torch.randn(40, cols, generator=torch.Generator().manual_seed(nb))
            x[3, :32] = 0.0  # an all-zero activation block
            bias = torch.randn(37, generator=torch.Generator().manual_seed(7))
            torch.set_num_threads(1)
            alone = torch.cat(
                [quant_ops.matmul(qt, x[i : i + 1], bias, mode="bi", isa=isa) for i in range(40)]
            )
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in (2, 4, 5, 8, 9, 16, 17, 32, 40):
                    got = quant_ops.matmul(qt, x[:t], bias, mode="bi", isa=isa)
                    assert torch.equal(got, alone[:t]), (qtype, cols, t, threads)
                # and a token's place in the batch does not matter either
                perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
                got = quant_ops.matmul(qt, x[perm], bias, mode="bi", isa=isa)
                assert torch.equal(got, alone[perm]), (qtype, cols, threads)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("qtype", F32V_TYPES)
def test_f32_decode_gemv_is_batch_invariant_up_to_8_rows(qtype, isa):
    """Mode "auto" at 1..8 tokens (the f32 decode GEMV on AVX-512 builds, "bi" elsewhere): a
    token's outputs are bitwise the same alone and in any batch of up to 8 rows, at any place
    in it, so a batch-1 decode step and its <= 8-row verify steps agree bitwise."""
    values = BLOCKS[qtype][0]
    for rows, nblocks in ((7, 3), (13, 1)):
        cols = nblocks * values
        qt = random_blocks(qtype, rows, cols, nblocks)
        x = torch.randn(8, cols, generator=torch.Generator().manual_seed(rows))
        alone = torch.cat(
            [quant_ops.matmul(qt, x[i : i + 1], mode="auto", isa=isa) for i in range(8)]
        )
        for t in range(2, 9):
            got = quant_ops.matmul(qt, x[:t], mode="auto", isa=isa)
            assert torch.equal(got, alone[:t]), (qtype, cols, t)
        perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))
        assert torch.equal(quant_ops.matmul(qt, x[perm], mode="auto", isa=isa), alone[perm])


def test_matmul_of_no_rows_reads_nothing(monkeypatch):
    """A step with no logits rows (a prefill chunk that finishes no request) multiplies the
    head by an empty x: the result is empty, and the full-matrix reference (which dequantizes
    every row: Gemma 3's 262k-row head is 671 MB of float32) is never called."""
    import loom.kernels.quant_ref as ref

    def fail(*a, **k):
        raise AssertionError("matmul_ref called for an empty x")

    monkeypatch.setattr(ref, "matmul_ref", fail)
    qt = random_blocks("Q8_0", 40, 64)
    for x in (torch.empty(0, 64), torch.empty(2, 0, 64)):
        y = quant_ops.matmul(qt, x, torch.randn(40))
        assert y.shape == (*x.shape[:-1], 40) and y.dtype == torch.float32


@pytest.mark.parametrize("qtype", ("Q4_1", "Q8_0", "Q6_K"))
def test_bi_tile_accumulates_into_strided_output(qtype, isa):
    """Mode "bi" with accumulate on (the C forward's O and down projections add into the
    residual stream) into a strided output, at token counts of full and partial 16-token
    groups and a row count past the 32-row blocks: bitwise (y + x W^T) + bias, the plain
    product's bits added as torch adds them."""
    lib = quant_ops.load(isa)
    if lib is None:
        pytest.skip("no C compiler")
    values = BLOCKS[qtype][0]
    qt = random_blocks(qtype, 37, 3 * values if values == 32 else values, 5)
    rows, cols = qt.shape
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(3))
    for t in (16, 20, 32, 37):
        x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t))
        plain = quant_ops.matmul(qt, x, None, mode="bi", isa=isa)
        wide = torch.randn(t, rows + 5, generator=torch.Generator().manual_seed(t + 1))
        before = wide[:, 2 : 2 + rows].clone()
        rc = lib.loom_q_matmul(
            quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(), rows, cols,
            qt.row_bytes, x.data_ptr(), t, cols, bias.data_ptr(), wide[:, 2:].data_ptr(),
            wide.stride(0), 1, 1,
        )  # fmt: skip
        assert rc == 0
        assert torch.equal(wide[:, 2 : 2 + rows], (before + plain) + bias), (qtype, t)


@pytest.mark.parametrize("qtype", QTYPES)
def test_bi_avx2_tiles_equal_the_portable_c(qtype, isa):
    """quant_bi_avx2.c (mode "bi" in AVX2 + FMA builds without AVX-512 VNNI: 8-token lanes, 4
    rows a pass) gives bitwise the portable C's outputs (loom_q_bi_avx2 = 0: quant.c's generic
    row decoder, scalar fmaf): every block type, units per row below, at and past the 16
    partial sums, odd row counts (a pass's dropped rows, a 32-row block's tail), token counts
    around the 8-token groups and the 2-group passes, an all-zero and a large activation
    block, with and without bias, accumulating into a strided output, one and two threads.
    Knobs 4 (the default: knob 3 with a group's tokens packed by register transposes), 3 (the
    register row decoder of the 32-value types, its fast variant), 2 (that decoder's earlier
    variant) and 1 (the earlier row decoder) all."""
    lib = quant_ops.load(isa)
    if lib is None or not lib.loom_q_bi_avx2_built():
        pytest.skip("this build has no AVX2 tiles (no AVX2 + FMA, or AVX-512 VNNI's instead)")
    knob = ctypes.c_int.in_dll(lib, "loom_q_bi_avx2")
    default = knob.value
    kgemv = ctypes.c_int.in_dll(lib, "loom_q_bi_kgemv")
    gemv = ctypes.c_int.in_dll(lib, "loom_q_bi_gemv")
    # the tiles at 1-4 tokens too (quant_gemv_k_avx2.c and quant_gemv_avx2.c have their own tests)
    kgemv.value = gemv.value = 0
    values = BLOCKS[qtype][0]
    prev = torch.get_num_threads()
    try:
        for rows, nb in ((5, 1), (17, 3), (37, 16), (45, 20)):
            cols = nb * 32 if values == 32 else 256 * (1 + nb // 8)
            qt = random_blocks(qtype, rows, cols, rows + nb)
            x = torch.randn(33, cols, generator=torch.Generator().manual_seed(nb))
            x[2, 32:64] = 0.0
            x[5, :32] *= 1e4
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(rows))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in (1, 3, 7, 8, 9, 16, 17, 24, 33):
                    for b in (bias, None):
                        outs = []
                        for on in (4, 3, 2, 1, 0):
                            knob.value = on
                            wide = torch.randn(
                                t, rows + 3, generator=torch.Generator().manual_seed(t)
                            )
                            rc = lib.loom_q_matmul(
                                quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(),
                                rows, cols, qt.row_bytes, x.data_ptr(), t, cols,
                                None if b is None else b.data_ptr(), wide[:, 1:].data_ptr(),
                                wide.stride(0), t % 2, threads,
                            )  # fmt: skip
                            assert rc == 0
                            outs.append(wide)
                        for o in outs[:4]:
                            assert torch.equal(o, outs[4]), (qtype, rows, cols, t, threads)
    finally:
        knob.value = default
        kgemv.value = gemv.value = 1
        torch.set_num_threads(prev)


def test_bi_avx2_held_codes_equal_fresh_ones(isa):
    """loom_q_hold_x (forward.c's qmm over a matrix's row segments, Gemma 3's Q5_0 q / k and
    Q8_0 v rows): the calls up to loom_q_release_x that multiply the held x reuse its 16-bit
    codes, and give bitwise what each call quantizing x itself gives (loom_q_hold = 0): two
    segments of units of 32 (the reuse), a Q6_K one between them (units of 16: its own codes),
    and a call on other rows of x or another token count (not the held x: its own codes)."""
    lib = quant_ops.load(isa)
    if lib is None or not lib.loom_q_bi_avx2_built():
        pytest.skip("this build has no AVX2 tiles (no AVX2 + FMA, or AVX-512 VNNI's instead)")
    lib.loom_q_hold_x.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.loom_q_hold_x.restype = None
    lib.loom_q_release_x.restype = None
    hold = ctypes.c_int.in_dll(lib, "loom_q_hold")
    cols = 512
    segs = [
        (q, random_blocks(q, 13 + i, cols, 7 + i)) for i, q in enumerate(("Q5_0", "Q6_K", "Q8_0"))
    ]
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(3))
    try:
        for threads in (1, 2):
            for t in (9, 33):
                runs = []
                for on in (1, 0):
                    hold.value = on
                    lib.loom_q_hold_x(x.data_ptr(), t, cols, cols)
                    outs = []
                    # the held x's segments, then x's rows from 1 and x with t - 1 tokens
                    for (qtype, qt), (ptr, n) in zip(
                        segs + segs[:1] * 2,
                        [(x.data_ptr(), t)] * 3 + [(x[1:].data_ptr(), t), (x.data_ptr(), t - 1)],
                    ):
                        y = torch.full((n, qt.data.shape[0]), float("nan"))
                        rc = lib.loom_q_matmul(
                            quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(),
                            qt.data.shape[0], cols, qt.row_bytes, ptr, n, cols, None,
                            y.data_ptr(), y.stride(0), 0, threads,
                        )  # fmt: skip
                        assert rc == 0
                        outs.append(y)
                    lib.loom_q_release_x()
                    runs.append(outs)
                for a, b in zip(*runs):
                    assert torch.equal(a, b), (t, threads)
    finally:
        hold.value = 1


@pytest.mark.parametrize("qtype", ("Q4_K", "Q6_K"))
def test_bi_kgemv_equals_the_portable_c(qtype, isa):
    """quant_gemv_k_avx2.c (mode "bi" for Q4_K / Q6_K at 1-4 tokens in AVX2 + FMA builds without
    AVX-512 VNNI: one row a time, lanes = values) gives bitwise the portable C's outputs
    (loom_q_bi_kgemv = 0 and loom_q_bi_avx2 = 0) and quant_bi_avx2.c's tiles' (loom_q_bi_kgemv
    = 0): K of 1 to 9 super-blocks (units below, at and past the 16 partial sums), row counts
    below, at and past a pool item of 4 rows, an all-zero and a large activation block, with
    and without bias, accumulating into a strided output or not, one and two threads."""
    lib = quant_ops.load(isa)
    if lib is None or not lib.loom_q_bi_kgemv_type(quant_ops.QTYPES[qtype]):
        pytest.skip("this build has no K-quant GEMV (no AVX2 + FMA, or AVX-512 VNNI's lanes)")
    kg = ctypes.c_int.in_dll(lib, "loom_q_bi_kgemv")
    avx2 = ctypes.c_int.in_dll(lib, "loom_q_bi_avx2")
    avx2_default = avx2.value
    prev = torch.get_num_threads()
    try:
        for rows, nsb in ((1, 1), (3, 2), (4, 3), (9, 4), (37, 9)):
            cols = 256 * nsb
            qt = random_blocks(qtype, rows, cols, rows + nsb)
            x = torch.randn(4, cols, generator=torch.Generator().manual_seed(nsb))
            x[1, 32:64] = 0.0
            x[2, :32] *= 1e4
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(rows))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in (1, 2, 3, 4):
                    for b in (bias, None):
                        outs = []
                        for k, a in ((1, 1), (0, 0), (0, 1)):
                            kg.value, avx2.value = k, a
                            wide = torch.randn(
                                t, rows + 3, generator=torch.Generator().manual_seed(t)
                            )
                            rc = lib.loom_q_matmul(
                                quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(),
                                rows, cols, qt.row_bytes, x.data_ptr(), t, cols,
                                None if b is None else b.data_ptr(), wide[:, 1:].data_ptr(),
                                wide.stride(0), t % 2, threads,
                            )  # fmt: skip
                            assert rc == 0
                            outs.append(wide)
                        where = (qtype, rows, cols, t, threads, b is None)
                        assert torch.equal(outs[0], outs[1]), where
                        assert torch.equal(outs[0], outs[2]), where
                        assert not torch.isnan(outs[0]).any(), where
    finally:
        kg.value = 1
        avx2.value = avx2_default
        torch.set_num_threads(prev)


GEMV_AVX2_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")  # quant_gemv_avx2.c's types


@pytest.mark.parametrize("qtype", GEMV_AVX2_TYPES)
def test_bi_gemv_avx2_equals_the_portable_c(qtype, isa):
    """quant_gemv_avx2.c (mode "bi" at 1..4 tokens, Q5_0 1..3, in AVX2 + FMA + F16C builds
    without AVX-512: lanes = a row's values, 8 units a step) gives bitwise the portable C's outputs (every AVX2
    knob off: loom_q_bi_gemv, loom_q_bi_lanes, loom_q_bi_avx2 = 0) and the older AVX2 kernels'
    (loom_q_bi_gemv = 0): units per row below, at and past a group of 8 and the 16 partial sums
    (a last group of 1..7 units: missing pairs, a pair's missing high unit), 1 row and odd row
    counts past the 4-row items, T = 1..4, an all-zero and a large activation block, with and
    without bias, accumulating or not into a strided output, one and two threads."""
    lib = quant_ops.load(isa)
    if lib is None or not lib.loom_q_bi_gemv_type(quant_ops.QTYPES[qtype]):
        pytest.skip("this build has no AVX2 values-as-lanes GEMV (AVX2 + FMA + F16C, no AVX-512)")
    knobs = [
        ctypes.c_int.in_dll(lib, k) for k in ("loom_q_bi_gemv", "loom_q_bi_lanes", "loom_q_bi_avx2")
    ]
    defaults = [k.value for k in knobs]
    prev = torch.get_num_threads()
    try:
        for rows, nb in ((1, 1), (3, 7), (5, 8), (9, 9), (13, 18), (37, 20), (6, 36), (2, 45)):
            cols = 32 * nb
            qt = random_blocks(qtype, rows, cols, rows + nb)
            x = torch.randn(4, cols, generator=torch.Generator().manual_seed(nb))
            x[1, 32:64] = 0.0  # an all-zero activation block (or the row's only one, nb = 1)
            x[2, :32] *= 1e4  # and a large one
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(rows))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in range(1, 5):
                    for b in (bias, None):
                        outs = []
                        for on in ((1, 1, 1), (0, 1, 1), (0, 0, 0)):
                            for k, v in zip(knobs, on):
                                k.value = v
                            wide = torch.randn(
                                t, rows + 3, generator=torch.Generator().manual_seed(t)
                            )
                            rc = lib.loom_q_matmul(
                                quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(),
                                rows, cols, qt.row_bytes, x.data_ptr(), t, cols,
                                None if b is None else b.data_ptr(), wide[:, 1:].data_ptr(),
                                wide.stride(0), t % 2, threads,
                            )  # fmt: skip
                            assert rc == 0
                            outs.append(wide)
                        key = (qtype, rows, cols, t, threads, b is None)
                        assert torch.equal(outs[0], outs[2]), key
                        assert torch.equal(outs[0], outs[1]), key
                        # nothing written outside the rows
                        assert torch.equal(outs[0][:, 0], outs[2][:, 0]), key
    finally:
        for k, v in zip(knobs, defaults):
            k.value = v
        torch.set_num_threads(prev)


GEMV1_TYPES = ("Q8_0", "Q5_0")  # quant_gemv1_avx2.c's types (one token)


@pytest.mark.parametrize("qtype", GEMV1_TYPES)
def test_bi_gemv1_equals_the_portable_c(qtype, isa):
    """quant_gemv1_avx2.c (mode "bi" at one token, one unit a ymm, in AVX2 + FMA + F16C builds
    without AVX-512) gives bitwise the portable C's outputs (every AVX2 knob off) and
    quant_gemv_avx2.c's (loom_q_bi_gemv1 = 0): units per row below, at and past a group of 8
    (a last group of each size 1..7: its own units only) and past the 16 partial sums, 1 row and
    odd row counts past the 4-row items, an all-zero and a large activation block, with and
    without bias, accumulating or not into a strided output, one and two threads."""
    lib = quant_ops.load(isa)
    if lib is None or not lib.loom_q_bi_gemv1_type(quant_ops.QTYPES[qtype]):
        pytest.skip("this build has no one-token AVX2 GEMV (AVX2 + FMA + F16C, no AVX-512)")
    names = ("loom_q_bi_gemv1", "loom_q_bi_gemv", "loom_q_bi_lanes", "loom_q_bi_avx2")
    knobs = [ctypes.c_int.in_dll(lib, k) for k in names]
    prev = torch.get_num_threads()
    shapes = [(1, 1), (3, 7), (5, 8), (9, 9), (13, 18), (37, 20), (6, 36), (2, 45)]
    shapes += [(7, 16 + m) for m in (2, 3, 5, 6)]
    try:
        for rows, nb in shapes:
            cols = 32 * nb
            qt = random_blocks(qtype, rows, cols, rows + nb)
            x = torch.randn(1, cols, generator=torch.Generator().manual_seed(nb))
            for xs in range(2):
                if xs:
                    x[0, 32 * (nb // 2) : 32 * (nb // 2) + 32] = 0.0  # an all-zero block
                    x[0, :32] *= 1e4  # and a large one
                bias = torch.randn(rows, generator=torch.Generator().manual_seed(rows))
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    for b in (bias, None):
                        outs = []
                        for on in ((1, 1, 1, 1), (0, 1, 1, 1), (0, 0, 0, 0)):
                            for k, v in zip(knobs, on):
                                k.value = v
                            wide = torch.randn(
                                1, rows + 3, generator=torch.Generator().manual_seed(1)
                            )
                            rc = lib.loom_q_matmul(
                                quant_ops.QTYPES[qtype], quant_ops.MODES["bi"], qt.data.data_ptr(),
                                rows, cols, qt.row_bytes, x.data_ptr(), 1, cols,
                                None if b is None else b.data_ptr(), wide[:, 1:].data_ptr(),
                                wide.stride(0), xs, threads,
                            )  # fmt: skip
                            assert rc == 0
                            outs.append(wide)
                        key = (qtype, rows, cols, threads, xs, b is None)
                        assert torch.equal(outs[0], outs[2]), key
                        assert torch.equal(outs[0], outs[1]), key
    finally:
        for k in knobs:
            k.value = 1
        torch.set_num_threads(prev)


@pytest.mark.parametrize("qtype", QTYPES)
def test_bi_native_equals_the_portable_build(qtype):
    """Mode "bi" is one arithmetic on every build: the AVX-512 kernels (quant_bi.c's 16-row lanes
    at 1..8 tokens, the tiles above, each decoding rows in registers) give bitwise the avx2
    build's outputs (quant_bi2.c's 8-row lanes at 1..8 tokens for Q8_0 / Q4_x, else the portable
    C: quant.c's generic row decoder, scalar fmaf), for every block type, at token
    counts on both sides of each kernel's range, odd row counts, one and two threads."""
    native, portable = quant_ops.load("native"), quant_ops.load("avx2")
    if native is None or portable is None or not quant_ops.vnni("native"):
        pytest.skip("needs the AVX-512 VNNI build and the portable one")
    values = BLOCKS[qtype][0]
    prev = torch.get_num_threads()
    try:
        for rows, nb in ((17, 3 if values == 256 else 20), (37, 1 if values == 256 else 3)):
            cols = nb * values
            qt = random_blocks(qtype, rows, cols, rows)
            x = torch.randn(33, cols, generator=torch.Generator().manual_seed(nb))
            x[4, :32] = 0.0
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in (1, 3, 8, 9, 16, 17, 33):
                    a = quant_ops.matmul(qt, x[:t], bias, mode="bi", isa="native")
                    b = quant_ops.matmul(qt, x[:t], bias, mode="bi", isa="avx2")
                    assert torch.equal(a, b), (qtype, rows, cols, t, threads)
    finally:
        torch.set_num_threads(prev)


def prefill_i8(qtype: str, isa: str) -> bool:
    """Whether mode "prefill" takes an 8-bit kernel for `qtype` in this build (quant_i8.c's on
    AVX-512 VNNI, quant_i8_avx2.c's on AVX2 + FMA; elsewhere it is "auto")."""
    lib = quant_ops.load(isa)
    return lib is not None and bool(lib.loom_q_i8_type(quant_ops.QTYPES[qtype]))


def i8_avx2(isa: str) -> bool:
    """Whether the `isa` build has quant_i8_avx2.c's kernel (AVX2 + FMA without AVX-512 VNNI)."""
    lib = quant_ops.load(isa)
    return lib is not None and bool(lib.loom_q_i8_avx2_built())


@pytest.mark.parametrize("qtype", QTYPES)
def test_prefill_mode_matches_reference(qtype, isa):
    """Mode "prefill" (a prompt's rows, quant_i8.c): the activations rounded to 8 bits per block
    of 32 (quantize_act_ref), then exact integer dots and f32 scales, against the reference at
    odd shapes (rows past a 4-row pass and a 32-row block, partial 16-token groups), with and
    without bias, on one and two threads. Without the kernel (the avx2
    build) the mode is "auto", bit for bit."""
    values = BLOCKS[qtype][0]
    i8 = prefill_i8(qtype, isa)
    assert i8 == (quant_ops.vnni(isa) or i8_avx2(isa))  # quant.c's VNNI path's condition, or AVX2
    prev = torch.get_num_threads()
    try:
        for rows, nblocks, seed in ((1, 1, 0), (7, 3, 1), (45, 2, 2), (70, 6, 3)):
            cols = nblocks * values
            qt = random_blocks(qtype, rows, cols, seed)
            w = dequantize_ref(qt.qtype, qt.data, qt.shape)
            for t in (1, 5, 16, 17, 33, 64):
                g = torch.Generator().manual_seed(t)
                x = torch.randn(t, cols, generator=g)
                x[0, :32] = 0.0  # an all-zero activation block
                bias = torch.randn(rows, generator=g) if t % 2 else None
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    y = quant_ops.matmul(qt, x, bias, mode="prefill", isa=isa)
                    if not i8:
                        auto = quant_ops.matmul(qt, x, bias, mode="auto", isa=isa)
                        assert torch.equal(y, auto), (qtype, rows, cols, t)
                        continue
                    xs = quantize_act_ref(x)
                    err = _relative_error(y, xs, w, bias)
                    assert err < 2e-5, (qtype, rows, cols, t, threads, err)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("qtype", QTYPES)
def test_prefill_rows_do_not_depend_on_the_step(qtype, isa):
    """Mode "prefill": a row's outputs are bitwise the same alone, in a step of any size, at
    any place in it and on one or two threads, so a prompt gives the same bits however its
    prefill is split into chunks (the forward takes this mode for every prompt row)."""
    values = BLOCKS[qtype][0]
    cols = (3 if values == 256 else 48) * values
    qt = random_blocks(qtype, 37, cols, 4)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(6))
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat(
            [quant_ops.matmul(qt, x[i : i + 1], bias, mode="prefill", isa=isa) for i in range(40)]
        )
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for t in (2, 15, 16, 17, 32, 33, 40):
                got = quant_ops.matmul(qt, x[:t], bias, mode="prefill", isa=isa)
                assert torch.equal(got, alone[:t]), (qtype, t, threads)
            perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
            got = quant_ops.matmul(qt, x[perm], bias, mode="prefill", isa=isa)
            assert torch.equal(got, alone[perm]), (qtype, threads)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_K", "Q6_K", "Q8_0"])
def test_prefill_mode_outlier_blocks_take_the_residual_plane(qtype, isa):
    """A block whose largest value is far above the others (an outlier channel, as in Gemma 3's
    hidden states) gets a second 8-bit plane for its rounding error (quant_i8.c, dx / 254): the
    result matches the two-plane reference, and a row's bits still do not depend on its
    neighbours (half of the tokens without the outlier)."""
    if not prefill_i8(qtype, isa):
        pytest.skip("mode prefill is auto in this build (tested above)")
    cols = 512
    qt = random_blocks(qtype, 37, cols, 1)
    w = dequantize_ref(qt.qtype, qt.data, qt.shape)
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(2))
    x[::2, 5] = 40.0  # every other token: an outlier in block 0
    b = x.reshape(40, -1, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.sign(b / d) * torch.floor((b / d).abs() + 0.5)
    e = b - d * q
    rest = (b * b).sum(-1, keepdim=True) - (d * 127) ** 2
    resid = (e * e).sum(-1, keepdim=True) > 1e-3 * rest
    assert resid[::2, 0].all() and not resid[1::2].any() and not resid[:, 1:].any()
    d2 = d / 254
    q2 = torch.where(resid, torch.sign(e / d2) * torch.floor((e / d2).abs() + 0.5), 0.0)
    xs = (d * q + d2 * q2).reshape(40, cols)
    y = quant_ops.matmul(qt, x, mode="prefill", isa=isa)
    ref = xs @ w.T
    err = ((y - ref).abs().max() / (xs.abs() @ w.abs().T).max()).item()
    assert err < 2e-5, err
    # and closer to the unrounded product than 8 bits alone on the outlier tokens (the other
    # blocks keep their 8-bit error)
    exact = x @ w.T
    one_plane = quantize_act_ref(x) @ w.T
    assert (y - exact)[::2].abs().max() < 0.5 * (one_plane - exact)[::2].abs().max()
    alone = torch.cat(
        [quant_ops.matmul(qt, x[i : i + 1], mode="prefill", isa=isa) for i in range(40)]
    )
    assert torch.equal(y, alone)


@pytest.mark.parametrize("qtype", QTYPES)
def test_prefill_i8_avx2_equals_the_scalar_reference(qtype, isa):
    """quant_i8_avx2.c (mode "prefill" in AVX2 + FMA builds without AVX-512 VNNI: 8-token lanes,
    vpmaddubsw) gives bitwise the outputs of the same arithmetic in scalar C (loom_q_i8_avx2 = 0:
    scalar quantizer, I = sum w q, fmaf per unit): rows below, at and past a 4-row pass and a
    32-row block, token counts around the 8-token groups and their pairs, an all-zero, a large
    and an outlier block (the residual plane on some tokens only), with and without bias,
    accumulating or not into a strided output, one and two threads."""
    lib = quant_ops.load(isa)
    if not i8_avx2(isa):
        pytest.skip("this build has no AVX2 8-bit prompt-row kernel (AVX2 + FMA, no AVX-512 VNNI)")
    knob = ctypes.c_int.in_dll(lib, "loom_q_i8_avx2")
    values = BLOCKS[qtype][0]
    try:
        for rows, nb in ((1, 1), (5, 2), (37, 3), (70, 1)):
            cols = nb * (values if values == 256 else 64)
            qt = random_blocks(qtype, rows, cols, rows + nb)
            x = torch.randn(40, cols, generator=torch.Generator().manual_seed(nb))
            x[1, :32] = 0.0  # an all-zero activation block
            x[2, 32:64] *= 1e4  # a large one
            x[3::3, 7] = 60.0  # an outlier: the residual plane on every third token
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(rows))
            for t in (1, 7, 8, 9, 16, 17, 33, 40):
                for threads in (1, 2):
                    b = bias if t % 2 else None
                    outs = []
                    for on in (1, 0):
                        knob.value = on
                        wide = torch.randn(t, rows + 3, generator=torch.Generator().manual_seed(t))
                        rc = lib.loom_q_matmul(
                            quant_ops.QTYPES[qtype], quant_ops.MODES["prefill"], qt.data.data_ptr(),
                            rows, cols, qt.row_bytes, x.data_ptr(), t, cols,
                            None if b is None else b.data_ptr(), wide[:, 1:].data_ptr(),
                            wide.stride(0), (t // 8) % 2, threads,
                        )  # fmt: skip
                        assert rc == 0
                        outs.append(wide)
                    key = (qtype, rows, cols, t, threads)
                    assert torch.equal(outs[0], outs[1]), key
    finally:
        knob.value = 1


@pytest.mark.parametrize("qtype", QTYPES)
def test_prefill_i8_native_equals_the_avx2_build(qtype):
    """Mode "prefill" is one arithmetic on both builds: quant_i8.c's AVX-512 VNNI kernel (the
    native build of such a CPU) gives bitwise quant_i8_avx2.c's outputs (its -mno-avx512f build),
    residual plane included, at odd shapes, one and two threads."""
    if not (quant_ops.vnni("native") and i8_avx2("avx2")):
        pytest.skip("needs the AVX-512 VNNI build and the AVX2 one (an AVX-512 VNNI CPU)")
    values = BLOCKS[qtype][0]
    prev = torch.get_num_threads()
    try:
        for rows, nb in ((17, 3 if values == 256 else 20), (37, 1 if values == 256 else 3)):
            cols = nb * values
            qt = random_blocks(qtype, rows, cols, rows)
            x = torch.randn(33, cols, generator=torch.Generator().manual_seed(nb))
            x[4, :32] = 0.0
            x[::4, 3] = 50.0  # outliers: residual planes
            bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
            for threads in (1, 2):
                torch.set_num_threads(threads)
                for t in (1, 3, 8, 9, 16, 17, 33):
                    a = quant_ops.matmul(qt, x[:t], bias, mode="prefill", isa="native")
                    b = quant_ops.matmul(qt, x[:t], bias, mode="prefill", isa="avx2")
                    assert torch.equal(a, b), (qtype, rows, cols, t, threads)
    finally:
        torch.set_num_threads(prev)
