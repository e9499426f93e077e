"""A ReAct tool-use agent on `sgl.gen(..., tools=[...])`. The model writes thoughts and calls;
each call is generated under a grammar built from the tools' signatures (so it always names a
real tool with arguments the function accepts), the program runs the function and appends the
Observation, and the loop ends when the model answers without calling.

    python examples/react_agent.py [model_path]
"""

from __future__ import annotations

import ast
import operator
import sys

import loom as sgl
from loom.tools import as_tools, system_prompt

COUNTRIES = {
    "France": ("Paris", "euro"),
    "Spain": ("Madrid", "euro"),
    "Japan": ("Tokyo", "yen"),
    "Sweden": ("Stockholm", "Swedish krona"),
    "Canada": ("Ottawa", "Canadian dollar"),
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def search(query: str) -> str:
    """look up facts about countries and people."""
    for country, (capital, currency) in COUNTRIES.items():
        if country.lower() in query.lower():
            return f"{country}: capital {capital}; currency {currency}."
    return "no results"


def calculator(expression: str) -> str:
    """evaluate arithmetic."""

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported")

    try:
        return str(ev(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "error: not an arithmetic expression"


def get_weather(city: str) -> str:
    """current weather in a city."""
    return f"{10 + len(city) % 15}°C, sunny"


TOOLS = [search, calculator, get_weather]


@sgl.function
def react(s, question, max_steps=3):
    s += sgl.system(system_prompt(as_tools(TOOLS)))
    s += sgl.user(question)
    with s.assistant():
        s += sgl.gen("trace", tools=TOOLS, max_tool_rounds=max_steps, max_tokens=64, stop="\n\n")
    final = s["trace"].rpartition("Final Answer:")
    return final[2].strip() if final[1] else s["trace"].strip()


def main(backend=None) -> sgl.ProgramState:
    state = react.run(
        question="Look up the capital and currency of Spain.", backend=backend, temperature=0
    )
    print(state.messages()[-1]["content"])
    print("=> answer:", state.ret_value)
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
