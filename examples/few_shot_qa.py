"""Few-shot question answering over a batch. `run_batch` runs the programs concurrently (the
scheduler batches them); it traces the program first and prefills the constant few-shot head
of the user turn once, so every question reuses its KV from the radix cache.

    python examples/few_shot_qa.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl

FEW_SHOT = (
    "Q: What is the capital of Germany?\nA: Berlin\n"
    "Q: What currency is used in Japan?\nA: yen\n"
    "Q: Which city is the capital of Kenya?\nA: Nairobi\n"
)


@sgl.function
def few_shot_qa(s, question):
    s += sgl.user(FEW_SHOT + "Q: " + question + "\nA:")
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, stop="\n"))


QUESTIONS = [
    "What is the capital of France?",
    "What is the currency of Sweden?",
    "Which city is the capital of Canada?",
    "What currency is used in India?",
    "What is the capital of Peru?",
    "What is the capital of Egypt?",
]


def main(backend=None) -> list:
    states = few_shot_qa.run_batch(
        [{"question": q} for q in QUESTIONS], backend=backend, temperature=0, progress_bar=True
    )
    for q, s in zip(QUESTIONS, states):
        print(f"{q} -> {s['answer'].strip()}")
    return states


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
