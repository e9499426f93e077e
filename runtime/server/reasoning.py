"""Reasoning output (`--reasoning-parser`): the `<think>...</think>` part of a reply becomes
`reasoning_content`, the rest `content`.

    qwen3        thinking only when the reply opens with <think> (enable_thinking=False
                 templates put an empty block in the prompt, so the reply has none)
    deepseek-r1  the template opens <think> in the prompt: the reply is thinking until </think>

`ReasoningParser` is incremental like the tool parser (the non-streamed answer is the same
parser fed the whole text). `think_regex` is the prefix a constrained reply may start with, so a
response_format or tool grammar applies after the thinking, not to it.
"""

from __future__ import annotations

from loom.runtime.server.tools import _partial_suffix
from loom.runtime.tool_formats import avoid_regex, lit

OPEN, CLOSE = "<think>", "</think>"


def think_regex(parser: str) -> str:
    """Regex of the thinking a constrained reply may open with (then the constrained part):
    deepseek-r1 must close the block its template opened; qwen3 may open one."""
    if parser == "deepseek-r1":
        return f"(?:{lit(OPEN)})?{avoid_regex(CLOSE)}{lit(CLOSE)}\\n{{0,2}}"
    return f"(?:{lit(OPEN)}{avoid_regex(CLOSE)}{lit(CLOSE)}\\n{{0,2}})?"


class ReasoningParser:
    """feed/finish -> events ("reasoning", text) and ("content", text)."""

    def __init__(self, parser: str):
        self.buf = ""
        self.state = "start"
        self.forced = parser == "deepseek-r1"  # thinking whether or not <think> is written

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        events: list[tuple[str, str]] = []
        if self.state == "start":
            s = self.buf.lstrip()
            if OPEN.startswith(s) and len(s) < len(OPEN):
                return events  # could still open a thinking block
            if s.startswith(OPEN):
                self.buf, self.state = s[len(OPEN) :], "think"
            else:
                self.state = "think" if self.forced else "content"
        if self.state == "think":
            i = self.buf.find(CLOSE)
            if i >= 0:
                reasoning, rest = self.buf[:i], self.buf[i + len(CLOSE) :]
                if reasoning:
                    events.append(("reasoning", reasoning))
                self.buf, self.state = rest.lstrip(), "after"
                if not self.buf:
                    return events
                self.state = "content"
            else:
                hold = _partial_suffix(self.buf, CLOSE)
                if len(self.buf) > hold:
                    events.append(("reasoning", self.buf[: len(self.buf) - hold]))
                    self.buf = self.buf[len(self.buf) - hold :]
                return events
        if self.state == "after":  # whitespace after </think> is not content
            self.buf = self.buf.lstrip()
            if not self.buf:
                return events
            self.state = "content"
        if self.buf:
            events.append(("content", self.buf))
            self.buf = ""
        return events

    def finish(self) -> list[tuple[str, str]]:
        start = "reasoning" if self.forced else "content"
        kind = {"think": "reasoning", "start": start, "content": "content"}.get(self.state)
        events = [(kind, self.buf)] if self.buf and kind else []
        self.buf = ""
        return events
