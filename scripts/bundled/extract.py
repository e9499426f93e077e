"""'Extract as JSON' tasks: a sentence about invented people, answered with compact valid JSON."""

from __future__ import annotations

import json
import random

from .facts import _FIRST, _LAST, COUNTRIES, HOBBIES, JOBS
from .heldout import is_heldout_name

_CAPITAL_COUNTRY = {cap: c for c, cap, _ in COUNTRIES}
_CAPITALS = sorted(_CAPITAL_COUNTRY)

_INSTRUCTIONS = [
    "Extract the {keys} as JSON: {text}",
    "Extract the {keys} as JSON.\n{text}",
    "Return a JSON object with the {keys} from this text: {text}",
    "Read the text and output JSON with the {keys}.\nText: {text}",
]


def random_name(rng: random.Random, heldout: bool) -> str:
    while True:
        fi, li = rng.randrange(len(_FIRST)), rng.randrange(len(_LAST))
        if is_heldout_name(fi, li) == heldout:
            return f"{_FIRST[fi]} {_LAST[li]}" if rng.random() < 0.6 else _FIRST[fi]


def _person(rng: random.Random, heldout: bool) -> dict:
    return {
        "name": random_name(rng, heldout),
        "age": rng.randint(18, 90),
        "city": rng.choice(_CAPITALS),
        "job": rng.choice(JOBS),
        "hobbies": rng.sample(HOBBIES, rng.randint(1, 3)),
    }


def _and_list(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _describe(p: dict, rng: random.Random) -> str:
    return rng.choice(
        [
            "{name} is {age} and lives in {city}. {name} works as a {job} and enjoys {hob}.",
            "{name}, a {age}-year-old {job} from {city}, likes {hob}.",
            "Meet {name}. They are {age} years old, work as a {job} in {city}, and love {hob}.",
            "My friend {name} is a {job} in {city}. {name} is {age} years old and enjoys {hob}.",
        ]
    ).format(hob=_and_list(p["hobbies"]), **p)


def _keys_phrase(keys: list[str]) -> str:
    return _and_list(keys)


def extraction(rng: random.Random, heldout: bool = False) -> tuple[str, str]:
    """(prompt, compact JSON answer); heldout=True draws only names never used in training."""
    p = _person(rng, heldout)
    shape = rng.randrange(7)
    text = _describe(p, rng)
    if shape < 4:
        keys = [["name", "age"], ["name", "city"], ["name", "age", "job"], ["name", "hobbies"]][
            shape
        ]
        obj = {k: p[k] for k in keys}
        phrase = _keys_phrase(keys)
    elif shape == 4:
        obj = {
            "person": {"name": p["name"], "age": p["age"]},
            "location": {"city": p["city"], "country": _CAPITAL_COUNTRY[p["city"]]},
        }
        phrase = "person (name, age) and location (city, country)"
    elif shape == 5:
        q = _person(rng, heldout)
        text = f"{p['name']} is {p['age']} years old and {q['name']} is {q['age']}."
        obj = {
            "people": [{"name": p["name"], "age": p["age"]}, {"name": q["name"], "age": q["age"]}]
        }
        phrase = "people (a list of name and age)"
    else:
        obj = {"name": p["name"], "job": p["job"], "is_student": p["job"] == "student"}
        phrase = "name, job and is_student"
    prompt = rng.choice(_INSTRUCTIONS).format(keys=phrase, text=text)
    return prompt, json.dumps(obj)


def extraction_messages(rng: random.Random) -> list[dict]:
    prompt, answer = extraction(rng)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def json_list_messages(rng: random.Random) -> list[dict]:
    """'List N x as a JSON array' - arrays of strings."""
    pools = {"hobbies": HOBBIES, "jobs": JOBS, "capital cities": _CAPITALS}
    what = rng.choice(sorted(pools))
    n = rng.randint(2, 4)
    items = rng.sample(pools[what], n)
    q = rng.choice(["List {n} {w} as a JSON array.", "Give me {n} {w} in a JSON list."]).format(
        n=n, w=what
    )
    return [{"role": "user", "content": q}, {"role": "assistant", "content": json.dumps(items)}]
