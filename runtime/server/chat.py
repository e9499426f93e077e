"""/v1/chat/completions' parts around generation: the prompt (chat template, tools), the
grammar a request's tools / response_format / reasoning imply, and the reply's split into
reasoning, content and tool calls (one `ReplyParser` per choice, streamed or not).
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from loom.runtime.request_normalizer import RequestError
from loom.runtime.server import tools as T
from loom.runtime.server.protocol import ChatCompletionRequest, NamedToolChoice, TextPart
from loom.runtime.server.reasoning import ReasoningParser, think_regex

logger = logging.getLogger(__name__)


@lru_cache(maxsize=8)
def model_type(model_path: str) -> str | None:
    from loom.runtime.gguf.file import gguf_file

    if gguf_file(model_path) is not None:
        from loom.runtime.model_config import load_config

        return load_config(model_path).model_type
    file = Path(model_path) / "config.json"
    try:
        return json.loads(file.read_text()).get("model_type")
    except (OSError, ValueError):
        return None


class ToolPlan:
    """What a request's `tools` / `tool_choice` mean: `mode` is "none", "auto", "required" or
    a tool's name; `parse` whether replies are read for calls."""

    def __init__(self, req: ChatCompletionRequest, args, template: str | None = None):
        self.tools = req.tools or []
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if self.tools else "none"
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
            if choice not in T.tool_names(self.tools):
                raise RequestError(f"tool_choice.function.name: no tool named {choice!r}")
        if choice != "none" and not self.tools:
            raise RequestError(f"tool_choice: {choice!r} requires tools")
        seen: set[str] = set()
        for i, t in enumerate(self.tools):
            name = t.function.name
            if not T.NAME_RE.fullmatch(name):
                raise RequestError(
                    f"tools[{i}].function.name: {name!r} must be 1-64 letters, digits, _ or -"
                )
            if name in seen:
                raise RequestError(f"tools[{i}].function.name: {name!r} is defined twice")
            seen.add(name)
        self.mode = choice
        self.parallel = req.parallel_tool_calls is True  # stated, not OpenAI's default
        from loom.runtime.server_args import BUNDLED_MODEL_PATH

        bundled = Path(args.model_path).resolve() == Path(BUNDLED_MODEL_PATH).resolve()
        # chosen from the model (its chat template, then its architecture) unless the flag says
        self.fmt = T.get_format(
            args.tool_call_parser, model_type(args.model_path), bundled, template
        )
        T.TRANSLATE_TIMEOUT = args.grammar_compile_timeout
        self.parse = self.mode != "none"
        self.constrained = req.constrain_tools

    def regex(self) -> str | None:
        if not self.parse or not self.constrained:
            return None
        return T.tool_regex(self.fmt, self.tools, self.mode, self.parallel)

    def dicts(self) -> list[dict]:
        return [t.model_dump(by_alias=True, exclude_none=True) for t in self.tools]


def constrain(sp: dict, req: ChatCompletionRequest, plan: ToolPlan, reasoning: str | None) -> None:
    """Set the grammar for tool calls, and move a response_format / tool grammar after the
    thinking when a reasoning parser is on."""
    tool_re = plan.regex()
    if tool_re is not None:
        taken = [k for k in ("regex", "json_schema", "ebnf") if k in sp]
        if taken:
            what = "response_format" if req.response_format is not None else taken[0]
            raise RequestError(f"tool_choice: cannot be combined with {what} (both constrain)")
        sp["regex"] = tool_re
        sp.setdefault("close_within_budget", "auto")  # the default for tool calls
        if plan.fmt.needs_special_tokens:
            sp["skip_special_tokens"] = False
    rf_on = req.response_format is not None and req.response_format.type != "text"
    if reasoning is None:
        return
    if tool_re is None and rf_on:
        from loom.grammar.base import GrammarError
        from loom.grammar.json_schema import normalize_schema

        try:
            sp["regex"] = T.schema_regex(normalize_schema(sp.pop("json_schema")))
        except GrammarError as e:
            raise RequestError(
                f"response_format: this schema cannot follow a reasoning block ({e})"
            ) from None
    if tool_re is not None or rf_on:
        sp["regex"] = f"{think_regex(reasoning)}(?:{sp['regex']})"


