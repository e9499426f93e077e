"""Quick start: a multi-turn chat program on the bundled model.

python examples/quick_start.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32))


def main(backend=None) -> sgl.ProgramState:
    state = multi_turn_question.run(
        question_1="What is the capital of France?",
        question_2="What currency is used in Japan?",
        backend=backend,
        temperature=0,
    )
    for m in state.messages():
        print(f"{m['role']:>9}: {m['content']}")
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
