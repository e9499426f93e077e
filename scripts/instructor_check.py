"""instructor against a running `loom serve` (the bundled model), in instructor's own venv.

    python scripts/instructor_check.py http://127.0.0.1:30123

instructor 1.17 pins an older openai than loom's tests use, so it cannot share the test
environment: scripts/instructor_job.sh builds a venv for it, starts the server from loom's
environment and runs this. Modes TOOLS and JSON_SCHEMA, max_retries=0 (a reply that does not
validate fails the check instead of being retried away), temperature 1: every reply must
validate into the pydantic model. max_tokens leaves room to finish: instructor raises
IncompleteOutputException on any finish_reason "length", also for a reply that budget
closing completed (loom keeps "length" there, as OpenAI clients expect of a budget stop).
`budget_closed` then checks that case and its workaround (see its docstring)."""

from __future__ import annotations

import sys

import instructor
import openai
from pydantic import BaseModel, Field

MODEL = "loom-bundled"


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=150)


class Weather(BaseModel):
    city: str


def main(url: str, rounds: int = 8) -> int:
    base = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    failures = 0
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(base, mode=mode)
        for i in range(rounds):
            for model, prompt in (
                (Person, "Extract as JSON: Ada is 36 years old."),
                (Weather, "What's the weather in Tokyo?"),
            ):
                try:
                    out = client.chat.completions.create(
                        model=MODEL, response_model=model, max_retries=0, temperature=1.0,
                        max_tokens=64, seed=i, messages=[{"role": "user", "content": prompt}],
                    )  # fmt: skip
                    print(f"{mode.value:12} {model.__name__:8} ok   {out!r}")
                except Exception as e:  # noqa: BLE001 - report every failure, then fail
                    failures += 1
                    print(f"{mode.value:12} {model.__name__:8} FAIL {type(e).__name__}: {e}")
    failures += budget_closed(base)
    print(f"instructor {instructor.__version__}: {failures} failures")
    return 1 if failures else 0


def budget_closed(base: openai.OpenAI, rounds: int = 8) -> int:
    """max_tokens too small for the model's own reply: budget closing completes it, loom keeps
    finish_reason "length" and says so in `usage.budget_closed`. instructor raises
    IncompleteOutputException on "length" before it validates (and does not retry it, whatever
    max_retries says). The workaround: catch it and validate `e.last_completion` when its usage
    says the reply was closed; a reply cut without closing stays an error."""
    from instructor.core.exceptions import IncompleteOutputException

    failures = 0
    # above the shortest complete reply (the ReAct call 'Action: Person\nAction Input:
    # {"name": "", "age": 0}' is 19 tokens), below what the model writes on its own (21 and
    # up); under the shortest reply nothing can close it (the reply is cut, yet usage still
    # counts it in budget_closed: validating, not the count, is the proof)
    budget = {instructor.Mode.TOOLS: 20, instructor.Mode.JSON_SCHEMA: 14}
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(base, mode=mode)
        raised = 0
        for i in range(rounds):
            try:
                out = client.chat.completions.create(
                    model=MODEL, response_model=Person, max_retries=2, temperature=1.0,
                    max_tokens=budget[mode], seed=i,
                    messages=[{"role": "user", "content": "Extract as JSON: Ada is 36 years old."}],
                )  # fmt: skip
                print(f"{mode.value:12} closed   finished in budget {out!r}")
                continue
            except IncompleteOutputException as e:
                raised += 1
                done = e.last_completion
            choice = done.choices[0]
            closed = (done.usage.model_extra or {}).get("budget_closed", 0)
            if mode == instructor.Mode.TOOLS:
                text = choice.message.tool_calls[0].function.arguments
            else:
                text = choice.message.content
            try:
                assert choice.finish_reason == "length" and closed == 1, (choice, done.usage)
                out = Person.model_validate_json(text)
                print(f"{mode.value:12} closed   raised, closed reply validates: {out!r}")
            except Exception as e:  # noqa: BLE001 - report every failure, then fail
                failures += 1
                print(f"{mode.value:12} closed   FAIL {type(e).__name__}: {e}")
        print(f"{mode.value:12} closed   {raised}/{rounds} raised IncompleteOutputException")
        if raised == 0:  # the budget never bit: the check proved nothing
            failures += 1
            print(f"{mode.value:12} closed   FAIL max_tokens never cut a reply")
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
