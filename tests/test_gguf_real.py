"""Real GGUF models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M) loaded by loom with
weights dequantized to float32, against transformers' own GGUF loading in float32.

Both sides get the same token ids (loom's GGUF tokenizer, itself checked against transformers'
on a text set); greedy continuations must be identical, except after a position where the
reference's top-2 logits are tied within TIE (then either pick is right and the prompt stops
counting there, as in test_models_hf_parity). The reference (transformers' tokenizer, model and
generate) is computed by tests/gguf_reference.py, in a process that tests/conftest.py starts at
the session's start so that gguf-py's slow Python parse overlaps the tests before this one.
"""

from __future__ import annotations

import pytest
import torch

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs
from loom.runtime.teacher_forced import teacher_forced
from tests.gguf_reference import QUESTIONS, TEXTS, chat_prompts

TIE = 1e-4


@pytest.fixture
def _torch_runner(monkeypatch):
    """For the tests that read the torch runner (its model, CpuForward): ModelRunner for a
    GGUF model too (tests/test_array_runner.py compares the torch-free runner with it). The
    Engine test keeps the default, the torch-free runner a user gets."""
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")


def loom_greedy(path: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    s = Scheduler(  # dequantized to f32, as transformers loads the file
        ServerArgs(model_path=path, max_total_tokens=8192, dtype="float32", quantization="none")
    )
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    for i, ids in enumerate(prompts):
        req = TokenizedGenerateReq(
            rid=str(i), input_ids=ids, sampling_params=make_sampling_params(params), seed=0
        )
        s.add_request(req)
    outs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while not s.is_idle:
        for o in s.step():
            outs[o.rid] += o.new_ids
    return [outs[str(i)] for i in range(len(prompts))]


def greedy_matches(ref: dict, got: list[list[int]]) -> int:
    """How many prompts match the reference's greedy tokens (up to its first near-tie)."""
    same = 0
    for ids, mine, want, gaps in zip(ref["prompts"], got, ref["want"], ref["gaps"], strict=True):
        for j, (a, b) in enumerate(zip(mine, want)):
            if a != b:
                assert gaps[j] < TIE, f"prompt {ids[:8]}: token {j} {a} != {b}"
                break
        else:
            same += 1
    return same


@pytest.mark.parametrize("name,n_prompts,new_tokens", [("smollm2", 16, 16), ("gemma3-270m", 4, 12)])
def test_real_gguf_greedy_equals_transformers(real_gguf, gguf_reference, gguf_tokenizer, name,
                                              n_prompts, new_tokens):  # fmt: skip
    path = real_gguf(name)
    tok = gguf_tokenizer(path)
    assert tok.chat_template is not None
    prompts = chat_prompts(tok, n_prompts)
    got = loom_greedy(path, prompts, new_tokens)  # first: the reference may still be running
    assert all(len(g) == new_tokens for g in got)
    ref = gguf_reference(name, n_prompts, new_tokens)
    for text, want in zip(TEXTS, ref["texts"], strict=True):
        assert tok(text).input_ids == want, text
    assert prompts == ref["prompts"]  # the reference continued these very prompts
    assert all(len(w) == new_tokens for w in ref["want"])
    same = greedy_matches(ref, got)
    print(f"{name}: {same}/{len(prompts)} prompts greedy-identical over {new_tokens} tokens")


def test_engine_serves_smollm2_by_name(real_gguf):
    """`Engine(model_path="smollm2")`: a chat answer and a JSON-schema extraction."""
    import json

    import jsonschema

    import loom

    real_gguf("smollm2")  # fetched once into the cache when the package is not installed
    with loom.Engine(model_path="smollm2", max_total_tokens=4096) as eng:
        assert eng.server_args.served_model_name == "smollm2"
        assert eng.server_args.model_path.endswith(".gguf")

        def chat(question: str) -> str:
            msgs = [{"role": "user", "content": question}]
            return eng.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True
            )

        out = eng.generate(chat("What is the capital of France?"),
                           {"max_new_tokens": 24, "temperature": 0})  # fmt: skip
        assert "Paris" in out["text"]
        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "city": {"type": "string"},
            },  # fmt: skip
            "required": ["name", "age", "city"],
            "additionalProperties": False,
        }
        question = 'Extract name, age and city as JSON: "Maria is 34 and lives in Lisbon."'
        params = {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(schema)}
        out = eng.generate(chat(question), params)
        value = json.loads(out["text"])
        jsonschema.validate(value, schema)
        assert value["name"] == "Maria" and value["age"] == 34 and value["city"] == "Lisbon"


