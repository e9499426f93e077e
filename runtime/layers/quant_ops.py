"""ctypes binding of the quantized-weight kernels (kernels/cpu/quant.c): matmul and row gather
on QuantizedTensors, with the plain-torch reference (kernels/quant_ref.py) as the fallback
where no C compiler is found.

Activation handling (`mode`): "int8" quantizes activations per block of 32 (ggml's q8
activations) and takes integer dot products (AVX-512 VNNI where the CPU has it); "int16"
(Q8_0 / Q4_0 / Q4_1, up to 8 tokens) quantizes them to 16 bits per block of 32, as two int8
halves and two integer dot products (SmolLM2's top-1 against f32 weights: 100% over 2,000
tokens, int8's 96.4%), other types taking "int8" in that mode; "f32"
dequantizes each weight row into L1 and multiplies by FMA, without rounding the activations;
up to 8 tokens in an AVX-512 build it expands the blocks (every type) to f32 in registers
instead (quant.c matmul_f32v), faster than "int16" at 1..8 tokens there.
"bi" (kernels/cpu/quant_bi.c) takes the 16-bit activations for every type and token count with
one arithmetic per token, so a token's outputs are bitwise the same alone or in any batch.
"auto" (the default) chooses per call in quant.c: "bi" at every token count for every block
type where the build has AVX-512 VNNI (its 1..8-token kernel takes 16 rows as the lanes of
integer dot products: 1.3x the f32 GEMV's speed at one token and 1.5x at eight on SmolLM2,
2-3.5x on Gemma 3's Q4_K / Q6_K, docs/benchmarks.md "Issue 32: the 16-row-lane kernel" and
"Gemma 3's K-types on the lanes kernel"), so a token's outputs never depend on the batch; in
other builds the f32 GEMV where it exists (AVX-512F without VNNI, up to 8 tokens), "bi"
otherwise. There a token's outputs are the same in every forward of up to 8 rows (a batch-1
decode step and its speculative verify steps) and in every forward above 8, and differ between
the two in the last bits; "bi" alone is invariant for all.
"prefill" (kernels/cpu/quant_i8.c; --quantized-matmul prefill-int8: the compiled forward's
matmuls on prompt steps, cpu_forward.py) quantizes the activations
to 8 bits per block of 32 (a second 8-bit plane for the rounding error of blocks an outlier
makes coarse) and takes vpdpbusd (64 multiply-adds an instruction, twice "bi"'s)
for every block type in AVX-512 VNNI builds, one arithmetic for every token count; "auto"
elsewhere.
"""

from __future__ import annotations

import ctypes

import torch

from loom.runtime import native
from loom.runtime.cpu_abi import MODES, QTYPES
from loom.runtime.layers.quant_types import QuantizedTensor

DEFAULT_MODE = "auto"
# instruction-set variants (native.ISA_FLAGS): "native" takes the VNNI path on CPUs with
# AVX-512 VNNI; "avx2" (AVX-512 off) the plain C path every other CPU takes


def load(isa: str = "native") -> ctypes.CDLL | None:
    """loom's C library (runtime/native.py: kernels/cpu/*.c, quant.c among them) for the `isa`
    variant; None without a C compiler."""
    return native.load(isa)


def resolve_mode(mode: str | None = None) -> str:
    """`mode`, None meaning DEFAULT_MODE ("prefill" there: "auto", as the decode rows of the
    compiled forward, which alone takes "prefill" on prompt steps). "auto" is resolved per call
    by quant.c (T and type)."""
    m = mode or DEFAULT_MODE
    return "auto" if mode is None and m == "prefill" else m


# multiply-adds per thread below which another thread costs more than it saves
_GRAIN = 1 << 16


def _threads(work: int) -> int:
    return max(1, min(torch.get_num_threads(), work // _GRAIN))


def matmul(
    qt: QuantizedTensor,
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    mode: str | None = None,
    isa: str = "native",
) -> torch.Tensor:
    """x [..., cols] -> float32 [..., rows] = x @ W.T (+ bias). `out`: a float32 view [T, rows]
    whose rows may be strided (a column slice of a wider output). mode: MODES (None: the
    module's DEFAULT_MODE; "auto": resolve_mode)."""
    rows, cols = qt.shape
    mode = resolve_mode(mode)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols).to(torch.float32).contiguous()
    t = x2.shape[0]
    if out is None:
        out = torch.empty(t, rows, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.stride(1) == 1 and tuple(out.shape) == (t, rows)
    if t == 0:  # no rows (a prefill chunk that needs no logits): nothing to read. The
        # reference below would dequantize the whole matrix for nothing (Gemma 3's head:
        # 671 MB and ~1 s)
        return out.reshape(*lead, rows)
    lib = load(isa) if x2.device.type == "cpu" else None
    if lib is None:
        from loom.kernels.quant_ref import matmul_ref

        out.copy_(matmul_ref(qt.qtype, qt.data, qt.shape, x2) + (0 if bias is None else bias))
        return out.reshape(*lead, rows)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    rc = lib.loom_q_matmul(
        QTYPES[qt.qtype], MODES[mode], qt.data.data_ptr(), rows, cols, qt.row_bytes,
        x2.data_ptr(), t, cols, None if b is None else b.data_ptr(), out.data_ptr(), out.stride(0),
        0, _threads(rows * cols * t),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"loom_q_matmul({qt.qtype}, {qt.shape}) failed: {rc}")
    return out.reshape(*lead, rows)


def rows(qt: QuantizedTensor, ids: torch.Tensor, isa: str = "native") -> torch.Tensor:
    """The dequantized rows `ids` [...] -> float32 [..., cols] (an embedding lookup)."""
    n, cols = qt.shape
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
        raise IndexError(f"row id out of range [0, {n})")
    lib = load(isa) if flat.device.type == "cpu" else None
    if lib is None:
        from loom.kernels.quant_ref import dequantize_ref

        picked = qt.data.index_select(0, flat)
        return dequantize_ref(qt.qtype, picked, (flat.numel(), cols)).reshape(*ids.shape, cols)
    out = torch.empty(flat.numel(), cols, dtype=torch.float32)
    rc = lib.loom_q_rows(
        QTYPES[qt.qtype], qt.data.data_ptr(), n, cols, qt.row_bytes, flat.data_ptr(),
        flat.numel(), out.data_ptr(), _threads(flat.numel() * cols * 8),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"loom_q_rows({qt.qtype}) failed: {rc}")
    return out.reshape(*ids.shape, cols)


def vnni(isa: str = "native") -> bool:
    """Whether the `isa` build takes the AVX-512 VNNI int8 path."""
    lib = load(isa)
    return bool(lib is not None and lib.loom_q_vnni())
