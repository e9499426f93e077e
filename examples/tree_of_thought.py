"""Tree of thought: fork the state into several lines of reasoning, let the model judge each
one, gather the judgements back with `join()`, and continue from the best branch.
The question is sent once; every branch reuses its KV from the radix cache.

    python examples/tree_of_thought.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl


@sgl.function
def tree_of_thought(s, question, width=3):
    s += sgl.system("You reason step by step.")
    s += sgl.user(question)
    s += sgl.assistant_begin()
    branches = s.fork(width)
    branches += lambda i: f"Approach {i + 1}: " + sgl.gen("plan", max_tokens=48, stop="\n")
    branches += "\nIs this approach sound? " + sgl.select("verdict", choices=["yes", "no"])
    branches.join()  # s["plan"], s["verdict"]: one entry per branch
    scores = [v == "yes" for v in s["verdict"]]
    best = scores.index(True) if True in scores else 0
    s += (
        "Best approach: "
        + s["plan"][best].strip()
        + "\nAnswer: "
        + sgl.gen("answer", max_tokens=48)
    )
    s += sgl.assistant_end()


def main(backend=None) -> sgl.ProgramState:
    state = tree_of_thought.run(
        question="How can I measure 4 liters with a 3-liter and a 5-liter jug?",
        backend=backend,
        temperature=0.8,
    )
    for i, (plan, verdict) in enumerate(zip(state["plan"], state["verdict"])):
        print(f"branch {i}: [{verdict}] {plan.strip()}")
    print("answer:", state["answer"].strip())
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
