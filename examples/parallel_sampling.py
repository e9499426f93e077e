"""Parallel sampling: `gen(n=...)` draws several completions of one prompt in one request;
`fork` explores branches that each continue differently. Both share the prompt's KV.

    python examples/parallel_sampling.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl


@sgl.function
def brainstorm(s, topic):
    s += sgl.user(f"Suggest a name for {topic}.")
    s += sgl.assistant(sgl.gen("names", n=4, max_tokens=16, temperature=1.0, stop="\n"))


@sgl.function
def styles(s, topic):
    s += f"Three short descriptions of {topic}.\n"
    forks = s.fork(3)
    for f, style in zip(forks, ["Formal", "Playful", "Poetic"]):
        f += f"{style}: " + sgl.gen("desc", max_tokens=24, stop="\n")
    forks.join()


def main(backend=None) -> tuple:
    a = brainstorm.run(topic="a bakery", backend=backend)
    for name in a["names"]:
        print("name:", name.strip())
    b = styles.run(topic="the sea", backend=backend, temperature=0.7)
    for desc in b["desc"]:
        print("desc:", desc.strip())
    return a, b


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
