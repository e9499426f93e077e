"""Quantized weights inside models: `--quantization int8|int4` on tiny float checkpoints, and the
layers' loaders taking QuantizedTensors (fused qkv of mixed block types, tied embedding / head).

The reference for a quantized model is the same model loaded in float32 from a checkpoint
whose weights are what the quantizer keeps (dequantize(quantize(w))): the two differ only in
the kernels, so prompt logprobs agree closely and greedy tokens agree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from loom.kernels.quant_ref import dequantize_ref, quantize_ref
from loom.runtime import model_loader
from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.layers import quant_ops
from loom.runtime.layers.quant_types import QuantizedTensor
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs
from loom.runtime.teacher_forced import teacher_forced

PROMPTS = [[5, 17, 99, 3, 250], [7] * 3 + list(range(40, 70)), [300, 2, 9]]
NEW = 12


@pytest.fixture(autouse=True)
def _torch_runner(monkeypatch):
    """These tests read the torch runner (its model, CpuForward, pools): ModelRunner for a GGUF
    model too (tests/test_array_runner.py compares the torch-free runner with it)."""
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")


def fake_quant_folder(src: str, dst: Path, quantization: str) -> str:
    """A copy of checkpoint `src` whose tensors are what `--quantization` keeps, in float32."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    index = dst / "model.safetensors.index.json"
    index.unlink(missing_ok=True)
    out = {}
    weights = list(model_loader.iterate_weights(src))
    for (name, t), (_, q) in zip(
        weights, model_loader.quantize_weights(iter(weights), quantization), strict=True
    ):
        if isinstance(q, QuantizedTensor):
            out[name] = dequantize_ref(q.qtype, q.data, q.shape).contiguous()
        else:
            out[name] = t.float().contiguous()
    save_file(out, str(dst / "model.safetensors"))
    return str(dst)


