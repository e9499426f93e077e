"""A ReAct tool-use agent: the model thinks, picks an action with `select` (so the action is
always a valid tool), writes its argument, and the program runs the tool and appends the
observation, until the model picks `finish`.

    python examples/react_agent.py [model_path]
"""

from __future__ import annotations

import ast
import operator
import sys

import loom as sgl

FACTS = {
    "paris": "Paris is the capital of France, with about 2.1 million inhabitants.",
    "france": "France is a country in Western Europe; its capital is Paris.",
    "berlin": "Berlin is the capital of Germany.",
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError):
        return "error: not an arithmetic expression"


def search(query: str) -> str:
    words = [w.strip(".,?!").lower() for w in query.split()]
    hits = [FACTS[w] for w in words if w in FACTS]
    return " ".join(hits) if hits else "no results"


TOOLS = {"search": search, "calculate": calculate}

INSTRUCTIONS = """Answer the question. Use the tools when useful.
Tools: search[query] looks up facts; calculate[expression] does arithmetic.
Format:
Thought: <reasoning>
Action: search | calculate | finish
Input: <tool input, or the final answer for finish>
Observation: <tool result>
"""


@sgl.function
def react(s, question, max_steps=3):
    s += INSTRUCTIONS + "\nQuestion: " + question + "\n"
    for step in range(max_steps):
        s += "Thought:" + sgl.gen(f"thought_{step}", max_tokens=32, stop="\n") + "\n"
        s += "Action: " + sgl.select(f"action_{step}", choices=["search", "calculate", "finish"])
        s += "\nInput:" + sgl.gen(f"input_{step}", max_tokens=24, stop="\n") + "\n"
        action = s[f"action_{step}"]
        if action == "finish":
            return s[f"input_{step}"].strip()
        s += "Observation: " + TOOLS[action](s[f"input_{step}"]) + "\n"
    s += "Final answer:" + sgl.gen("final", max_tokens=24, stop="\n")
    return s["final"].strip()


def main(backend=None) -> sgl.ProgramState:
    state = react.run(question="What is the capital of France?", backend=backend, temperature=0)
    print(state.text())
    print("=> answer:", state.ret_value)
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
