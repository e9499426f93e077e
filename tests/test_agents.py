"""Real agent frameworks against a live loom server on the bundled model: LangChain's
`ChatOpenAI.bind_tools` tool loop, the OpenAI Agents SDK's chat-completions model calling a
function tool, and pydantic-ai extracting a pydantic model. They must finish without wire
errors; answer quality is not tested (the bundled model is a 4M-parameter toy), but every tool
call they receive must carry valid arguments (the grammar's guarantee)."""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import BaseModel, Field

MODEL = "loom-bundled"


@pytest.fixture(scope="module")
def server(bundled_server):
    """The session's bundled-model server (conftest.bundled_server): these tests only send it
    requests."""
    assert bundled_server.server_args.served_model_name == MODEL
    return bundled_server


def test_bundled_model_calls_tools_in_auto_mode(server):
    """The bundled model writes ReAct traces; its default parser (react) turns them into
    OpenAI tool calls, streamed and not, and a tool result continues the conversation."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    kw = dict(
        model=MODEL,
        tools=[weather],
        temperature=0,
        max_tokens=80,
        messages=[{"role": "user", "content": "What's the weather in Tokyo?"}],
    )
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            streamed += d.function.arguments or ""
    assert streamed == call.function.arguments
    follow = kw["messages"] + [
        c.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12°C, sunny"},
    ]
    final = client.chat.completions.create(**{**kw, "messages": follow})
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_langchain_bind_tools_loop(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calls = []

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"18C and sunny in {city}"

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="x", max_tokens=80, temperature=0
    )
    first = llm.bind_tools([get_weather], tool_choice="required")
    messages = [HumanMessage("What's the weather in Tokyo?")]
    ai = first.invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    messages.append(ai)
    for call in ai.tool_calls:
        assert isinstance(call["args"]["city"], str)
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = llm.bind_tools([get_weather]).invoke(messages)  # auto: text or another valid call
    assert isinstance(final.content, str)
    for call in final.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert calls


def test_openai_agents_sdk_function_tool(server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return f"18C and sunny in {city}"

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
            # greedy: at temperature 1 the ReAct thought before the call is a draw that may
            # run past max_tokens; the wire path is what is tested, the same either way
            model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
            tools=[get_weather],
            tool_use_behavior="stop_on_first_tool",
        )
        return await Runner.run(agent, "What's the weather in Paris?", max_turns=3)

    result = asyncio.run(run())
    assert len(seen) >= 1 and all(isinstance(c, str) for c in seen)
    assert result.final_output == f"18C and sunny in {seen[0]}"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


def test_pydantic_ai_extracts_a_model(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(
        MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key="x")
    )
    agent = Agent(model, output_type=Person, model_settings={"max_tokens": 80, "temperature": 0})
    result = agent.run_sync("Extract the name and age: Alice is 31 and lives in Paris.")
    assert isinstance(result.output, Person)
    json.dumps(result.output.model_dump())
