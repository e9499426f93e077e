"""Tool calling on /v1/chat/completions: call formats, their parsers, and the grammars that keep
calls well formed.

A *format* is how a model family writes calls (`--tool-call-parser`, SGLang's names):

    qwen25   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (one block per call)
    llama3   {"name": "f", "parameters": {...}}; {"name": ...}             (the whole reply)
    mistral  [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]
    react    Action: f\\nAction Input: {...}          (loom's bundled model was trained on it)
    smollm2  <tool_call>[\\n{"name": "f", "arguments": {...}},\\n...\\n]</tool_call>   (SmolLM2-Instruct)
    gemma3   {"name": "f", "parameters": {...}}   (Gemma 3's documented JSON style, no tool tokens)

With no flag the format is chosen from the model: its chat template's markers (or the model
it names), then its architecture (`get_format`).

The formats themselves (and the regex helpers the language's tool grammars share) are in
runtime/tool_formats.py. `tool_regex` writes the output a request may produce as one regex (every grammar engine takes
regexes): with `tool_choice` required or a named function, one or more calls whose arguments
follow each tool's parameter schema (loom's JSON-schema translation); with `auto`, free text
that never contains the format's trigger, optionally followed by such calls, so a call the
model starts is always complete and valid. `ToolCallParser` reads the output incrementally;
the non-streamed answer is the same parser fed the whole text, so streamed deltas reassemble
to exactly the non-streamed calls.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from functools import lru_cache

from loom.runtime.request_normalizer import RequestError
from loom.runtime.tool_formats import (
    ALIASES,
    FORMATS,
    PARSER_NAMES,
    ToolFormat,
    avoid_regex,
    lit,
    react_system_prompt,
)

logger = logging.getLogger(__name__)

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


_BY_MODEL_TYPE = {
    "qwen2": "qwen25",
    "qwen3": "qwen25",
    "qwen2_moe": "qwen25",
    "qwen3_moe": "qwen25",
}
_BY_MODEL_TYPE |= {"llama": "llama3", "mistral": "mistral", "mixtral": "mistral"}
_BY_MODEL_TYPE |= {"gemma3": "gemma3", "gemma3_text": "gemma3"}


def get_format(
    parser: str | None,
    model_type: str | None,
    bundled: bool = False,
    template: str | None = None,
) -> ToolFormat:
    """The flag's format, else react for the bundled model (what it was trained on), else the
    one the model's chat template writes or names, else the model family's, else qwen25 (the
    documented default). The user never has to know the flag for a model loom can recognise."""
    if parser:
        name = ALIASES.get(parser, parser)
        if name not in FORMATS:
            raise ValueError(f"tool_call_parser: {parser!r} is not one of {PARSER_NAMES}")
        return FORMATS[name]
    if bundled:
        return FORMATS["react"]
    by_template = format_of_template(template or "")
    if by_template is not None:
        return FORMATS[by_template]
    return FORMATS[_BY_MODEL_TYPE.get(model_type or "", "qwen25")]


def format_of_template(template: str) -> str | None:
    """The call format a chat template implies: the markers a tool-aware template writes
    calls with, or the model a tool-less template names (SmolLM2's ChatML template names
    "SmolLM" and has no `tools` variable: its calls are taught by a system prompt)."""
    if template_uses_tools(template):
        for marker, name in (("<tool_call>", "qwen25"), ("[TOOL_CALLS]", "mistral")):
            if marker in template:
                return name
        if "<|python_tag|>" in template or "<|start_header_id|>" in template:
            return "llama3"
        return None
    if "<|im_start|>" in template and "SmolLM" in template:
        return "smollm2"
    return None


# --------------------------------------------------------------------------- grammar
def tool_names(tools: list) -> list[str]:
    return [t.function.name for t in tools]


_translators = None  # forked on first use, like the scheduler's (grammar/translation.py)
TRANSLATE_TIMEOUT = 30.0  # seconds; the server sets --grammar-compile-timeout


def schema_regex(schema) -> str:
    """loom's regex of a JSON schema, translated in a killable worker process: a schema whose
    translation would run for hours costs TRANSLATE_TIMEOUT, not a thread of this process."""
    global _translators
    from loom.grammar.base import GrammarError
    from loom.grammar.translation import TranslatorPool

    if _translators is None:
        _translators = TranslatorPool(2)
    form = _translators.translate(("json_schema", schema, None, "regex"), TRANSLATE_TIMEOUT)
    if form.syntax != "regex":
        raise GrammarError("the schema is recursive or too large for a regex")
    return form.text


def close_translators() -> None:
    """Kill the translation workers (the server's shutdown, before it stops the runtime: a
    forked worker holds copies of this process's descriptors)."""
    global _translators
    if _translators is not None:
        _translators.close()
        _translators = None


@lru_cache(maxsize=256)
def _args_regex(schema_json: str, strict: bool) -> str:
    from loom.grammar.base import GrammarError

    try:
        return schema_regex(json.loads(schema_json))
    except GrammarError as e:
        if strict:
            raise
        logger.warning("tool parameters not enforced (%s); any JSON object is allowed", e)
        return schema_regex({"type": "object"})


def args_regex(tool, where: str) -> str:
    from loom.grammar.base import GrammarError

    params = tool.function.parameters
    schema = params if params else {"type": "object", "properties": {}}
    try:
        return _args_regex(json.dumps(schema, sort_keys=False), bool(tool.function.strict))
    except GrammarError as e:
        raise RequestError(f"{where}.function.parameters: cannot be enforced: {e}") from None


def tool_regex(fmt: ToolFormat, tools: list, mode: str, parallel: bool) -> str:
    """The regex of an output under `mode` ("auto", "required" or a tool's name)."""
    chosen = [
        (i, t)
        for i, t in enumerate(tools)
        if mode in ("auto", "required") or t.function.name == mode
    ]
    one = "|".join(fmt.call_regex(t.function.name, args_regex(t, f"tools[{i}]")) for i, t in chosen)
    one = f"(?:{one})"
    calls = f"{one}(?:{lit(fmt.separator)}{one})*" if parallel else one
    calls = lit(fmt.section_open) + calls + lit(fmt.section_close)
    if fmt.tail:
        calls += f"(?:{lit(fmt.tail)})?"
    if mode != "auto":
        return calls
    if fmt.trigger is not None:
        return f"{avoid_regex(fmt.trigger)}(?:{calls})?"
    return f"(?:{calls}|(?:[^{{\\s](?:.|\\n)*)?)"  # llama3: a reply is all calls or all text


# --------------------------------------------------------------------------- parsing
_REACT_HEAD = re.compile(r"\s*([A-Za-z0-9_-]+)[ \t]*\nAction Input: ?(?=\S)")
_HEAD = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_PYTHON_TAG = "<|python_tag|>"


class ToolCallParser:
    """Incremental: `feed(text)` and `finish()` return events ("content", text),
    ("call", name) (a new call starts) and ("args", fragment) (of the latest call)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.buf = ""
        self.mode = "text"
        self.calls = 0
        self._scan: _JsonScan | None = None

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        events: list[tuple[str, str]] = []
        while self.buf and self._step(events):
            pass
        return events

    def finish(self) -> list[tuple[str, str]]:
        events = []
        if self.mode in ("text", "plain", "start") and self.buf:
            events.append(("content", self.buf))
        self.buf = ""
        return events

    def _step(self, events: list) -> bool:
        """Process what the buffer allows; False when it must wait for more text."""
        fmt, buf = self.fmt, self.buf
        if self.mode == "text" and fmt.trigger is None:
            self.mode = "start"
        if self.mode == "start":  # llama3: calls only when the reply starts with one
            s = buf.lstrip()
            if s.startswith(_PYTHON_TAG):
                s = s[len(_PYTHON_TAG) :]
            elif not s or _PYTHON_TAG.startswith(s):
                return False
            self.mode, self.buf = ("section", s) if s.startswith("{") else ("plain", buf)
            return True
        if self.mode == "plain":
            events.append(("content", buf))
            self.buf = ""
            return False
        if self.mode == "text":
            i = buf.find(fmt.trigger)
            if i >= 0:
                if i:
                    events.append(("content", buf[:i]))
                self.buf = buf[i + len(fmt.trigger) :]
                self.mode = "head" if fmt.react else "section"
                return True
            hold = _partial_suffix(buf, fmt.trigger)
            if len(buf) > hold:
                events.append(("content", buf[: len(buf) - hold]))
                self.buf = buf[len(buf) - hold :]
            return False
        if self.mode == "section":
            if fmt.react:  # the next call starts at the next trigger
                j = buf.find(fmt.trigger)
                if j < 0:
                    hold = _partial_suffix(buf, fmt.trigger)
                    self.buf = buf[len(buf) - hold :] if hold else ""
                    return False
                self.buf, self.mode = buf[j + len(fmt.trigger) :], "head"
                return True
            j = buf.find("{")
            self.buf, self.mode = (buf[j:], "head") if j >= 0 else ("", "section")
            return j >= 0
        if self.mode == "head":
            m = (_REACT_HEAD if fmt.react else _HEAD).match(buf)
            if m is None:
                return False
            events.append(("call", json.loads(f'"{m.group(1)}"')))
            self.calls += 1
            self.buf, self.mode, self._scan = buf[m.end() :], "args", _JsonScan()
            return True
        # args: everything up to the end of the arguments value
        n, done = self._scan.consume(buf)
        if n:
            events.append(("args", buf[:n]))
        self.buf = buf[n:]
        if done:
            self.mode = "section"
        return done


def _partial_suffix(text: str, word: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `word`."""
    for k in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:k]):
            return k
    return 0


