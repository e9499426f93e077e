"""Programs on asyncio: `await f.run_async(...)` runs a program's states as tasks on the
running event loop (no thread per state); `async def` programs can `await s.aget(name)` to
use a result mid-program, and `text_async_iter` streams.

    python examples/async_program.py [model_path]
"""

from __future__ import annotations

import asyncio
import sys

import loom as sgl


@sgl.function
async def capital_then_chat(s, country):
    s += sgl.user(f"What is the capital of {country}? Answer in one word.")
    s += sgl.assistant(sgl.gen("capital", max_tokens=8))
    city = (await s.aget("capital")).strip(" .")  # read mid-program without blocking the loop
    s += sgl.user(f"Tell me something about {city}.")
    s += sgl.assistant(sgl.gen("about", max_tokens=32))


@sgl.function
def story(s, animal):
    s += sgl.user(f"Write a short story about a clever {animal}.")
    s += sgl.assistant(sgl.gen("story", max_tokens=48))


async def amain(backend) -> list:
    countries = ["France", "Japan", "Brazil"]
    states = await asyncio.gather(
        *(capital_then_chat.run_async(country=c, backend=backend, temperature=0) for c in countries)
    )
    for c, s in zip(countries, states):
        print(f"{c}: {s['capital'].strip()} | {s['about'].strip()}")
    streamed = await story.run_async(animal="owl", backend=backend, stream=True)
    async for chunk in streamed.text_async_iter("story"):
        print(chunk, end="", flush=True)
    print()
    return [*states, streamed]


def main(backend=None) -> list:
    return asyncio.run(amain(backend))


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
