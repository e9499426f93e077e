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


@pytest.fixture(autouse=True)
def _torch_runner(monkeypatch):
    """These tests read the torch runner (its model, CpuForward, pools): ModelRunner for a GGUF
    model too (tests/test_array_runner.py compares the torch-free runner with it)."""
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")


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


# Spec-Bench's first warm-up instruction: with the bf16 pool as default, greedy NGRAM and
# EAGLE-3 on SmolLM2's Q4_1 target left plain decoding there at the 7th token (issue 33)
ASKS = ["Give me three tips for keeping houseplants alive in winter.", "Why do cats purr?"]


@pytest.mark.parametrize(
    "algorithm, forward", [("NGRAM", "auto"), ("EAGLE3", "auto"), ("NGRAM", "eager")]
)
def test_bf16_pool_greedy_speculation_equals_plain_on_smollm2(
    real_gguf, monkeypatch, algorithm, forward
):
    """On a bfloat16 pool greedy speculation (n-gram, and the shipped EAGLE-3 head) gives
    plain decoding's tokens on the real quantized model, in the C forward and in the eager
    layers (cpu_paged's kernels): each verify row must read the K / V
    bits and sum in the order the decode step of its token does, since one bf16 unit of a K / V
    element (where the two steps' float32 values straddle a rounding boundary) moves the
    logits by ~1e-3, enough to flip a close greedy choice."""
    from loom.runtime.layers import quant_ops
    from loom.runtime.spec import speculator
    from loom.runtime.spec.eagle_drafter import BUNDLED_HEADS
    from tests.runtime_helpers import batch_invariant_scheduler, run_chats

    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", "auto")  # the flag below must set "bi"
    # verify every draft: the cost model would skip verify steps and test less
    monkeypatch.setattr(speculator, "extra_cost", lambda batch_size, longest: 0.0)
    path = str(real_gguf("smollm2"))
    spec_kw = {"speculative_algorithm": algorithm, "speculative_disable_by_batch_size": 64,
               "speculative_verify_cost": "bundled"}  # fmt: skip
    if algorithm == "EAGLE3":
        spec_kw["speculative_draft_model_path"] = str(BUNDLED_HEADS / "smollm2-135m-eagle3")

    def generate(**kw):
        sched = batch_invariant_scheduler(path, kv_cache_dtype="bf16", cpu_forward=forward, **kw)
        assert sched.runner.token_to_kv_pool.k_buffers[0].dtype == torch.bfloat16
        assert (sched.runner.cpu_forward is None) == (forward == "eager")
        return run_chats(sched, ASKS, 24), sched

    with torch.inference_mode():
        plain, _ = generate()
        spec, sched = generate(**spec_kw)
    for i in range(len(ASKS)):
        assert spec[f"p{i}"].ids == plain[f"p{i}"].ids, i
    assert sched.get_state()["spec_verify_ct"] > 0


# a long shared system turn (the tool prompt's case: the radix cache holds it after a first ask)
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence. When a question needs "
    "arithmetic, show the result only. Never invent facts; say you do not know instead."
)


def test_bf16_pool_cached_prefix_and_chunked_prefill_equal_a_whole_prefill_on_smollm2(real_gguf):
    """On SmolLM2's Q4_1 target with a bfloat16 pool (the server's defaults otherwise: the
    radix cache on, `--quantized-matmul auto`), one chat prompt decoded greedily after three
    prefills: whole (a fresh server), after a first ask that left the shared system turn in the
    radix cache (its prefix then read from the pool, the rest extended), and in chunks of 16
    tokens (`--chunked-prefill-size`). The tokens and the output logprobs (the next-token
    logits' log-softmax) must be the same floats: with a cached prefix this model's
    tool_choice="auto" answer in tests/test_tools_real.py lost its call, since a whole
    prefill's rows summed their attention in another order than an extend's rows and a
    last-bit difference became a whole bf16 step of the next layer's K / V."""
    path = str(real_gguf("smollm2"))

    def chat(sched, rid, question):
        ids = sched.tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            add_generation_prompt=True, tokenize=True,
        )  # fmt: skip
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
        submit(sched, rid, list(ids), greedy(20), return_logprob=True, top_logprobs_num=0)
        return run_all(sched)[rid], len(ids)

    ask = "What is 17 times 23?"
    with torch.inference_mode():
        whole, n = chat(make_scheduler(path, quantization="gguf", kv_cache_dtype="bf16"), "a", ask)
        sched = make_scheduler(path, quantization="gguf", kv_cache_dtype="bf16")
        assert sched.runner.token_to_kv_pool.k_buffers[0].dtype == torch.bfloat16
        chat(sched, "first", "Why is the sky blue?")
        cached, _ = chat(sched, "a", ask)
        chunks = make_scheduler(path, quantization="gguf", kv_cache_dtype="bf16",
                                chunked_prefill_size=16)  # fmt: skip
        chunked, _ = chat(chunks, "a", ask)
    assert n > 40 and cached.cached_tokens > 30  # the system turn came from the cache
    for got in (cached, chunked):
        assert got.ids == whole.ids
        assert [lp for lp, *_ in got.output_logprobs] == [lp for lp, *_ in whole.output_logprobs]