class _JsonScan:
    """Finds where one JSON value ends in text that arrives in pieces."""

    def __init__(self):
        self.kind: str | None = None
        self.depth = 0
        self.in_str = False
        self.esc = False

    def consume(self, text: str) -> tuple[int, bool]:
        for i, c in enumerate(text):
            if self.kind is None:
                self.kind = "container" if c in "{[" else ("string" if c == '"' else "bare")
            if self.kind == "bare":
                if c in ",}] \n\t\r;":
                    return i, True
                continue
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.kind == "string":
                        return i + 1, True
                continue
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assemble(events: list[tuple[str, str]]) -> tuple[str, list[dict]]:
    """Content and OpenAI tool_calls from a parser's events."""
    content, calls = [], []
    for kind, value in events:
        if kind == "content":
            content.append(value)
        elif kind == "call":
            calls.append(
                {
                    "id": new_call_id(),
                    "type": "function",
                    "function": {"name": value, "arguments": ""},
                }
            )
        else:
            calls[-1]["function"]["arguments"] += value
    return "".join(content), calls


# --------------------------------------------------------------------------- prompts
def tool_system_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    """The tool prompt of a template without a `tools` variable: the one the model was taught
    with where it has one (the bundled model's ReAct prompt, SmolLM2's function-calling prompt,
    Gemma 3's documented JSON prompt), else the documented default (Qwen2.5's wording)."""
    if fmt.react:
        return react_system_prompt(tools)
    if fmt.name == "smollm2":
        listing = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        return (
            "You are an expert in composing functions. You are given a question and a set of "
            "possible functions.\nBased on the question, you will need to make one or more "
            "function/tool calls to achieve the purpose.\nIf none of the functions can be used, "
            "point it out and refuse to answer.\nIf the given question lacks the parameters "
            "required by the function, also point it out.\n\n"
            f"You have access to the following tools:\n<tools>{listing}</tools>\n\n"
            "The output MUST strictly adhere to the following format, and NO other text MUST be "
            "included.\nThe example format is as follows. Please make sure the parameter type is "
            "correct. If no function call is needed, please make the tool calls an empty list "
            "'[]'.\n<tool_call>[\n"
            '{"name": "func_name1", "arguments": {"argument1": "value1", "argument2": "value2"}},'
            "\n... (more tool calls as required)\n]</tool_call>"
        )
    if fmt.name == "gemma3":
        listing = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
        return (
            "You have access to functions. If you decide to invoke any of the function(s), you "
            'MUST put it in the format of\n{"name": function name, "parameters": dictionary of '
            "argument name and its value}\n\nYou SHOULD NOT include any other text in the "
            f"response if you call a function\n{listing}"
        )
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.render_calls([("<function-name>", "<args-json-object>")])
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        f"For each function call, write it in this form:\n{example}"
    )


def tool_result_turn(fmt: ToolFormat, content: str) -> dict:
    """A tool's result as the user turn the format's model reads it in (templates without a
    `tools` variable have no tool role)."""
    if fmt.react:
        return {"role": "user", "content": f"Observation: {content}"}
    if fmt.name == "gemma3":  # the Gemma cookbook's wrapping of a result
        return {"role": "user", "content": f"```tool_output\n{content}\n```"}
    return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}


def template_uses_tools(template: str) -> bool:
    return bool(re.search(r"\btools\b", template or ""))
