"""Programs on asyncio: `await f.run_async(...)` runs a program's states as tasks on the
running event loop (no thread per state); `async def` programs can `await s.aget(name)`, and
`text_async_iter` streams.

    python examples/async_program.py [model_path]
"""

from __future__ import annotations

import asyncio
import sys

import loom as sgl


@sgl.function
async def plan_then_answer(s, question):
    s += sgl.user(question)
    with s.assistant():
        s += "Plan: " + sgl.gen("plan", max_tokens=24, stop="\n")
        plan = await s.aget("plan")  # read mid-program without blocking the loop
        s += f"\nFollowing the plan ({len(plan.split())} words), the answer is:"
        s += sgl.gen("answer", max_tokens=24)


@sgl.function
def haiku(s, topic):
    s += f"A haiku about {topic}:\n" + sgl.gen("poem", max_tokens=32)


async def amain(backend) -> list:
    questions = ["Why is the sky blue?", "How do plants grow?", "What is a prime number?"]
    states = await asyncio.gather(
        *(plan_then_answer.run_async(question=q, backend=backend, temperature=0) for q in questions)
    )
    for q, s in zip(questions, states):
        print(f"{q}\n  plan: {s['plan'].strip()}\n  answer: {s['answer'].strip()}")
    streamed = await haiku.run_async(topic="autumn", backend=backend, stream=True)
    async for chunk in streamed.text_async_iter("poem"):
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