# --------------------------------------------------------------------------- prompt
def render_messages(req: ChatCompletionRequest, plan: ToolPlan, template: str) -> tuple[list, dict]:
    """Messages and extra template variables. Templates with a `tools` variable get the tools
    and the calls as HF defines them; others get the documented default: a tool system prompt
    in the parser's format, past calls written in it, tool results as user turns."""
    native = T.template_uses_tools(template)
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, TextPart):
                    raise RequestError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part.text)
            content = "".join(parts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            calls = [(c.function.name, c.function.arguments) for c in m.tool_calls]
            if native:
                msg["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": _args(c)},
                    }
                    for c in m.tool_calls
                ]
            else:
                sep = "\n" if msg["content"] else ""
                msg["content"] += sep + plan.fmt.render_calls(calls)
        if m.role == "tool":
            if native:
                msg["tool_call_id"] = m.tool_call_id
            else:
                msg = T.tool_result_turn(plan.fmt, msg["content"])
        messages.append(msg)
    extra: dict[str, Any] = {}
    if plan.tools:
        if native:
            extra["tools"] = plan.dicts()
        else:
            prompt = T.tool_system_prompt(plan.fmt, plan.dicts())
            if messages and messages[0]["role"] in ("system", "developer"):
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
            else:
                messages.insert(0, {"role": "system", "content": prompt})
    return messages, extra


def _args(call) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


# --------------------------------------------------------------------------- reply
class ReplyParser:
    """One choice's reply -> OpenAI deltas. Streamed: `feed` each new piece of text, then
    `finish`; non-streamed: the same with the whole text, then `message()`."""

    def __init__(self, plan: ToolPlan, reasoning: str | None):
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = T.ToolCallParser(plan.fmt) if plan.parse else None
        self.calls: list[dict] = []
        self.content: list[str] = []
        self.thoughts: list[str] = []

    def feed(self, text: str) -> list[dict]:
        return self._deltas(self._split(text, final=False))

    def finish(self) -> list[dict]:
        return self._deltas(self._split("", final=True))

    def _split(self, text: str, final: bool) -> list[tuple[str, str]]:
        if self.reasoning is None:
            events = [("content", text)] if text else []
        else:
            events = self.reasoning.feed(text) if text else []
            if final:
                events += self.reasoning.finish()
        if self.tools is None:
            return events
        out = []
        for kind, value in events:
            out += self.tools.feed(value) if kind == "content" else [(kind, value)]
        if final:
            out += self.tools.finish()
        return out

    def _deltas(self, events: list[tuple[str, str]]) -> list[dict]:
        deltas = []
        for kind, value in events:
            if kind == "reasoning":
                self.thoughts.append(value)
                deltas.append({"reasoning_content": value})
            elif kind == "content":
                self.content.append(value)
                deltas.append({"content": value})
            elif kind == "call":
                call = {
                    "id": T.new_call_id(),
                    "type": "function",
                    "function": {"name": value, "arguments": ""},
                }
                self.calls.append(call)
                index = len(self.calls) - 1
                deltas.append({"tool_calls": [{"index": index, **json.loads(json.dumps(call))}]})
            else:
                self.calls[-1]["function"]["arguments"] += value
                deltas.append(
                    {
                        "tool_calls": [
                            {"index": len(self.calls) - 1, "function": {"arguments": value}}
                        ]
                    }
                )
        return deltas

    def message(self) -> dict:
        content = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.calls:
            msg["tool_calls"] = self.calls
            if not content.strip():
                msg["content"] = None
        if self.reasoning is not None:
            msg["reasoning_content"] = "".join(self.thoughts) or None
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.calls and reason == "stop" else reason
