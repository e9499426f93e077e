"""Plain-torch references for ggml's block-quantized weights: dequantize every block type, and
quantize float weights to Q8_0 / Q4_0 / Q4_1 (loom's `--quantization int8|int4`).

The C kernels (kernels/cpu/quant.c) are tested against `dequantize_ref` (and it against
`gguf.quants.dequantize`, ggml's own Python reference, on real files). Layouts, per block:
  Q8_0  f16 d | 32 x int8 q                          value = d q
  Q4_0  f16 d | 16 bytes: q[j] low nibble, q[j+16] high   value = d (q - 8)
  Q4_1  f16 d | f16 m | 16 bytes as Q4_0               value = d q + m
  Q4_K  f16 d | f16 dmin | 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32 | 128 bytes:
        each 32 bytes hold sub-block 2c (low nibbles) and 2c+1 (high)   value = d sc q - dmin m
  Q6_K  128 bytes low 4 bits | 64 bytes high 2 bits | 16 x int8 scales | f16 d
        value = d sc (q - 32), 16 sub-blocks of 16
  Q5_0  f16 d | 4 bytes qh (bit j: value j's 5th bit) | 16 bytes as Q4_0   value = d (q - 16)
  Q5_1  f16 d | f16 m | qh | 16 bytes as Q4_0           value = d q + m
"""

from __future__ import annotations

import torch


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian -> float32 [...]"""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: the low nibbles, then the high ones."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1).to(torch.float32)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]).unsqueeze(-1) * b[:, 2:].view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]).unsqueeze(-1) * (_nibbles(b[:, 2:]) - 8)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]).unsqueeze(-1) * _nibbles(b[:, 4:]) + _f16(b[:, 2:4]).unsqueeze(-1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, :2]).unsqueeze(-1), _f16(b[:, 2:4]).unsqueeze(-1)
    q = b[:, 4:16].long()
    lo_sc, lo_m = q[:, :4] & 63, q[:, 4:8] & 63  # sub-blocks 0..3
    hi_sc = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)  # sub-blocks 4..7
    hi_m = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    sc = torch.cat([lo_sc, hi_sc], 1).float()  # [n, 8]
    mn = torch.cat([lo_m, hi_m], 1).float()
    qs = b[:, 16:].view(-1, 4, 32)
    vals = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32).float()  # sub-block order
    return (
        d.unsqueeze(-1) * sc.unsqueeze(-1) * vals - dmin.unsqueeze(-1) * mn.unsqueeze(-1)
    ).reshape(-1, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, :128].view(-1, 2, 64).long(), b[:, 128:192].view(-1, 2, 32).long()
    sc = b[:, 192:208].view(torch.int8).float().view(-1, 16)
    d = _f16(b[:, 208:210]).unsqueeze(-1)
    lo, hi = ql[..., :32], ql[..., 32:]
    q = torch.stack(
        [
            (lo & 0xF) | ((qh & 3) << 4),
            (hi & 0xF) | (((qh >> 2) & 3) << 4),
            (lo >> 4) | (((qh >> 4) & 3) << 4),
            (hi >> 4) | (((qh >> 6) & 3) << 4),
        ],
        dim=2,
    )  # [n, 2 halves, 4 quarters, 32]
    q = (q - 32).float().reshape(-1, 16, 16)  # 16 sub-blocks of 16, in value order
    return (d.unsqueeze(-1) * sc.unsqueeze(-1) * q).reshape(-1, 256)


def _five_bit(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """qh [n, 4] little-endian bits and qs [n, 16] nibbles -> the 32 five-bit codes."""
    bits = (qh.long().unsqueeze(-1) >> torch.arange(8)) & 1  # [n, 4 bytes, 8]: bit 8 i + j
    return _nibbles(qs) + 16 * bits.reshape(-1, 32).float()


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]).unsqueeze(-1) * (_five_bit(b[:, 2:6], b[:, 6:]) - 16)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, :2]).unsqueeze(-1), _f16(b[:, 2:4]).unsqueeze(-1)
    return d * _five_bit(b[:, 4:8], b[:, 8:]) + m


_DEQUANT = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q4_K": _q4_k,
    "Q6_K": _q6_k,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
}


def dequantize_ref(qtype: str, data: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """uint8 [rows, row_bytes] blocks -> float32 [rows, cols]."""
    from loom.runtime.layers.quant_types import BLOCKS

    values, nbytes = BLOCKS[qtype]
    blocks = data.contiguous().view(-1, nbytes)
    return _DEQUANT[qtype](blocks).reshape(shape)


def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def quantize_ref(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float [rows, cols] -> uint8 [rows, row_bytes] in `qtype` (Q8_0, Q4_0 or Q4_1), as ggml's
    reference quantizers round: Q8_0 d = max|w| / 127; Q4_0 d = (the signed value of largest
    magnitude) / -8; Q4_1 d = (max - min) / 15, m = min. Codes round to nearest."""
    rows, cols = w.shape
    if cols % 32:
        raise ValueError(f"{qtype}: {cols} columns are not whole blocks of 32")
    b = w.detach().float().reshape(-1, 32)
    if qtype == "Q8_0":
        d = b.abs().amax(1) / 127
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = (b * inv.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8)
        out = torch.cat([_to_f16_bytes(d), q.view(torch.uint8)], 1)
    elif qtype == "Q4_0":
        idx = b.abs().argmax(1, keepdim=True)
        d = b.gather(1, idx).squeeze(1) / -8
        inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
        q = (b * inv.unsqueeze(1) + 8.5).floor().clamp(0, 15).to(torch.uint8)
        out = torch.cat([_to_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], 1)
    elif qtype == "Q4_1":
        lo, hi = b.amin(1), b.amax(1)
        d = (hi - lo) / 15
        inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        q = ((b - lo.unsqueeze(1)) * inv.unsqueeze(1) + 0.5).floor().clamp(0, 15).to(torch.uint8)
        out = torch.cat([_to_f16_bytes(d), _to_f16_bytes(lo), q[:, :16] | (q[:, 16:] << 4)], 1)
    else:
        raise ValueError(f"quantize_ref makes Q8_0, Q4_0 or Q4_1, not {qtype!r}")
    return out.reshape(rows, -1).contiguous()


def matmul_ref(
    qtype: str, data: torch.Tensor, shape: tuple[int, int], x: torch.Tensor
) -> torch.Tensor:
    """x [T, cols] @ W.T in float32 with W dequantized (the quantized matmul's reference)."""
    return x.float() @ dequantize_ref(qtype, data, shape).T


def quantize_act_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 as the int8 kernels see it: per block of 32, scale d = max|x| / 127 and
    codes rounded half away from zero (C's roundf), returned dequantized (d * code)."""
    t, k = x.shape
    b = x.float().reshape(t, k // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = b * inv
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)
    return (q * d).reshape(t, k)


def quantize_act16_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] float32 as quant.c's 16-bit kernels (LOOM_Q_I16) see it: per block of 32, scale
    d = max|x| / 32512 and codes rounded half away from zero, returned dequantized (d * code).
    (The kernel splits each code into two int8 halves, 255 * hi + lo: exact, so not modelled.)"""
    t, k = x.shape
    b = x.float().reshape(t, k // 32, 32)
    d = b.abs().amax(-1, keepdim=True) / 32512
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    v = b * inv
    q = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-32512, 32512)
    return (q * d).reshape(t, k)
