"""Information extraction into JSON, constrained by a JSON schema: decoding can only produce
text the schema accepts, so the result always parses.

    python examples/json_extraction.py [model_path]
"""

from __future__ import annotations

import json
import sys

import loom as sgl

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "job": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "job"],
    "additionalProperties": False,
}

TEXTS = [
    "Alice Moreau is 34 and lives in Paris. Alice works as a teacher and enjoys chess.",
    "Bob, a 52-year-old doctor from Madrid, likes hiking and painting.",
]


@sgl.function
def extract_person(s, text):
    s += sgl.user("Extract the name, age and job as JSON: " + text)
    s += sgl.assistant(sgl.gen("person", max_tokens=96, json_schema=PERSON_SCHEMA))


def main(backend=None) -> list:
    states = extract_person.run_batch([{"text": t} for t in TEXTS], backend=backend, temperature=0)
    for s in states:
        try:
            print(json.loads(s["person"]))
        except json.JSONDecodeError:
            print("not JSON (is grammar-constrained decoding enabled?):", s["person"])
    return states


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
