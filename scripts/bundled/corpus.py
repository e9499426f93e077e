"""The synthetic training corpus: a seeded mixture of task generators rendered as ChatML."""

from __future__ import annotations

import random
from collections.abc import Callable

from .agent import react_messages
from .arith import arith_messages
from .extract import extraction_messages, json_list_messages
from .qa import fact_prose, fewshot_messages, fewshot_text, qa_messages
from .stories import small_talk_messages, story_messages

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are Loom, a concise and helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
]

# (weight, generator of a list of chat messages)
_CHAT_MIX: list[tuple[float, Callable[[random.Random], list[dict]]]] = [
    (0.24, qa_messages),
    (0.06, fewshot_messages),
    (0.15, arith_messages),
    (0.20, extraction_messages),
    (0.04, json_list_messages),
    (0.12, react_messages),
    (0.10, story_messages),
    (0.04, small_talk_messages),
]
_RAW_FRACTION = 0.05  # plain-text documents (prose, few-shot blocks) for raw completion


def render_chatml(messages: list[dict]) -> str:
    """Exactly what the tokenizer's chat_template renders (without a generation prompt)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def _conversation(rng: random.Random) -> list[dict]:
    weights, gens = zip(*_CHAT_MIX, strict=True)
    messages = rng.choices(gens, weights)[0](rng)
    if rng.random() < 0.2 and messages[0]["role"] != "system":  # a second exchange
        messages += [m for m in rng.choices(gens, weights)[0](rng) if m["role"] != "system"]
    if messages[0]["role"] != "system" and rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    return messages


def document(rng: random.Random) -> str:
    if rng.random() < _RAW_FRACTION:
        if rng.random() < 0.5:
            return fact_prose(rng) + EOS
        prompt, answer = fewshot_text(rng)
        return prompt + answer + "\n" + EOS
    return render_chatml(_conversation(rng)) + EOS


def build_corpus(n_docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [document(rng) for _ in range(n_docs)]
