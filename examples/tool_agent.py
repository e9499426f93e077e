"""A tool-calling agent in a few lines: `sgl.gen(..., tools=[functions])` lets the model call
Python functions in a loop. Every call it makes names one of the functions and carries
arguments their signatures accept (the loop generates under a grammar built from them), so
`get_weather(**args)` never sees a malformed call, whatever the model.

    python examples/tool_agent.py            # the bundled model, no download
"""

from __future__ import annotations

import sys

import loom as sgl
from loom.tools import as_tools, system_prompt


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"{10 + len(city) % 15}°C, sunny"


def calculator(expression: str) -> str:
    """Evaluate +, -, * on integers."""
    try:
        terms = expression.replace(" ", "").replace("-", "+-").split("+")
        total = 0
        for term in terms:
            product = 1
            for factor in term.split("*"):
                product *= int(factor)
            total += product if term else 0
        return str(total)
    except ValueError:
        return "error: not an arithmetic expression"


TOOLS = [get_weather, calculator]


@sgl.function
def agent(s, question):
    s += sgl.system(system_prompt(as_tools(TOOLS)))
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", tools=TOOLS, tool_choice="required", max_tokens=64))


def main(backend=None) -> sgl.ProgramState:
    state = agent.run(question="What's the weather in Tokyo?", backend=backend, temperature=0)
    for call in state.get_meta_info("answer")["tool_calls"]:
        print(f"called {call['name']}({call['arguments']}) -> {call['result']}")
    print("=> answer:", state["answer"].strip())
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
