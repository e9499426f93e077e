from __future__ import annotations

import torch
from torch import nn

from loom.runtime import cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as the Llama/Qwen references do. On the CPU in float32
    it is one fused C call (cpu_kernels.rms_norm) instead of about ten eager ops."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the fused pre-norm step."""
        if cpu_kernels.fusable(x) and self.weight.dtype == torch.float32:
            if residual is None or cpu_kernels.fusable(residual):
                return cpu_kernels.rms_norm(x, self.weight, self.eps, residual)
        return self.reference(x, residual)

    def reference(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)
