"""CPU attention that reads K/V in place from the paged pool, and the fused norm / RoPE of the
eager layers: Python wrappers over kernels/cpu/attention.c.

The plain torch decode path gathers every request's K and V rows into a padded [B, L] copy on
every layer of every step, then runs SDPA with a padding mask (whose CPU kernel is tuned for
long queries, not one query row). The C kernels walk each request's row of the req-to-token
table instead, with no copy and no padding. The library is loom's one C library
(`native.load`); `load()` returns None where it does not build and callers fall back to torch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from loom.runtime import native

_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The C library (native.load: built on first use); None without a C compiler."""
    global _lib
    _lib = native.load()
    return _lib


# multiply-adds per thread below which another thread costs more (team start-up and the
# barrier, which on a loaded machine waits for a descheduled thread) than it saves
_GRAIN = 1 << 17


def _threads(items: int, work: int) -> int:
    return max(1, min(torch.get_num_threads(), items, work // _GRAIN))


_KERNELS = {torch.float32: "loom_decode_f32", torch.bfloat16: "loom_decode_bf16"}


def supports(dtype: torch.dtype) -> bool:
    return dtype in _KERNELS


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    scale: float,
    total_len: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] over the K/V rows table[rows[b], :lens[b]] -> [B, H, Dv] in q's dtype.
    `total_len` (sum of lens, default B * max_len) sizes the thread team."""
    b, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and table.is_contiguous()
    assert table.dtype == rows.dtype == lens.dtype == torch.int64
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((b, h, dv), dtype=torch.float32)
    getattr(lib, _KERNELS[k_buf.dtype])(
        qf.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(), table.stride(0),
        rows.data_ptr(), lens.data_ptr(), out.data_ptr(), b, h, hkv, d, dv, scale, max_len,
        _threads(b * hkv, (total_len or b * max_len) * h * (d + dv)),
    )  # fmt: skip
    return out if q.dtype == torch.float32 else out.to(q.dtype)


_EXTEND_KERNELS = {torch.float32: "loom_extend_f32", torch.bfloat16: "loom_extend_bf16"}


@dataclass
class ExtendPlan:
    """One step's per-request layout for `extend_attention`, built once and read by every
    layer: request b's new tokens are q rows qstart[b] .. qstart[b] + exts[b] - 1 and attend to
    its first lens[b] KV positions, causally or through its mask (packed at mask_off[b])."""

    lens: torch.Tensor  # [B] int64
    exts: torch.Tensor  # [B] int64
    qstart: torch.Tensor  # [B] int64
    mask: torch.Tensor  # [sum of masked E * L] uint8 (one zero byte when no request has one)
    mask_off: torch.Tensor  # [B] int64, -1: causal
    max_len: int
    max_ext: int
    total_len: int  # sum over requests of exts * lens: the score count, which sizes the team

    @classmethod
    def build(
        cls, seq_lens: list[int], ext_lens: list[int], masks: list[torch.Tensor | None] | None
    ) -> ExtendPlan:
        masks = masks or [None] * len(seq_lens)
        offs, parts, off, start, starts = [], [], 0, 0, []
        for seq, ext, m in zip(seq_lens, ext_lens, masks):
            starts.append(start)
            start += ext
            if m is None:
                offs.append(-1)
                continue
            if tuple(m.shape) != (ext, seq):
                raise ValueError(f"custom mask of shape {tuple(m.shape)}, expected {(ext, seq)}")
            parts.append(m.reshape(-1).to(device="cpu", dtype=torch.uint8))
            offs.append(off)
            off += ext * seq
        i64 = torch.int64
        return cls(
            lens=torch.tensor(seq_lens, dtype=i64),
            exts=torch.tensor(ext_lens, dtype=i64),
            qstart=torch.tensor(starts, dtype=i64),
            mask=torch.cat(parts) if parts else torch.zeros(1, dtype=torch.uint8),
            mask_off=torch.tensor(offs, dtype=i64),
            max_len=max(seq_lens, default=0),
            max_ext=max(ext_lens, default=0),
            total_len=sum(e * s for e, s in zip(ext_lens, seq_lens)),
        )


def extend_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D] (every request's new tokens, in order) over the K/V rows
    table[rows[b], :plan.lens[b]], masked per `plan` -> [T, H, Dv] in q's dtype. The new
    tokens' K/V must already be in the pool."""
    t, h, d = q.shape
    hkv, dv = k_buf.shape[1], v_buf.shape[2]
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and table.is_contiguous()
    assert table.dtype == rows.dtype == torch.int64 and t == int(plan.exts.sum())
    qf = q.to(torch.float32).contiguous()
    out = torch.empty((t, h, dv), dtype=torch.float32)
    b = len(plan.lens)
    getattr(lib, _EXTEND_KERNELS[k_buf.dtype])(
        qf.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), table.data_ptr(), table.stride(0),
        rows.data_ptr(), plan.lens.data_ptr(), plan.exts.data_ptr(), plan.qstart.data_ptr(),
        plan.mask.data_ptr(), plan.mask_off.data_ptr(), out.data_ptr(), b, h, hkv, d, dv,
        scale, plan.max_len, plan.max_ext, _threads(b * hkv, plan.total_len * h * (d + dv)),
    )  # fmt: skip
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused norm / RoPE kernels can take x: float32 on the CPU, rows contiguous,
    no autograd (the kernels have no backward), and the library built."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.stride(-1) == 1
        and not (torch.is_grad_enabled() and x.requires_grad)
        and (_lib is not None or load() is not None)
    )


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """x [N, D] or [T, H, D] (last dim contiguous) as (outer count, inner count, outer
    stride, inner stride) of its D-long rows."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """RMSNorm of x's last dimension (float32); with `residual`, of x + residual, returning
    (normed, x + residual) as RMSNorm.forward does. Outputs are contiguous."""
    shape, d = x.shape, x.shape[-1]
    if x.dim() == 1 or x.dim() > 3:
        x = x.reshape(-1, d)
    no, ni, so, si = _rows(x)
    out = torch.empty(shape, dtype=torch.float32)
    res_out = None
    if residual is not None:
        assert residual.shape == shape and residual.dtype == torch.float32
        residual = residual.contiguous()
        res_out = torch.empty(shape, dtype=torch.float32)
    w = weight.contiguous()
    _lib.loom_rms_norm_f32(
        x.data_ptr(), no, ni, so, si, d,
        residual.data_ptr() if residual is not None else None,
        res_out.data_ptr() if res_out is not None else None,
        w.data_ptr(), eps, out.data_ptr(), _threads(no * ni, no * ni * d * 4),
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Neox rotary embedding of x [T, H, D] (float32) at positions [T] with the float32
    tables cos/sin [max_pos, D]; a new contiguous tensor."""
    t, h, d = x.shape
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    assert positions.dtype == torch.int64 and positions.is_contiguous()
    out = torch.empty((t, h, d), dtype=torch.float32)
    _lib.loom_rope_f32(
        x.data_ptr(), t, h, x.stride(0), x.stride(1), d, positions.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), out.data_ptr(), _threads(t * h, t * h * d * 4),
    )  # fmt: skip
    return out
