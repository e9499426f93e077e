"""The fused CPU norm and RoPE kernels (runtime/cpu_kernels.py) against the layers' eager
reference paths, on the layouts the models hand them (strided views of the qkv output)."""

from __future__ import annotations

import pytest
import torch

from loom.runtime import cpu_kernels
from loom.runtime.layers.norm import RMSNorm
from loom.runtime.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")


def _norm(dim: int) -> RMSNorm:
    norm = RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    return norm


@torch.inference_mode()
def test_rms_norm_matches_the_reference_with_and_without_residual():
    g = torch.Generator().manual_seed(0)
    norm = _norm(96)
    x = torch.randn(7, 96, generator=g) * 3
    res = torch.randn(7, 96, generator=g)
    assert cpu_kernels.fusable(x)
    torch.testing.assert_close(norm(x), norm.reference(x), atol=1e-6, rtol=1e-5)
    out, new_res = norm(x, res)
    want_out, want_res = norm.reference(x, res)
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-5)


@torch.inference_mode()
def test_rms_norm_of_heads_in_a_strided_view():
    """Qwen3's q/k norm: [T, H, D] rows of a slice of the fused qkv output."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 4 * 32 + 2 * 2 * 32, generator=g)
    k = qkv[:, 4 * 32 : 6 * 32].reshape(5, 2, 32)
    assert not k.is_contiguous()
    norm = _norm(32)
    torch.testing.assert_close(norm(k), norm.reference(k), atol=1e-6, rtol=1e-5)
    one = torch.randn(32, generator=g)  # a single row, 1-D
    torch.testing.assert_close(norm(one), norm.reference(one), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0}])
@torch.inference_mode()
def test_rope_matches_the_reference_on_strided_q_and_k(scaling):
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(64, 512, 10000.0, scaling)
    qkv = torch.randn(9, (4 + 2 + 2) * 64, generator=g)
    q = qkv[:, : 4 * 64].reshape(9, 4, 64)
    k = qkv[:, 4 * 64 : 6 * 64].reshape(9, 2, 64)
    positions = torch.tensor([0, 1, 2, 7, 300, 511, 3, 4, 5])
    got_q, got_k = rope(positions, q, k)
    want_q, want_k = rope.reference(positions, q, k)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    with pytest.raises(IndexError):
        rope(torch.tensor([512]), q[:1], k[:1])


def test_autograd_and_other_dtypes_take_the_eager_path():
    norm = _norm(16)
    x = torch.randn(3, 16, requires_grad=True)
    assert not cpu_kernels.fusable(x)
    norm(x).sum().backward()  # the eager path has a backward
    assert x.grad is not None
    assert not cpu_kernels.fusable(torch.randn(3, 16, dtype=torch.bfloat16))


def test_rotary_tables_are_shared_by_equal_ropes():
    """Layers with the same rope share one cos / sin table (30 identical 4 MB pairs were 120 MB
    of SmolLM2's resident set); a different base or scaling gets its own, equal to a fresh one."""
    from loom.runtime.layers.rotary import RotaryEmbedding

    a = RotaryEmbedding(64, 4096, 10000.0)
    b = RotaryEmbedding(64, 4096, 10000.0)
    c = RotaryEmbedding(64, 4096, 500000.0)
    d = RotaryEmbedding(64, 4096, 10000.0, {"rope_type": "linear", "factor": 2.0})
    assert a.cos_cache.data_ptr() == b.cos_cache.data_ptr()
    assert a.sin_cache.data_ptr() == b.sin_cache.data_ptr()
    assert c.cos_cache.data_ptr() != a.cos_cache.data_ptr()
    assert d.cos_cache.data_ptr() != a.cos_cache.data_ptr()
    pos = torch.arange(4096, dtype=torch.float32)[:, None]
    for emb, base, f in ((a, 10000.0, 1.0), (c, 500000.0, 1.0), (d, 10000.0, 2.0)):
        inv = 1.0 / base ** (torch.arange(0, 64, 2).float() / 64) / f
        torch.testing.assert_close(emb.cos_cache, torch.cat([pos * inv] * 2, -1).cos())
