"""Streaming: `run(stream=True)` returns at once; `text_iter(var)` yields text as it is
generated.

    python examples/streaming.py [model_path]
"""

from __future__ import annotations

import sys

import loom as sgl


@sgl.function
def story(s, animal):
    s += sgl.user(f"Tell me a story about a {animal} who wants to fly.")
    s += sgl.assistant(sgl.gen("story", max_tokens=80))


def main(backend=None) -> sgl.ProgramState:
    state = story.run(animal="turtle", backend=backend, stream=True, temperature=0.7)
    chunks = []
    for chunk in state.text_iter("story"):
        chunks.append(chunk)
        print(chunk, end="", flush=True)
    print()
    assert "".join(chunks) == state["story"]
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
