"""Python functions as tools for `sgl.gen(name, tools=[...])`.

A program lets the model call functions in a loop, ReAct style (the format the bundled model
was trained on):

    Thought: I need the weather in Tokyo.
    Action: get_weather
    Action Input: {"city": "Tokyo"}
    Observation: <what the function returned, appended by the program>
    Thought: I now know the final answer.
    Final Answer: ...

Each round is generated under one regex: free text that never writes "Action:", optionally
followed by a call whose name is one of the tools and whose input follows that function's
parameter schema (from its signature, through pydantic and loom's JSON-schema translation). So
a call the model starts always names a real tool with arguments the function accepts, on any
model. The loop stops at a round without a call, or after `max_tool_rounds`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

ACTION = "Action:"
_CALL = re.compile(r"Action: ([A-Za-z0-9_-]+)\nAction Input: ?(.*)\Z", re.S)


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        if isinstance(fn, Tool):
            return fn
        if not callable(fn):
            raise TypeError(f"tools: {fn!r} is not a function")
        import typing

        import pydantic

        try:  # string annotations (`from __future__ import annotations`) resolved
            hints = typing.get_type_hints(fn)
        except (NameError, TypeError):
            hints = {}
        fields = {}
        for p in inspect.signature(fn).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tools: {fn.__name__} takes *args/**kwargs; name its parameters")
            ann = hints.get(
                p.name, Any if p.annotation is inspect.Parameter.empty else p.annotation
            )
            fields[p.name] = (ann, ... if p.default is inspect.Parameter.empty else p.default)
        schema = pydantic.create_model(fn.__name__, **fields).model_json_schema()
        return cls(fn.__name__, inspect.getdoc(fn) or "", schema, fn)

    def as_openai(self) -> dict:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


def as_tools(tools: list) -> list[Tool]:
    out = [Tool.from_function(t) for t in tools]
    names = [t.name for t in out]
    if not out or len(set(names)) != len(names):
        raise ValueError(f"tools: need one or more functions with distinct names, got {names}")
    return out


def round_regex(tools: list[Tool], required: bool) -> str:
    """One round's output: free text without "Action:", then (optionally) one valid call;
    `required`: a call, after at most one "Thought: ..." line of up to 100 characters."""
    from loom.grammar.json_schema import json_schema_to_regex
    from loom.runtime.tool_formats import FORMATS, avoid_regex

    react = FORMATS["react"]  # the call format the OpenAI API's react parser reads
    calls = "|".join(react.call_regex(t.name, json_schema_to_regex(t.parameters)) for t in tools)
    call = f"(?:{calls})"
    if required:  # at most one short ASCII thought line first, so the call fits in any budget
        return f"(?:Thought:[ -~]{{0,100}}\n)?{call}"
    return f"{avoid_regex(ACTION)}{call}?"


def parse_call(text: str) -> tuple[str, dict] | None:
    """(name, arguments) of the call a round ended with, or None for a round without one (or
    with one cut off by max_tokens). The first "Action:" that starts a whole call to the end
    is the call (a raw newline cannot sit inside its JSON strings)."""
    for start in (m.start() for m in re.finditer(ACTION, text)):
        m = _CALL.match(text, start)
        if m is not None:
            try:
                return m.group(1), json.loads(m.group(2))
            except json.JSONDecodeError:
                return None
    return None


def system_prompt(tools: list[Tool]) -> str:
    """A system prompt in the bundled model's ReAct wording, listing `tools`."""
    from loom.runtime.tool_formats import react_system_prompt

    return react_system_prompt([t.as_openai() for t in tools])
