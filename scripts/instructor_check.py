"""instructor against a running `loom serve` (the bundled model), in instructor's own venv.

    python scripts/instructor_check.py http://127.0.0.1:30123

instructor 1.17 pins an older openai than loom's tests use, so it cannot share the test
environment: scripts/instructor_job.sh builds a venv for it, starts the server from loom's
environment and runs this. Modes TOOLS and JSON_SCHEMA, max_retries=0 (a reply that does not
validate fails the check instead of being retried away), temperature 1: every reply must
validate into the pydantic model. max_tokens leaves room to finish: instructor raises
IncompleteOutputException on any finish_reason "length", also for a reply that budget
closing completed (loom keeps "length" there, as OpenAI clients expect of a budget stop)."""

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
    print(f"instructor {instructor.__version__}: {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
