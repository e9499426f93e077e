"""A ReAct tool-use agent. The model writes a thought; `select` decides between acting and
answering and picks the tool (so it is always a real tool); the program runs the tool and
appends the observation, until the model gives its final answer.

    python examples/react_agent.py [model_path]
"""

from __future__ import annotations

import ast
import json
import operator
import sys

import loom as sgl

TOOLS_SYSTEM = (
    "You are a helpful assistant. You can use these tools:\n"
    'search: look up facts about countries and people. Input: {"query": string}\n'
    'calculator: evaluate arithmetic. Input: {"expression": string}\n'
    'get_weather: current weather in a city. Input: {"city": string}\n'
    "Use this format:\nThought: ...\nAction: tool name\nAction Input: JSON\n"
    "Observation: tool result\n... (repeat as needed)\nThought: I now know the final answer.\n"
    "Final Answer: the answer"
)

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


def calculator(args: dict) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported")

    try:
        return str(ev(ast.parse(str(args.get("expression", "")), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "error: not an arithmetic expression"


def search(args: dict) -> str:
    query = str(args.get("query", ""))
    for country, (capital, currency) in COUNTRIES.items():
        if country.lower() in query.lower():
            return f"{country}: capital {capital}; currency {currency}."
    return "no results"


def get_weather(args: dict) -> str:
    city = str(args.get("city", "?"))
    return f"{10 + len(city) % 15}°C, sunny"


TOOLS = {"search": search, "calculator": calculator, "get_weather": get_weather}


def parse_input(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@sgl.function
def react(s, question, max_steps=3):
    s += sgl.system(TOOLS_SYSTEM)
    s += sgl.user(question)
    with s.assistant():
        for step in range(max_steps):
            s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=24, stop="\n") + "\n"
            s += sgl.select(f"next_{step}", choices=["Action", "Final Answer"])
            if s[f"next_{step}"] == "Final Answer":
                break
            s += ": " + sgl.select(f"tool_{step}", choices=list(TOOLS))
            # No space after the colon: the model writes it, as " {" is one token in training.
            s += "\nAction Input:" + sgl.gen(f"input_{step}", max_tokens=24, stop="\n")
            result = TOOLS[s[f"tool_{step}"]](parse_input(s[f"input_{step}"]))
            s += "\nObservation: " + result + "\n"
        else:
            s += "Thought: I now know the final answer.\nFinal Answer"
        s += ":" + sgl.gen("answer", max_tokens=32, stop="\n")
    return s["answer"].strip()


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
