"""Parallel sampling: `gen(n=...)` draws several completions of one prompt in one request;
`fork` sends different follow-ups from one shared context. Both reuse the prompt's KV.

    python examples/parallel_sampling.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl


@sgl.function
def stories(s, animal):
    s += sgl.user(f"Write a short story about a brave {animal}.")
    s += sgl.assistant(sgl.gen("story", n=3, max_tokens=32, temperature=1.0))


@sgl.function
def three_questions(s, country):
    s += sgl.system("You are a helpful assistant. Answer briefly.")
    forks = s.fork(3)
    questions = [
        f"What is the capital of {country}?",
        f"What currency is used in {country}?",
        "Who are you?",
    ]
    for f, q in zip(forks, questions):
        f += sgl.user(q)
        f += sgl.assistant(sgl.gen("answer", max_tokens=16))
    forks.join()


def main(backend=None) -> tuple:
    a = stories.run(animal="fox", backend=backend)
    for story in a["story"]:
        print("story:", story.strip())
    b = three_questions.run(country="Italy", backend=backend, temperature=0)
    for answer in b["answer"]:
        print("answer:", answer.strip())
    return a, b


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
