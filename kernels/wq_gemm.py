"""Weight-only quantized GEMM for the GPU: W8A16 and W4A16, y = x @ dequant(W).T.

Layouts (the ones HF GPTQ / AWQ checkpoints are repacked into at load; `pack_w4` / `pack_w8`
make them from float weights):
  W8A16  q uint8 [N, K]: codes 0..255;   W4A16  q uint8 [N, K / 2]: code of column k in
         byte k // 2, the low nibble for even k, the high one for odd k (codes 0..15);
  scales [N, K / group] and zeros [N, K / group] in float32: w[n, k] = (q - zero) * scale of
  group k // group. A symmetric int8 format is zero 128 (q = int8 + 128), GPTQ's 4-bit one the
  checkpoint's stored zero.
Activations x [M, K] in float16 / bfloat16 / float32; the dequantized tile is cast to x's dtype
and multiplied by tl.dot with a float32 accumulator, output in x's dtype. Each program owns a
BLOCK_M x BLOCK_N output tile and walks K in BLOCK_K steps (BLOCK_K divides the group so a tile
row has one scale). The torch reference (`wq_gemm_ref`) dequantizes in float32, casts to x's
dtype and multiplies in float32, which is the kernel's order of rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels._util import dot_precision, interpreted

INTERPRETED = interpreted()


@triton.jit
def _wq_gemm_kernel(
    X, Q, S, Z, Y, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym, GROUP,
    BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mk = rk < K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=mm[:, None] & mk[None, :], other=0.0)  # fmt: skip
        wmask = mk[:, None] & mn[None, :]
        qrow = Q + rn[None, :].to(tl.int64) * stride_qn
        if BITS == 4:
            byte = tl.load(qrow + rk[:, None] // 2, mask=wmask, other=0).to(tl.int32)
            code = (byte >> ((rk[:, None] % 2) * 4)) & 0xF
        else:
            code = tl.load(qrow + rk[:, None], mask=wmask, other=0).to(tl.int32)
        g = rn[None, :].to(tl.int64) * stride_sn + (k0 // GROUP)
        scale = tl.load(S + g, mask=mn[None, :], other=0.0)
        zero = tl.load(Z + g, mask=mn[None, :], other=0.0)
        w = ((code.to(tl.float32) - zero) * scale).to(X.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision=PRECISION)
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
             acc.to(Y.dtype.element_ty), mask=mm[:, None] & mn[None, :])  # fmt: skip


def _check(x, q, scales, zeros, bits: int, group: int) -> tuple[int, int, int]:
    m, k = x.reshape(-1, x.shape[-1]).shape
    n = q.shape[0]
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if q.dtype != torch.uint8 or tuple(q.shape) != (n, k * bits // 8):
        raise ValueError(f"q must be uint8 [{n}, {k * bits // 8}], got {q.dtype} {tuple(q.shape)}")
    if group < 16 or group & (group - 1) or k % group:
        raise ValueError(f"group {group} must be a power of two >= 16 dividing K = {k}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, k // group):
            raise ValueError(f"{name} must be [{n}, {k // group}], got {tuple(t.shape)}")
    return m, n, k


def wq_gemm(x, q, scales, zeros, bits: int, group: int) -> torch.Tensor:
    """x [..., K] @ dequant(q).T -> [..., N] in x's dtype."""
    m, n, k = _check(x, q, scales, zeros, bits, group)
    x2 = x.reshape(m, k).contiguous()
    q, s, z = q.contiguous(), scales.float().contiguous(), zeros.float().contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        bm = max(16, min(64, triton.next_power_of_2(m)))
        bn, bk = 64, min(64, group)
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _wq_gemm_kernel[grid](
            x2, q, s, z, y, m, n, k, x2.stride(0), q.stride(0), s.stride(0), y.stride(0), group,
            BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=dot_precision(x.dtype),
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], n)


def dequantize(q, scales, zeros, bits: int, group: int) -> torch.Tensor:
    """float32 [N, K] of a packed weight."""
    n = q.shape[0]
    if bits == 4:
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(n, -1)
    else:
        codes = q
    k = codes.shape[1]
    s = scales.float().repeat_interleave(group, dim=1)[:, :k]
    z = zeros.float().repeat_interleave(group, dim=1)[:, :k]
    return (codes.float() - z) * s


def wq_gemm_ref(x, q, scales, zeros, bits: int, group: int) -> torch.Tensor:
    _check(x, q, scales, zeros, bits, group)
    w = dequantize(q, scales, zeros, bits, group).to(x.dtype).float()
    return (x.float() @ w.T).to(x.dtype)


def pack(w: torch.Tensor, bits: int, group: int):
    """float [N, K] -> (q, scales, zeros): asymmetric min/max codes per group (round to
    nearest), the layout above."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = torch.where(hi > lo, (hi - lo) / top, torch.ones_like(hi))
    zero = torch.round(-lo / scale)
    codes = torch.clamp(torch.round(g / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, top)
    codes = codes.to(torch.uint8).reshape(n, k)
    if bits == 4:
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return codes.contiguous(), scale, zero
