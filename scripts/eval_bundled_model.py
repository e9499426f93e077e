"""Evaluate the bundled model on held-out prompts with plain HF transformers (greedy decoding).

    python scripts/eval_bundled_model.py [--model runtime/bundled] [--no-write]

Prints a table (capital, currency, age, arithmetic accuracy; JSON validity of unconstrained
extraction answers) and a few sample chats, and writes them into the model card.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bundled.agent import TOOLS_SYSTEM  # noqa: E402
from bundled.card import write_eval_section  # noqa: E402
from bundled.extract import extraction  # noqa: E402
from bundled.facts import COUNTRIES  # noqa: E402
from bundled.heldout import age_eval, arith_eval, capital_eval, currency_eval  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLES = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    [{"role": "user", "content": "Write a short story about a brave fox."}],
    [
        {"role": "system", "content": TOOLS_SYSTEM},
        {"role": "user", "content": "What's the weather in Tokyo?"},
    ],
    [
        {
            "role": "user",
            "content": "Extract the name and age as JSON: Alice is 31 and lives in Paris.",
        }
    ],
]


@torch.no_grad()
def generate(
    model, tok, conversations: list[list[dict]], max_new_tokens: int, batch_size: int = 32
) -> list[str]:
    out = []
    for i in range(0, len(conversations), batch_size):
        prompts = [
            tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations[i : i + batch_size]
        ]
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        out += tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return [o.strip() for o in out]


def ask(model, tok, items: list[tuple[str, str]], max_new_tokens: int) -> list[str]:
    return generate(
        model, tok, [[{"role": "user", "content": q}] for q, _ in items], max_new_tokens
    )


def contains(answer: str, expected: str) -> bool:
    return re.search(r"\b" + re.escape(expected.lower()) + r"\b", answer.lower()) is not None


def last_int(answer: str) -> str | None:
    nums = re.findall(r"-?\d+", answer)
    return nums[-1] if nums else None


def is_json(answer: str) -> bool:
    try:
        json.loads(answer)
        return True
    except ValueError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=REPO / "runtime" / "bundled")
    p.add_argument("--n-json", type=int, default=40)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.model))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(args.model)).eval()

    rows, failures = [], {}

    def score(name: str, items, answers, ok, chance: str) -> None:
        hits = [ok(a, e) for a, (_, e) in zip(answers, items, strict=True)]
        rows.append((name, len(items), sum(hits), chance))
        failures[name] = [
            (q, e, a) for (q, e), a, h in zip(items, answers, hits, strict=True) if not h
        ][:3]

    for name, items, chance in [
        ("capital (held-out template)", capital_eval(), f"{100 / len(COUNTRIES):.0f}%"),
        (
            "currency (held-out template)",
            currency_eval(),
            f"{100 / len({c for _, _, c in COUNTRIES}):.0f}%",
        ),
        ("person age (held-out template)", age_eval(), "~2%"),
    ]:
        score(name, items, ask(model, tok, items, 24), contains, chance)
    items = arith_eval()
    score(
        "arithmetic (held-out operands)",
        items,
        ask(model, tok, items, 16),
        lambda a, e: last_int(a) == e,
        "-",
    )

    rng = random.Random(1234)
    items = [extraction(rng, heldout=True) for _ in range(args.n_json)]
    answers = ask(model, tok, items, 96)
    score("JSON extraction: valid json.loads", items, answers, lambda a, e: is_json(a), "-")
    score(
        "JSON extraction: exact object",
        items,
        answers,
        lambda a, e: is_json(a) and json.loads(a) == json.loads(e),
        "-",
    )

    table = ["| task | n | correct | accuracy | chance |", "|---|---|---|---|---|"]
    table += [f"| {n} | {k} | {c} | {100 * c / k:.0f}% | {ch} |" for n, k, c, ch in rows]
    samples = generate(model, tok, SAMPLES, 160, batch_size=1)
    sample_md = []
    for conv, answer in zip(SAMPLES, samples, strict=True):
        sample_md.append(f"**user:** {conv[-1]['content']}\n\n```\n{answer}\n```")
    print("\n".join(table))
    for name, fails in failures.items():
        for q, e, a in fails:
            print(f"  miss [{name}] {q!r} expected {e!r} got {a!r}")
    print()
    for conv, answer in zip(SAMPLES, samples, strict=True):
        print(f"--- {conv[-1]['content']!r}\n{answer}\n")
    if not args.no_write:
        section = (
            "\n".join(table) + "\n\nSample answers (greedy; the tool-use sample has the tool "
            "system prompt, whose Observation lines the model invents):\n\n"
            + "\n\n".join(sample_md)
        )
        write_eval_section(args.model, section)
        print(f"wrote evaluation into {args.model / 'README.md'}")


if __name__ == "__main__":
    main()
