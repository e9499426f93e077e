"""lm-eval-harness's `local-completions` model against `loom serve` on the bundled model, on a
small local task written here (no hub): `loglikelihood` (a multiple-choice task: token-id
prompts with echo + logprobs on /v1/completions) and `generate_until`. The loglikelihoods
lm-eval reads back equal transformers' on the same checkpoint within 1e-3."""

from __future__ import annotations

import json

import lm_eval
import pytest
import torch
from lm_eval.tasks import TaskManager
from transformers import AutoModelForCausalLM, AutoTokenizer

from loom.runtime.server_args import BUNDLED_MODEL_PATH

MODEL = "loom-bundled"
QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Rome", "Tokyo"], 0),
    ("What is the capital of Japan?", ["Berlin", "Tokyo", "Cairo"], 1),
    ("What is 2 + 3?", ["4", "6", "5"], 2),
    ("What is the currency of Japan?", ["yen", "euro", "peso"], 0),
]
MC_TASK = """
task: loom_mc
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
GEN_TASK = """
task: loom_gen
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: " {{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    data = root / "questions.jsonl"
    data.write_text(
        "".join(
            json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS
        )  # fmt: skip
    )
    for name, text in (("mc", MC_TASK), ("gen", GEN_TASK)):
        (root / f"loom_{name}.yaml").write_text(text.replace("DATA", str(data)))
    # our two task files only: lm-eval's ~14.7k bundled task configs, which the default
    # manager indexes first (36 s, 10 s of CPU at load 4.6), play no part here
    return TaskManager(include_path=str(root), include_defaults=False)


@pytest.fixture(scope="module")
def server(bundled_server):
    """The session's bundled-model server (conftest.bundled_server): these tests only send it
    requests."""
    assert bundled_server.server_args.served_model_name == MODEL
    return bundled_server


def evaluate(server, tasks, name: str) -> dict:
    args = (
        f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={BUNDLED_MODEL_PATH},tokenized_requests=True,num_concurrent=2,max_retries=1"
    )
    return lm_eval.simple_evaluate(
        model="local-completions", model_args=args, tasks=[name], task_manager=tasks,
        log_samples=True, limit=None,
    )  # fmt: skip


def reference_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """lm-eval's split: the continuation's tokens after the context's, scored by the model."""
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    cont = whole[len(ctx) :]
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


def test_loglikelihoods_match_transformers(server, tasks):
    out = evaluate(server, tasks, "loom_mc")
    samples = out["samples"]["loom_mc"]
    assert len(samples) == len(QUESTIONS)
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL_PATH)
    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_PATH, dtype=torch.float32)
    worst = 0.0
    for s in samples:  # arguments: (context, continuation) per choice; resps: [(ll, greedy)]
        for (context, continuation), ((ll, _),) in zip(s["arguments"], s["resps"]):
            ref = reference_loglikelihood(model, tok, context, continuation)
            worst = max(worst, abs(float(ll) - ref))
    assert worst < 1e-3, worst
    assert 0.0 <= out["results"]["loom_mc"]["acc,none"] <= 1.0


def test_generate_until(server, tasks):
    out = evaluate(server, tasks, "loom_gen")
    samples = out["samples"]["loom_gen"]
    assert len(samples) == len(QUESTIONS)
    for s in samples:
        (text,) = s["resps"][0]
        assert isinstance(text, str) and "\n" not in text  # `until` honoured
    # greedy: the bundled model knows its capitals table
    assert samples[0]["resps"][0][0].strip() == "Paris"
    # exact_match scores " Paris" against the target " Paris": the metric reads our text
    assert out["results"]["loom_gen"]["exact_match,none"] >= 1 / len(QUESTIONS)
