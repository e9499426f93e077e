"""The model card (runtime/bundled/README.md): written by the build, its eval section by the eval."""

from __future__ import annotations

import re
from pathlib import Path

EVAL_START, EVAL_END = "<!-- eval:start -->", "<!-- eval:end -->"


def write_card(folder: Path, info: dict) -> None:
    text = f"""# loom bundled model

A tiny Qwen3-architecture chat model trained from scratch on CPU by
`scripts/build_bundled_model.py`, so that loom's examples, tests and benchmarks have a real
(if small) trained model that needs no download. It is a toy: it knows a fixed table of
{info["n_countries"]} countries (capital, currency) and {info["n_people"]} invented people, does small arithmetic,
answers "extract as JSON" prompts with compact JSON, writes ReAct tool-call traces
(`search`, `calculator`, `get_weather`), and tells template short stories. Everything else it
makes up.

## Architecture

| | |
|---|---|
| architecture | `Qwen3ForCausalLM` |
| parameters | {info["params"]:,} |
| layers / hidden / intermediate | {info["layers"]} / {info["hidden"]} / {info["intermediate"]} |
| heads / kv heads / head_dim | {info["heads"]} / {info["kv_heads"]} / {info["head_dim"]} |
| vocab (tokenizer / padded model) | {info["tokenizer_vocab"]} / {info["vocab_size"]} |
| max_position_embeddings | 4096 (trained on {info["seq_len"]}-token packed sequences) |
| tied embeddings, rope_theta | yes, 10000 |
| weights dtype | {info["dtype"]} |

Tokenizer: byte-level BPE (digits split one per token) trained on the same corpus;
special tokens `<|endoftext|>` (pad, document separator), `<|im_start|>`, `<|im_end|>` (eos);
ChatML chat template with `add_generation_prompt`. Rows `{info["tokenizer_vocab"]}..{info["vocab_size"] - 1}` of the
embedding are vocabulary padding and never correspond to a token.

## Training

Synthetic corpus generated in memory by a seeded `random.Random` (seed {info["seed"]}): ChatML
conversations (with and without system prompts, some two-turn), few-shot Q/A blocks, fact
prose, arithmetic, JSON extraction (flat, nested, arrays, booleans), ReAct traces and stories.
A deterministic split holds out one question template per country/person, about 10% of
arithmetic operand pairs and about 10% of full names used in JSON extraction; all countries
still appear in training.

| | |
|---|---|
| steps x batch x seq_len | {info["steps"]} x {info["batch_size"]} x {info["seq_len"]} ({info["tokens"]:,} tokens) |
| optimizer | AdamW (betas 0.9/0.95, wd 0.1), peak lr {info["lr"]}, warmup + cosine to 10% |
| hardware | {info["hardware"]} |
| wall time (training loop) | {info["seconds"] / 60:.1f} min |
| final loss (last step / EMA) | {info["final_loss"]:.3f} / {info["final_loss_ema"]:.3f} |

Rebuild with the command this folder was built with (the default, without `--max-minutes`,
is purely step-based and deterministic for a given torch version, CPU and thread count;
`--max-minutes` lets wall time also drive the learning-rate schedule and the stop):

```
{info["command"]}   # writes runtime/bundled/
python scripts/eval_bundled_model.py   # updates the table below
```

## Evaluation (held-out prompts, greedy, HF transformers)

{EVAL_START}
Not evaluated yet: run `python scripts/eval_bundled_model.py`.
{EVAL_END}
"""
    (folder / "README.md").write_text(text)


def write_eval_section(folder: Path, section: str) -> None:
    path = folder / "README.md"
    text = path.read_text()
    pattern = re.compile(re.escape(EVAL_START) + ".*?" + re.escape(EVAL_END), re.S)
    path.write_text(pattern.sub(lambda _: f"{EVAL_START}\n{section.strip()}\n{EVAL_END}", text))
