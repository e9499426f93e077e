"""--kv-cache-dtype: the KV pool stored in bfloat16 (half float32's bytes), read back by every
attention path into float32 math; the values SGLang accepts but loom has not built are refused
by name. Greedy outputs on the bundled model against a float32 pool, with a tolerance on the
logprobs that a broken read (wrong dtype, wrong rounding) would exceed."""

from __future__ import annotations

import pytest
import torch

from loom.runtime.memory_pool import resolve_kv_dtype
from loom.runtime.server_args import BUNDLED_MODEL_PATH, ServerArgs
from tests.runtime_helpers import greedy, make_scheduler, run_all, submit

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Q: What is the capital of France? A: Paris.\nQ: What is the capital of Germany? A:",
    "def add(a, b): return a + b\ndef sub(a, b): return a - b\ndef mul(a, b):",
    "Repeat after me: red green blue, red green blue, red green",
    "Once upon a time there was a little fox who",
    "1, 2, 3, 4, 5,",
]


@pytest.mark.parametrize("value", ["fp8_e5m2", "fp8_e4m3", "fp4_e2m1"])
def test_unbuilt_kv_dtypes_are_refused_by_name(value):
    with pytest.raises(ValueError, match=rf"^kv_cache_dtype: '{value}' is not supported yet"):
        ServerArgs(kv_cache_dtype=value)


def test_unknown_kv_dtype_and_the_triton_combination_are_refused():
    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of"):
        ServerArgs(kv_cache_dtype="int4")
    assert resolve_kv_dtype("auto", torch.float32, "cpu_paged") == torch.float32
    assert resolve_kv_dtype("bf16", torch.float32, "torch") == torch.bfloat16
    assert resolve_kv_dtype("bfloat16", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_dtype("float32", torch.bfloat16, "cpu_paged") == torch.float32  # a pin
    with pytest.raises(ValueError, match="^kv_cache_dtype: 'bf16' with a torch.float32 model"):
        resolve_kv_dtype("bf16", torch.float32, "triton")


def _run(**kw):
    sched = make_scheduler(BUNDLED_MODEL_PATH, **kw)
    # the C forward runs unless the test turns it off (a bfloat16 pool included)
    assert (sched.runner.cpu_forward is None) == (
        kw.get("cpu_forward") == "eager" or kw.get("attention_backend") == "torch"
    )
    for i, text in enumerate(TEXTS):
        ids = sched.tokenizer.encode(text)
        submit(sched, f"p{i}", ids, greedy(24), return_logprob=True, top_logprobs_num=0)
    return run_all(sched), sched.runner.token_to_kv_pool


def _logprobs(res):
    return torch.tensor(
        [[lp for lp, *_ in res[f"p{i}"].output_logprobs] for i in range(len(TEXTS))]
    )


def test_bf16_pool_greedy_outputs_match_float32():
    """The bundled model (float32 weights) with its KV in bfloat16, through the compiled C
    forward (cpu_forward: its own bf16 store and attention), the eager layers on the cpu_paged
    backend (C kernels, f32 accumulation) and the torch backend: the same greedy tokens as a
    float32 pool on this prompt set (measured: 6 x 24 of 6 x 24), output logprobs within 0.05
    of float32's (measured max 0.0055), the two eager backends within float error of each
    other (measured 7e-6), and the C forward within 5e-3 of them (it reads a prompt's own K / V
    back rounded, where the eager layers use them unrounded)."""
    ref, ref_pool = _run()
    paged, pool = _run(kv_cache_dtype="bf16", cpu_forward="eager")
    plain, _ = _run(kv_cache_dtype="bfloat16", attention_backend="torch")
    fast, fast_pool = _run(kv_cache_dtype="bf16")
    assert ref_pool.k_buffers[0].dtype == torch.float32
    assert pool.k_buffers[0].dtype == pool.v_buffers[0].dtype == torch.bfloat16
    assert fast_pool.k_buffers[0].dtype == torch.bfloat16
    assert pool.bytes_per_token() * 2 == ref_pool.bytes_per_token()
    for i in range(len(TEXTS)):
        assert paged[f"p{i}"].ids == ref[f"p{i}"].ids == plain[f"p{i}"].ids, i
        assert fast[f"p{i}"].ids == paged[f"p{i}"].ids, i
    err = (_logprobs(paged) - _logprobs(ref)).abs().max().item()
    assert 0 < err < 0.05, err  # 0 would mean the pool's rounding never reached attention
    err = (_logprobs(fast) - _logprobs(ref)).abs().max().item()
    assert 0 < err < 0.05, err
    torch.testing.assert_close(_logprobs(paged), _logprobs(plain), atol=1e-4, rtol=0)
    torch.testing.assert_close(_logprobs(fast), _logprobs(paged), atol=5e-3, rtol=0)
