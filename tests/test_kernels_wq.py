"""The Triton W4A16 / W8A16 GEMM (kernels/wq_gemm.py) against its torch reference: on the CPU
through Triton's interpreter at small ragged shapes, compiled on CUDA (scripts/gpu_check.sh)."""

from __future__ import annotations

import importlib

import pytest
import torch

from loom.kernels.interpret import load_interpreted

DEV = "cuda" if torch.cuda.is_available() else "cpu"
wq = importlib.import_module("loom.kernels.wq_gemm") if DEV == "cuda" else load_interpreted("wq_gemm")


def case(m: int, n: int, k: int, bits: int, group: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    q, s, z = wq.pack(w, bits, group)
    x = torch.randn(m, k, generator=g).to(dtype)
    return w, x.to(DEV), q.to(DEV), s.to(DEV), z.to(DEV)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m,n,k,group", [(1, 37, 64, 32), (5, 70, 96, 32), (33, 16, 128, 64),
                                         (3, 129, 256, 128)])  # fmt: skip
def test_wq_gemm_equals_reference_fp32(m, n, k, group, bits):
    _, x, q, s, z = case(m, n, k, bits, group, torch.float32)
    got = wq.wq_gemm(x, q, s, z, bits, group)
    torch.testing.assert_close(got, wq.wq_gemm_ref(x, q, s, z, bits, group), rtol=1e-5, atol=1e-4)


# bfloat16 only on CUDA: Triton's interpreter computes bfloat16 wrongly (numpy has none), as
# tests/test_kernels.py notes
HALVES = [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", HALVES)
def test_wq_gemm_half_activations(bits, dtype):
    _, x, q, s, z = case(7, 40, 64, bits, 32, dtype, seed=1)
    got = wq.wq_gemm(x.reshape(7, 1, 64), q, s, z, bits, 32)  # leading dims kept
    assert got.dtype == dtype and got.shape == (7, 1, 40)
    ref = wq.wq_gemm_ref(x, q, s, z, bits, 32)
    torch.testing.assert_close(got.reshape(7, 40).float(), ref.float(), rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_dequantizes_within_half_a_step(bits):
    w = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    q, s, z = wq.pack(w, bits, 32)
    back = wq.dequantize(q, s, z, bits, 32)
    step = s.repeat_interleave(32, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert q.shape == (9, 96 * bits // 8)


def test_wq_gemm_rejects_bad_shapes():
    _, x, q, s, z = case(2, 16, 64, 4, 32, torch.float32)
    with pytest.raises(ValueError, match="q must be uint8"):
        wq.wq_gemm(x, q, s, z, 8, 32)
    with pytest.raises(ValueError, match="group 48"):
        wq.wq_gemm(x, q, s, z, 4, 48)
    with pytest.raises(ValueError, match="scales must be"):
        wq.wq_gemm(x, q, s[:, :1], z, 4, 32)
