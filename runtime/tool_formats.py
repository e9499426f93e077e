"""How model families write tool calls (`--tool-call-parser`, SGLang's names), and the regex
helpers a call grammar is built from. Shared by the OpenAI API's tool calling
(runtime/server/tools.py) and the language's tools (loom.tools): neither imports the other,
and server_args takes the flag's choices from `PARSER_NAMES` here (one list)."""

from __future__ import annotations

import dataclasses

_META = set("\\.^$|?*+()[]{}")


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str
    call_open: str  # before each call's name
    args_key: str
    call_close: str  # after each call's arguments
    separator: str  # between parallel calls
    section_open: str = ""  # once before the calls (mistral's "[TOOL_CALLS] [")
    section_close: str = ""
    trigger: str | None = None  # what starts the call section in free text; None: only at start
    needs_special_tokens: bool = False  # the trigger is a special token the detokenizer keeps
    react: bool = False  # "Action: name\nAction Input: args" instead of a JSON object
    # what the model may write after its calls before it stops (ReAct models go on with
    # "Observation:"; without it the only way on from a call's "\n" would be another call)
    tail: str = ""

    def call_regex(self, name: str, args_regex: str) -> str:
        if self.react:
            return f"{lit(f'Action: {name}')}\\nAction Input: ?(?:{args_regex})"
        head = f'{self.call_open}{{"name": "{name}", "{self.args_key}": '
        return f"{lit(head)}(?:{args_regex}){lit('}' + self.call_close)}"

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON text) written as the model writes them (for history)."""
        if self.react:
            return self.separator.join(f"Action: {n}\nAction Input: {a}" for n, a in calls)
        body = self.separator.join(
            f'{self.call_open}{{"name": "{n}", "{self.args_key}": {a}}}{self.call_close}'
            for n, a in calls
        )
        return self.section_open + body + self.section_close


FORMATS = {
    "qwen25": ToolFormat(
        "qwen25", "<tool_call>\n", "arguments", "\n</tool_call>", "\n", trigger="<tool_call>"
    ),
    "llama3": ToolFormat("llama3", "", "parameters", "", "; "),
    "mistral": ToolFormat(
        "mistral",
        "",
        "arguments",
        "",
        ", ",
        section_open="[TOOL_CALLS] [",
        section_close="]",
        trigger="[TOOL_CALLS]",
        needs_special_tokens=True,
    ),
    "react": ToolFormat(
        "react", "", "", "", "\n", trigger="Action:", react=True, tail="\nObservation:"
    ),
    # SmolLM2-Instruct's function-calling data (Argilla's Synth-APIGen, xLAM style): one
    # <tool_call> block holding a JSON list of calls, one call a line (its model card's prompt
    # and Ollama's template for it write exactly this shape).
    "smollm2": ToolFormat(
        "smollm2",
        "",
        "arguments",
        "",
        ",\n",
        section_open="<tool_call>[\n",
        section_close="\n]</tool_call>",
        trigger="<tool_call>",
    ),
    # Gemma 3 has no tool tokens; Google's function-calling guide documents a JSON object
    # {"name": ..., "parameters": {...}} as the whole reply (its other variant is Python).
    "gemma3": ToolFormat("gemma3", "", "parameters", "", "\n"),
}
ALIASES = {"qwen": "qwen25", "qwen3": "qwen25", "hermes": "qwen25", "llama4": "llama3"}
PARSER_NAMES = tuple(sorted([*FORMATS, *ALIASES]))


def lit(text: str) -> str:
    """`text` as a regex matching itself."""
    return "".join("\\" + c if c in _META else ("\\n" if c == "\n" else c) for c in text)


def avoid_regex(word: str) -> str:
    """Every string that does not contain `word` (whose first character occurs only once in
    it, as in every trigger here). A KMP automaton written as a regex: after a partial match
    c0..c(k-1), a mismatch returns to state 0, or to state 1 on c0."""
    c0, rest = word[0], word[1:]
    assert rest and c0 not in rest, word
    k0, not_c0 = lit(c0), f"[^{_class(c0)}]"

    def out(i: int) -> str:  # c0 c1..ci matched: a character that is neither c(i+1) nor c0
        leave = f"[^{_class(rest[i])}{_class(c0)}]"
        return leave if i == len(rest) - 1 else f"(?:{leave}|{lit(rest[i])}{out(i + 1)})"

    restart = _prefixes(rest[:-1]) + k0  # a partial match that meets c0 again
    partial = f"{k0}(?:{restart})*"
    return f"(?:{not_c0}|{partial}{out(0)})*(?:{partial}{_prefixes(rest[:-1])})?"


def _prefixes(s: str) -> str:
    """Regex of every prefix of `s` (the empty one included)."""
    out = ""
    for c in reversed(s):
        out = f"(?:{lit(c)}{out})?"
    return out


def _class(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else ("\\n" if c == "\n" else c)


def react_system_prompt(tools: list[dict]) -> str:
    """The bundled model's trained ReAct system prompt, listing OpenAI-style `tools`."""
    lines = []
    for t in tools:
        f = t["function"]
        props = (f.get("parameters") or {}).get("properties", {})
        args = ", ".join(f'"{k}": {v.get("type", "any")}' for k, v in props.items())
        lines.append(f"{f['name']}: {f.get('description') or ''} Input: {{{args}}}")
    listing = "\n".join(lines)
    return (
        f"You are a helpful assistant. You can use these tools:\n{listing}\n"
        "Use this format:\nThought: ...\nAction: tool name\nAction Input: JSON\n"
        "Observation: tool result\n... (repeat as needed)\nThought: I now know the final answer.\n"
        "Final Answer: the answer"
    )
