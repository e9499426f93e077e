"""RMSNorm with the residual add fused in: one read of x and residual, one write of each.

The reference is loom.runtime.layers.norm.RMSNorm.forward: x + residual in the activation
dtype, the norm in float32, the result cast back to that dtype, then times the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loom.kernels._util import interpreted

INTERPRETED = interpreted()


@triton.jit
def _rmsnorm_kernel(
    X, Res, W, Out, ResOut, stride_x, stride_r, stride_o, stride_ro, N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(Res + t * stride_r + offs, mask=mask, other=0.0)
        # the sum rounded once to the activation dtype, as torch's x + residual is
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + t * stride_ro + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    h = (h * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * h.to(tl.float32)).to(Out.dtype.element_ty)
    tl.store(Out + t * stride_o + offs, out, mask=mask)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """x [..., N] -> norm(x) or, with `residual`, (norm(x + residual), x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n = x2.shape[1]
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    res_out, r2 = None, x2
    if residual is not None:
        r2 = residual.reshape(-1, n).contiguous()
        res_out = torch.empty_like(x2)
    if x2.shape[0]:
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out if res_out is not None else out,
            x2.stride(0), r2.stride(0), out.stride(0),
            (res_out if res_out is not None else out).stride(0),
            n, eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
        )  # fmt: skip
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rmsnorm_ref(x, weight, eps, residual=None):
    from loom.runtime.layers.norm import RMSNorm

    norm = RMSNorm(x.shape[-1], eps).to(x.device)
    norm.weight.data = weight
    return norm(x, residual)
