"""The block step the attention kernels share: load a block of K/V rows by slot and fold it
into a running (max, sum, output) online softmax. Triton inlines @jit helpers into each kernel."""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def load_rows(Ptr, slot, head, stride_t, stride_h, offs, pmask, cmask, like):
    """Rows Ptr[slot[i], head, offs] (0 where masked), in `like`'s dtype."""
    rows = tl.load(
        Ptr + slot[:, None] * stride_t + head * stride_h + offs[None, :],
        mask=pmask[:, None] & cmask[None, :],
        other=0.0,
    )
    return rows.to(like.dtype)


@triton.jit
def fold_block(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold scores s [M, N] (masked entries -inf) and values v [N, DV] into the running max
    m_i, sum l_i and unnormalized output acc. A row that has seen nothing visible yet keeps
    m = -inf and is shifted by 0, not by -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
