"""Tree of thought, one level deep: fork the conversation into several sampled answers,
gather them back with `join()`, then let the model score every distinct candidate with
`select` and continue from the best. The question is prefilled once; every branch reuses
its KV from the radix cache.

    python examples/tree_of_thought.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl


@sgl.function
def tree_of_thought(s, question, width=4):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    branches = s.fork(width)
    branches += sgl.gen("candidate", max_tokens=24, stop="\n", temperature=1.0)
    branches.join()  # s["candidate"]: one entry per branch
    candidates = list(dict.fromkeys(c.strip() for c in s["candidate"] if c.strip()))
    s += sgl.select("answer", choices=candidates or ["I do not know."])
    s += sgl.assistant_end()


def main(backend=None) -> sgl.ProgramState:
    state = tree_of_thought.run(question="What is the capital of Australia?", backend=backend)
    for i, c in enumerate(state["candidate"]):
        print(f"branch {i}: {c.strip()}")
    print("chosen:", state["answer"])
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
