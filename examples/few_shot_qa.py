"""Few-shot question answering over a batch: the shared few-shot prefix is prefilled once
(run_batch traces the program for its constant prefix) and every question reuses it.

    python examples/few_shot_qa.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl

FEW_SHOT = """Answer each question in a few words.

Question: What is the capital of Germany?
Answer: Berlin

Question: How many legs does a spider have?
Answer: Eight

Question: What color is the sky on a clear day?
Answer: Blue

"""


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Question: " + question + "\n"
    s += "Answer:" + sgl.gen("answer", max_tokens=16, stop="\n")


QUESTIONS = [
    "What is the capital of France?",
    "How many days are in a week?",
    "What is 2 + 3?",
    "Which animal says meow?",
    "What is frozen water called?",
    "What is the opposite of hot?",
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