def run(path: str, **kw) -> dict[str, dict]:
    s = Scheduler(ServerArgs(model_path=path, max_total_tokens=4096, dtype="float32", **kw))
    for i, ids in enumerate(PROMPTS):
        s.add_request(
            TokenizedGenerateReq(
                rid=f"r{i}",
                input_ids=ids,
                sampling_params=make_sampling_params(
                    {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
                ),
                seed=0,
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=0,
            )
        )
    outs = {f"r{i}": {"ids": [], "lp": None} for i in range(len(PROMPTS))}
    while not s.is_idle:
        for o in s.step():
            outs[o.rid]["ids"] += o.new_ids
            if o.input_token_logprobs is not None:
                outs[o.rid]["lp"] = o.input_token_logprobs
    return outs, s


@pytest.mark.parametrize(
    "family,quantization",
    [("llama", "int4"), ("llama-mqa", "int8"), ("qwen2", "int4"), ("qwen3-moe", "int8")],
)
@pytest.mark.parametrize("mode", ["f32", "int8", "int16", "bi", "auto"])
def test_quantized_model_matches_its_float_twin(
    tiny_model_dir, tmp_path, monkeypatch, family, quantization, mode
):
    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", mode)
    path = tiny_model_dir(family)
    twin = fake_quant_folder(path, tmp_path / "twin", quantization)
    ours, sched = run(path, quantization=quantization)
    model = sched.runner.model
    ref, _ = run(twin)
    # f32 activations: the kernels are exact up to summation order; int8 / int16 activations
    # (decode steps only) round each block of 32 to 8 / 16 bits; "bi" rounds every step's to 16
    tol = {"f32": 2e-4, "int16": 1e-3, "int8": 5e-2, "bi": 1e-3, "auto": 1e-3}[mode]
    for rid in ours:
        a, b = torch.tensor(ours[rid]["lp"][1:]), torch.tensor(ref[rid]["lp"][1:])
        assert (a - b).abs().max().item() < tol, (rid, (a - b).abs().max().item())
        if mode != "int8":
            assert ours[rid]["ids"] == ref[rid]["ids"], rid
    held = [p for p in model.parameters() if getattr(p, "quant", None) is not None]
    assert held, "no parameter was kept quantized"


def test_quantize_weights_picks_projections_and_tables(tiny_model_dir):
    path = tiny_model_dir("qwen3-moe")
    kinds = {
        name: (t.qtype if isinstance(t, QuantizedTensor) else None)
        for name, t in model_loader.quantize_weights(model_loader.iterate_weights(path), "int4")
    }
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"
    assert kinds["model.layers.0.mlp.down_proj.weight"] == "Q4_1"  # layer 0 is dense
    assert kinds["model.embed_tokens.weight"] == "Q8_0"
    assert all(v is None for k, v in kinds.items() if ".experts." in k or "norm" in k)


def test_layers_take_quantized_segments_of_mixed_types(monkeypatch):
    """A fused qkv whose q/k are Q4_K and v Q6_K (as a Q4_K_M file stores them), a row-parallel
    o_proj, and a tied embedding / LM head: each equals the float layer on the dequantized
    weights (f32 activations: exact up to summation order)."""
    from loom.runtime.layers.embedding import ParallelLMHead, VocabParallelEmbedding
    from loom.runtime.layers.linear import QKVParallelLinear, RowParallelLinear

    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", "f32")
    torch.manual_seed(0)
    hidden, hd = 256, 32
    q_w, k_w, v_w = torch.randn(4 * hd, hidden), torch.randn(hd, hidden), torch.randn(hd, hidden)

    def kquant(w, qtype):  # K-quant blocks from the Q8_0 quantizer's codes are not a thing:
        # build valid Q4_K / Q6_K bytes at random and take their dequantized values as truth
        from tests.test_quant_kernels import random_blocks

        return random_blocks(qtype, w.shape[0], w.shape[1], seed=w.shape[0])

    q_q, k_q, v_q = kquant(q_w, "Q4_K"), kquant(k_w, "Q4_K"), kquant(v_w, "Q6_K")
    qkv = QKVParallelLinear(hidden, hd, 4, 1, bias=True)
    ref = QKVParallelLinear(hidden, hd, 4, 1, bias=True)
    bias = torch.randn(6 * hd)
    for shard, t in (("q", q_q), ("k", k_q), ("v", v_q)):
        qkv.weight_loader(qkv.weight, t, shard)
        ref.weight_loader(ref.weight, dequantize_ref(t.qtype, t.data, t.shape), shard)
    qkv.bias.data.copy_(bias)
    ref.bias.data.copy_(bias)
    x = torch.randn(3, hidden)
    torch.testing.assert_close(qkv(x), ref(x), rtol=1e-4, atol=1e-3)
    assert [q.qtype for _, q in qkv.weight.quant.parts] == ["Q4_K", "Q6_K"]  # q+k merged
    assert qkv.weight.numel() == 0  # the float storage is released on first use

    o_w = torch.randn(hidden, 4 * hd)
    o = RowParallelLinear(4 * hd, hidden)
    o.weight_loader(o.weight, QuantizedTensor("Q8_0", tuple(o_w.shape), quantize_ref(o_w, "Q8_0")))
    deq = dequantize_ref("Q8_0", quantize_ref(o_w, "Q8_0"), o_w.shape)
    y = torch.randn(2, 4 * hd)
    torch.testing.assert_close(o(y), y @ deq.T, rtol=1e-4, atol=1e-3)

    vocab = 100
    table = torch.randn(vocab, hidden)
    emb = VocabParallelEmbedding(vocab, hidden)
    head = ParallelLMHead(vocab, hidden)
    head.weight = emb.weight  # tied, as LlamaForCausalLM ties them
    qt = QuantizedTensor("Q4_1", (vocab, hidden), quantize_ref(table, "Q4_1"))
    emb.weight_loader(emb.weight, qt)
    deq = dequantize_ref("Q4_1", qt.data, qt.shape)
    ids = torch.tensor([0, 99, 42])
    torch.testing.assert_close(emb(ids), deq[ids])
    h = torch.randn(2, hidden)
    torch.testing.assert_close(head.compute_logits(h), h @ deq.T, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("mode", ["f32", "int8"])
def test_compiled_forward_reads_quantized_weights(tiny_model_dir, monkeypatch, mode):
    """The C forward (cpu_forward) on a quantized model equals the eager modules on it."""
    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", mode)
    path = tiny_model_dir("qwen2")  # tied embedding / head, qkv bias
    ours, sched = run(path, quantization="int4")
    assert sched.runner.cpu_forward is not None, "the C forward declined the quantized model"
    ref, eager = run(path, quantization="int4", cpu_forward="eager")
    assert eager.runner.cpu_forward is None
    for rid in ours:
        a, b = torch.tensor(ours[rid]["lp"][1:]), torch.tensor(ref[rid]["lp"][1:])
        assert (a - b).abs().max().item() < 2e-4, (rid, (a - b).abs().max().item())
        assert ours[rid]["ids"] == ref[rid]["ids"], rid


@pytest.mark.parametrize("mode", ["f32", "bi"])
def test_gguf_kept_quantized_matches_dequantized(real_gguf, gguf_tokenizer, monkeypatch, mode):
    """SmolLM2's Q4_1 file with --quantization gguf (the file's blocks, read by the C forward)
    against the same file dequantized to float32: prompt logprobs agree to float rounding with
    f32 activations, and within 3e-3 with "bi"'s 16-bit ones (measured 1.05e-3 on this text);
    the quantized model holds less than a third of the float one's weight bytes. Both pools
    float32 (a GGUF model's default pool is bfloat16: the test below)."""
    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", mode)
    path = real_gguf("smollm2")
    text = "The capital of France is Paris. " + "Quantized weights stay quantized. " * 6
    ids = gguf_tokenizer(str(path)).encode(text)
    global PROMPTS
    saved, PROMPTS = PROMPTS, [ids]
    try:
        ours, sq = run(str(path), quantization="gguf", kv_cache_dtype="float32")
        ref, sf = run(str(path), quantization="none")
    finally:
        PROMPTS = saved
    assert sq.runner.cpu_forward is not None
    a, b = torch.tensor(ours["r0"]["lp"][1:]), torch.tensor(ref["r0"]["lp"][1:])
    assert (a - b).abs().max().item() < {"f32": 1e-3, "bi": 3e-3}[mode]
    qbytes = sum(
        p.quant.nbytes for p in set(sq.runner.model.parameters()) if getattr(p, "quant", None)
    )
    fbytes = sum(p.numel() * 4 for p in set(sf.runner.model.parameters()) if p.dim() == 2)
    assert qbytes * 3 < fbytes, (qbytes, fbytes)


def test_gguf_model_defaults_to_a_bf16_pool_in_the_c_forward(real_gguf):
    """--kv-cache-dtype auto on SmolLM2's GGUF kept quantized is a bfloat16 pool the C forward
    runs (as llama.cpp keeps a 16-bit cache); float32 pins float32; the file dequantized
    (--quantization none), or the eager forward asked for, keeps the model's float32."""
    from loom.runtime.model_runner import ModelRunner

    path = str(real_gguf("smollm2"))

    def pool(**kw):
        r = ModelRunner(ServerArgs(model_path=path, max_total_tokens=256, **kw))
        return r.token_to_kv_pool.k_buffers[0].dtype, r.cpu_forward

    dtype, fast = pool()
    assert dtype == torch.bfloat16 and fast is not None and fast._struct.kv_bf16 == 1
    dtype, fast = pool(kv_cache_dtype="float32")
    assert dtype == torch.float32 and fast is not None and fast._struct.kv_bf16 == 0
    assert pool(quantization="none")[0] == torch.float32
    assert pool(cpu_forward="eager") == (torch.float32, None)


def test_smollm2_decode_kernels_agree_with_dequantized(real_gguf, gguf_tokenizer):
    """Issue 32's accuracy bar on CI's budget: SmolLM2's Q4_1 file with its blocks kept, every
    token through the decode kernels (8 a step: f32 activations on AVX-512 builds, 16-bit
    elsewhere; quant_ops.resolve_mode), against the same file
    dequantized to f32 (one step): top-1 agreement >= 99% and perplexity within 1% over 192
    tokens of README.md, the quantized side over its default (bfloat16) KV pool (benchmarks/bench_real.py --agreement 2000 gives the 2,000-token
    figure). int8 activations measured 96.4% on this text."""
    import math

    path = str(real_gguf("smollm2"))
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    ids = gguf_tokenizer(path).encode(text)[:192]
    ref_lp, ref_top, _ = teacher_forced(path, ids, "none", len(ids))
    lp, top, _ = teacher_forced(path, ids, "gguf", 8)
    same = sum(a == b for a, b in zip(ref_top, top))
    assert same / len(ref_top) >= 0.99, (same, len(ref_top))
    ppl = [math.exp(-sum(x) / len(x)) for x in (ref_lp, lp)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.01, ppl


def test_smollm2_quantized_speculation_matches_plain_and_logits_ignore_the_batch(
    real_gguf, monkeypatch
):
    """Batch invariance on the real model (`--quantized-matmul batch-invariant`, mode "bi"):
    greedy NGRAM speculation on SmolLM2's Q4_1 blocks gives plain decoding's tokens (its
    verify steps run several tokens a forward, where plain decoding runs one); a request's
    decode logprobs are bitwise
    the same alone and beside 11 others (with "int16", which switches arithmetic at 8 tokens,
    they differ in the 4th digit), and a prompt's prefill logprobs alone and beside two others.
    Issue 33 saw a quantized target's speculative output change with that switch."""
    from loom.runtime.spec import speculator
    from tests.runtime_helpers import batch_invariant_scheduler, greedy, run_all, submit

    monkeypatch.setattr(quant_ops, "DEFAULT_MODE", "auto")  # the flag below must set "bi"
    # verify every draft: the cost model would skip verify steps and test less
    monkeypatch.setattr(speculator, "extra_cost", lambda batch_size, longest: 0.0)
    path = str(real_gguf("smollm2"))
    texts = [
        "The capital of France is Paris. The capital of France is",
        "def add(a, b):\n    return a + b\n\ndef add(",
        "One, two, three, four, one, two, three,",
    ]

    def generate(**kw):
        sched = batch_invariant_scheduler(path, **kw)
        tok = sched.tokenizer
        for i, t in enumerate(texts):
            submit(sched, f"p{i}", tok.encode(t), greedy(16))
        return run_all(sched), sched

    plain, _ = generate()
    spec, sched = generate(
        speculative_algorithm="NGRAM",
        speculative_disable_by_batch_size=64,
        speculative_verify_cost="bundled",  # no start-up measurement
    )
    for i in range(len(texts)):
        assert spec[f"p{i}"].ids == plain[f"p{i}"].ids, i
    assert sched.get_state()["spec_verify_ct"] > 0

    # decode: a request's output logprobs alone (1 token a step: the GEMV) and beside 11
    # others (12 a step: the tile), bitwise
    def decode_lps(prompts):
        sched = batch_invariant_scheduler(path)
        for i, p in enumerate(prompts):
            submit(sched, f"q{i}", p, greedy(6), return_logprob=True, logprob_start_len=-1)
        lps = {}
        while not sched.is_idle:
            for o in sched.step():
                lps.setdefault(o.rid, []).extend(o.output_token_logprobs or [])
        return lps

    tok = sched.tokenizer
    ids = [tok.encode(t) for t in texts]
    others = [tok.encode(f"Item {k}: the number {k * 7} is") for k in range(11)]
    alone = decode_lps(ids[:1])
    batched = decode_lps(ids[:1] + others)
    assert len(alone["q0"]) == 6 and alone["q0"] == batched["q0"]
