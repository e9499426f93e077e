"""ReAct tool-use traces with three fake tools: search, calculator, get_weather."""

from __future__ import annotations

import json
import random

from .arith import render_arith, sample_arith
from .facts import CITIES, COUNTRIES, PEOPLE

TOOLS_SYSTEM = (
    "You are a helpful assistant. You can use these tools:\n"
    'search: look up facts about countries and people. Input: {"query": string}\n'
    'calculator: evaluate arithmetic. Input: {"expression": string}\n'
    'get_weather: current weather in a city. Input: {"city": string}\n'
    "Use this format:\nThought: ...\nAction: tool name\nAction Input: JSON\n"
    "Observation: tool result\n... (repeat as needed)\nThought: I now know the final answer.\n"
    "Final Answer: the answer"
)
_CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowing", "foggy"]


def _step(thought: str, tool: str, args: dict, observation: str) -> str:
    return (
        f"Thought: {thought}\nAction: {tool}\nAction Input: {json.dumps(args)}\n"
        f"Observation: {observation}\n"
    )


def _weather(rng: random.Random) -> tuple[str, str]:
    city = rng.choice(CITIES)
    temp, cond = rng.randint(-5, 35), rng.choice(_CONDITIONS)
    q = rng.choice(
        [
            "What's the weather in {c}?",
            "Is it warm in {c} right now?",
            "How is the weather in {c} today?",
        ]
    ).format(c=city)
    trace = _step(
        f"I need the current weather in {city}.", "get_weather", {"city": city}, f"{temp}°C, {cond}"
    )
    return (
        q,
        trace
        + f"Thought: I now know the final answer.\nFinal Answer: It is {temp}°C and {cond} in {city}.",
    )


def _calc(rng: random.Random) -> tuple[str, str]:
    op, a, b = sample_arith(rng)
    _, ans = render_arith(op, a, b, 0)
    q = rng.choice(
        ["Use the calculator: what is {a} {op} {b}?", "Please compute {a} {op} {b} with a tool."]
    ).format(a=a, op=op, b=b)
    trace = _step(
        "I should use the calculator.", "calculator", {"expression": f"{a} {op} {b}"}, ans
    )
    return q, trace + f"Thought: I now know the final answer.\nFinal Answer: {a} {op} {b} = {ans}."


def _search(rng: random.Random) -> tuple[str, str]:
    if rng.random() < 0.5:
        c, cap, cur = rng.choice(COUNTRIES)
        q = f"Look up the capital and currency of {c}."
        trace = _step(
            f"I should search for facts about {c}.",
            "search",
            {"query": c},
            f"{c}: capital {cap}; currency {cur}.",
        )
        return (
            q,
            trace
            + f"Thought: I now know the final answer.\nFinal Answer: The capital of {c} is {cap} and the currency is the {cur}.",
        )
    p, age, city, job = rng.choice(PEOPLE)
    q = f"Who is {p}, and what is the weather where they live?"
    temp, cond = rng.randint(-5, 35), rng.choice(_CONDITIONS)
    trace = _step(
        f"First I need to find out about {p}.",
        "search",
        {"query": p},
        f"{p} is a {age}-year-old {job} living in {city}.",
    )
    trace += _step(
        f"{p} lives in {city}. Now I need the weather there.",
        "get_weather",
        {"city": city},
        f"{temp}°C, {cond}",
    )
    return q, trace + (
        f"Thought: I now know the final answer.\nFinal Answer: {p} is a {age}-year-old {job} "
        f"in {city}, where it is {temp}°C and {cond}."
    )


def react_messages(rng: random.Random) -> list[dict]:
    q, trace = rng.choice([_weather, _calc, _search])(rng)
    return [
        {"role": "system", "content": TOOLS_SYSTEM},
        {"role": "user", "content": q},
        {"role": "assistant", "content": trace},
    ]
