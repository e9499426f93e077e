"""The C forward's ABI without torch: the ctypes mirrors of kernels/cpu/loom_cpu.h's structs
(checked against the library's own layout when it loads) and the library loader.

Both bindings of the C forward build these structs: runtime/cpu_forward.py over a torch
model's parameters and pool, runtime/cpu_model.py over numpy arrays (the torch-free path), so
neither owns a copy of the layout.
"""

from __future__ import annotations

import ctypes
import functools

from loom.runtime import native

PANEL = 16  # output rows per packed panel (the C kernel's PANEL)
# ggml block type -> the C kernels' code (quant.c), and matmul mode -> its code
QTYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4, "Q5_0": 5, "Q5_1": 6}
MODES = {"int8": 0, "f32": 1, "int16": 2, "bi": 3, "auto": 4, "prefill": 5}

_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class _QSeg(ctypes.Structure):
    """Output rows row0 .. row0 + rows of a block-quantized weight, in one block type."""

    _fields_ = [*[(n, _I64) for n in ("qtype", "row0", "rows", "row_bytes")], ("data", _P)]


class _QMat(ctypes.Structure):
    _fields_ = [("nseg", _I64), ("seg", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        (name, _P)
        for name in (
            "ln1", "qkv_w", "qkv_b", "q_norm", "k_norm", "o_w", "o_b",
            "ln2", "gu_w", "gu_b", "down_w", "down_b", "k_cache", "v_cache",
            "qkv_p", "o_p", "gu_p", "down_p",  # packed panels (pack()); NULL: row-major tiles
            "qkv_q", "o_q", "gu_q", "down_q",  # _QMat of a quantized weight; NULL: float
            # Gemma 3 (NULL for Llama): post-attention / post-MLP norms, the layer's RoPE tables
            "post_attn_ln", "post_ff_ln", "cos", "sin",
        )
    ] + [("window", _I64)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [
        *[(n, _I64) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter", "vocab")],
        ("layers", _I64),
        ("max_pos", _I64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(n, _P) for n in ("embed", "norm", "lm_head", "cos", "sin")],
        ("layer", ctypes.POINTER(_Layer)),
        ("lm_head_p", _P),
        ("embed_q", _P),
        ("lm_head_q", _P),
        ("q_mode", _I64),
        ("act", _I64),  # 1: gelu(tanh)-gated MLP (Gemma), 0: SiLU
        ("embed_scale", ctypes.c_float),
        ("norm_add", ctypes.c_float),  # RMSNorm scales by norm_add + weight (Gemma: 1)
        ("kv_bf16", _I64),
    ]


@functools.cache
def load(isa: str = "native") -> ctypes.CDLL | None:
    """loom's C library for the `isa` variant (native.ISA_FLAGS; native.load: built once per
    machine, cached), its Layer / Model checked against these ctypes structs; None without a
    working C compiler."""
    lib = native.load(isa)
    if lib is not None:
        native.check_layout(lib, "Layer", _Layer)
        native.check_layout(lib, "Model", _Model)
        native.check_layout(lib, "QSeg", _QSeg)
        native.check_constants(lib, {"PANEL": PANEL})
    return lib