def test_header_reader_equals_gguf_reader_on_smollm2(real_gguf):
    """The real file's 49k-token vocabulary arrays, merges and tensor views: loom's header
    reader (runtime/gguf/reader.py) against gguf.GGUFReader."""
    from tests.test_gguf_files import _same_as_gguf_reader

    _same_as_gguf_reader(real_gguf("smollm2"))


@pytest.mark.usefixtures("_torch_runner")
def test_gemma_kept_quantized_matches_dequantized(real_gguf, gguf_tokenizer):
    """Gemma 3 270M Q4_K_M with --quantization gguf: every block type of the file (Q5_0, Q8_0,
    Q4_K, Q6_K) stays quantized, the 262k x 640 Q8_0 embedding and the LM head tied to it
    included; teacher-forced against the same file dequantized to float32, top-1 agrees on
    >= 99% of the positions and perplexity within 1% (the 2,000-token figure:
    bench_real.py --agreement, docs/benchmarks.md)."""
    import math

    path = real_gguf("gemma3-270m")
    text = " ".join(QUESTIONS) + " The quick brown fox jumps over the lazy dog. " * 3
    ids = gguf_tokenizer(path).encode(text)
    lq, tq, sq = teacher_forced(path, ids, "gguf")
    model = sq.runner.model
    quants = {id(p): p.quant for p in model.parameters() if getattr(p, "quant", None)}
    kinds = {qt.qtype for qw in quants.values() for _, qt in qw.parts}
    assert kinds == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}, kinds
    embed = model.model.embed_tokens.weight
    assert embed.quant.parts[0][1].qtype == "Q8_0" and embed.quant.rows == 262144
    assert model.lm_head.weight is embed  # tied: one quantized table serves both
    del sq, model, embed, quants
    lf, tf, _ = teacher_forced(path, ids, "none")
    same = sum(a == b for a, b in zip(tq, tf, strict=True))
    assert same >= 0.99 * len(tf), (same, len(tf))
    pq, pf = math.exp(-sum(lq) / len(lq)), math.exp(-sum(lf) / len(lf))
    assert abs(pq / pf - 1) < 0.01, (pq, pf)
    print(f"gemma3-270m quantized: top-1 {same}/{len(tf)}, perplexity {pq:.4f} vs {pf:.4f}")


@torch.inference_mode()
@pytest.mark.usefixtures("_torch_runner")
def test_gemma_c_forward_matches_eager_past_the_window(real_gguf):
    """Gemma 3 270M kept quantized (--quantization gguf) through the compiled C forward against
    the eager modules of the same runner: a 600-token prompt (past the 512-token window of the
    local layers) beside a short one, decode steps, then a 5-token extend: logits and the KV
    written as eager's (tests/test_cpu_forward._compare), argmax equal."""
    from loom.runtime.forward_batch import ForwardMode
    from tests.test_cpu_forward import _compare, _runner, _Steps

    # the float32 pool: this compares the layer arithmetic (a bfloat16 pool, the GGUF default,
    # rounds the prompt's own K / V on the C side only; its accuracy: the teacher-forced test above)
    runner = _runner(real_gguf("gemma3-270m"), quantization="gguf", kv_cache_dtype="float32")
    assert runner.cpu_forward is not None
    st = _Steps(runner, 2, seed=3)
    # a 600-token prefill's matmuls sum in another order than the C forward's (~1e-4 relative
    # on the logits and KV, 18 layers of Gemma's large activations), the steps after it agree
    # to ~1e-6; attending past the window, or not, moves them by far more
    diffs = [
        _compare(
            runner, st.batch([0, 1], [600, 7], ForwardMode.EXTEND, all_logits=False),
            tol=1e-2, kv_tol=3e-2,
        )
    ]  # fmt: skip
    # the steps after it: Gemma's Q8_0 / Q5_0 matmuls run mode bi's 16-bit activation codes at
    # every row count (quant_bi.c bi_lanes), and the eager and C norms' last-bit differences
    # land an activation on the other side of a code's rounding now and then (~2e-3 on a logit
    # seen); reading past the window moves logits by ~1 (the docstring's check)
    for _ in range(2):
        diffs.append(
            _compare(runner, st.batch([0, 1], [1, 1], ForwardMode.DECODE), None, 1e-2, 1e-2)
        )
    diffs.append(_compare(runner, st.batch([0, 1], [5, 1], ForwardMode.EXTEND), None, 1e-2, 1e-2))
    print("gemma3-270m C forward vs eager, largest logit differences:", diffs)
