"""Tool calling on a real model (SmolLM2-135M-Instruct, its GGUF), driven by the official
`openai` client: the call format comes from the model (no --tool-call-parser), a `required`
call is schema-valid and parsed into `tool_calls`, and `auto` calls on a question that needs
the tool. Few short prompts: the server start dominates (about 10 s idle)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from loom.runtime.server import tools as T
from loom.runtime.server.runtime_client import Runtime

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
# BFCL simple_python_1 (bfcl-eval 2026.3.23, Apache-2.0), its function document converted by
# BFCL's own OpenAI conversion ("." in the name becomes "_")
FACTORIAL = {
    "type": "function",
    "function": {
        "name": "math_factorial",
        "description": "Calculate the factorial of a given number.",
        "parameters": {
            "type": "object",
            "properties": {
                "number": {
                    "type": "integer",
                    "description": "The number for which factorial needs to be calculated.",
                }
            },
            "required": ["number"],
        },
    },
}


def smollm2_template(path: str) -> str:
    import gguf

    return gguf.GGUFReader(path).fields["tokenizer.chat_template"].contents()


def test_format_is_chosen_from_the_model(real_gguf):
    """SmolLM2's own template (from its GGUF) names the model and has no `tools` variable:
    its calls are the smollm2 format; Gemma 3 (a template without tools) by its architecture
    read from its GGUF; a template that writes
    <tool_call> blocks itself is qwen25 (Hermes); the flag still wins."""
    template = smollm2_template(real_gguf("smollm2"))
    assert not T.template_uses_tools(template)
    assert T.get_format(None, "llama", template=template).name == "smollm2"
    assert T.get_format(None, "llama", template="<|im_start|>{{ m }}").name == "llama3"
    from loom.runtime.gguf.tokenizer import GEMMA3_CHAT_TEMPLATE
    from loom.runtime.model_loader import load_config

    gemma = load_config(real_gguf("gemma3-270m")).model_type
    assert T.get_format(None, gemma, template=GEMMA3_CHAT_TEMPLATE).name == "gemma3"
    hermes = "{% for t in tools %}{{ t }}{% endfor %}<tool_call>\n{{ call }}\n</tool_call>"
    assert T.get_format(None, "llama", template=hermes).name == "qwen25"
    assert T.get_format("llama3", "llama", template=template).name == "llama3"


def test_smollm2_prompt_lists_the_tools_as_taught():
    fmt = T.FORMATS["smollm2"]
    prompt = T.tool_system_prompt(fmt, [WEATHER])
    listed = prompt.split("<tools>")[1].split("</tools>")[0]
    assert json.loads(listed) == [WEATHER["function"]]
    assert prompt.endswith("<tool_call>[\n" + prompt.split("<tool_call>[\n")[1])
    # the calls the grammar allows are the shape the prompt shows, and the parser reads them
    text = fmt.render_calls([("get_weather", '{"city": "Paris"}')])
    assert (
        text
        == '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n]</tool_call>'
    )
    p = T.ToolCallParser(fmt)
    content, calls = T.assemble(p.feed("<tool_call>[]</tool_call>") + p.finish())
    assert (content, calls) == ("", [])  # the taught "no call needed" answer


@pytest.fixture(scope="module")
def client(real_gguf):
    with Runtime(real_gguf("smollm2"), max_total_tokens=4096, served_model_name="smollm2") as rt:
        yield openai.OpenAI(base_url=rt.url + "/v1", api_key="x", max_retries=0, timeout=600)


def _call(client, question, tools, max_tokens=128, **kw):
    return client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": question}],
        tools=tools,
        temperature=0,
        max_tokens=max_tokens,
        **kw,
    ).choices[0]


def test_required_call_is_schema_valid_and_parsed(client):
    for question, tool, args in (
        ("What is the weather like in Paris right now?", WEATHER, {"city": "Paris"}),
        ("Calculate the factorial of 5 using math functions.", FACTORIAL, {"number": 5}),
    ):
        choice = _call(client, question, [WEATHER, FACTORIAL], tool_choice="required")
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
        got = json.loads(calls[0].function.arguments)
        jsonschema.validate(got, tool["function"]["parameters"])
        assert (calls[0].function.name, got) == (tool["function"]["name"], args)
        assert not (choice.message.content or "").strip()


def test_auto_leaves_the_choice_to_the_model_and_parses_what_it_chose(client):
    """tool_choice auto: the model chooses between prose and a call, and what it chose is
    returned as such. Which one SmolLM2 chooses here is not stable across machines: a call on
    the AVX-512 machine of sessions 15-19, prose on session 20's (an AVX2 CPU and a fresh
    package resolution; main's code too; the cause is not isolated): its first token there
    is 'The' at logprob -2.04 with four other prose openings within 0.9 and no '<' in the
    top five. So the test holds either answer to its form: a call is the one tool with
    schema-valid arguments and finish_reason tool_calls; prose has no call markup left in it."""
    choice = _call(
        client,
        "Calculate the factorial of 5 using math functions.",
        [FACTORIAL],
        tool_choice="auto",
    )
    calls = choice.message.tool_calls or []
    if calls:
        assert choice.finish_reason == "tool_calls" and len(calls) == 1, choice
        assert calls[0].function.name == "math_factorial", choice
        got = json.loads(calls[0].function.arguments)
        jsonschema.validate(got, FACTORIAL["function"]["parameters"])
        assert got == {"number": 5}
    else:
        content = choice.message.content or ""
        assert choice.finish_reason in ("stop", "length") and content.strip(), choice
        assert "<tool_call>" not in content and "math_factorial(" not in content, choice


def test_grammar_off_leaves_the_model_to_itself(client):
    """constrain_tools false: the same prompt, no grammar. SmolLM2 then copies the prompt's
    example call (`func_name1`) after some prose instead of calling the tool; a short budget
    is enough to see it does not call (with the grammar on the call is certain)."""
    choice = _call(
        client,
        "Calculate the factorial of 5 using math functions.",
        [FACTORIAL],
        max_tokens=32,
        tool_choice="required",
        extra_body={"constrain_tools": False},
    )
    names = [c.function.name for c in choice.message.tool_calls or []]
    assert names != ["math_factorial"], choice
