"""Launch helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton


def block(n: int, floor: int = 16) -> int:
    """The power-of-two tile that covers n (tl.dot wants every dimension >= 16)."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs: full-precision dot (the default would round through tf32 on Ampere+, and
    the kernels must equal their fp32 references); half types: the default."""
    return "ieee" if dtype == torch.float32 else None


def interpreted() -> bool:
    """Whether kernels defined now run on Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return bool(triton.knobs.runtime.interpret)
