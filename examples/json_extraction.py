"""Information extraction into JSON, constrained by a JSON schema (decoding can only produce
text the schema accepts).

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
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@sgl.function
def extract_person(s, text):
    s += sgl.user("Extract the person as JSON with name, age and city.\n\n" + text)
    s += sgl.assistant(sgl.gen("person", max_tokens=96, json_schema=PERSON_SCHEMA))


def main(backend=None) -> sgl.ProgramState:
    state = extract_person.run(
        text="Alice is 31 years old and lives in Paris, where she works as a baker.",
        backend=backend,
        temperature=0,
    )
    raw = state["person"]
    try:
        print(json.dumps(json.loads(raw), indent=2))
    except json.JSONDecodeError:
        print("not JSON (is grammar-constrained decoding enabled?):", raw)
    return state


if __name__ == "__main__":
    engine = sgl.Engine(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        main(engine)
    finally:
        engine.shutdown()
