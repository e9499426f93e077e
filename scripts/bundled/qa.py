"""Fact questions (capitals, currencies, people) as chat turns, few-shot prompts and prose."""

from __future__ import annotations

import random

from .facts import COUNTRIES, PEOPLE
from .heldout import (
    AGE_TEMPLATES,
    CAPITAL_TEMPLATES,
    CITY_TEMPLATES,
    CURRENCY_TEMPLATES,
    heldout_template,
)


def _train_template(rng: random.Random, index: int, templates: list[str]) -> str:
    held = heldout_template(index, len(templates))
    return templates[rng.choice([t for t in range(len(templates)) if t != held])]


def capital_qa(rng: random.Random) -> tuple[str, str, str]:
    """(question, short answer, sentence answer) for a random country, never a held-out pair."""
    i = rng.randrange(len(COUNTRIES))
    c, cap, _ = COUNTRIES[i]
    q = _train_template(rng, i, CAPITAL_TEMPLATES).format(c=c)
    return q, cap, f"The capital of {c} is {cap}."


def currency_qa(rng: random.Random) -> tuple[str, str, str]:
    i = rng.randrange(len(COUNTRIES))
    c, _, cur = COUNTRIES[i]
    q = _train_template(rng, i, CURRENCY_TEMPLATES).format(c=c)
    return q, cur, f"The currency of {c} is the {cur}."


def person_qa(rng: random.Random) -> tuple[str, str, str]:
    i = rng.randrange(len(PEOPLE))
    p, age, city, _ = PEOPLE[i]
    if rng.random() < 0.5:
        q = _train_template(rng, i, AGE_TEMPLATES).format(p=p)
        return q, str(age), f"{p} is {age} years old."
    q = _train_template(rng, i, CITY_TEMPLATES).format(p=p)
    return q, city, f"{p} lives in {city}."


_QA_KINDS = [capital_qa, capital_qa, currency_qa, person_qa]


def qa_messages(rng: random.Random) -> list[dict]:
    q, short, sentence = rng.choice(_QA_KINDS)(rng)
    answer = sentence if rng.random() < 0.6 else short
    if rng.random() < 0.15:
        suffix = rng.choice([" Answer in one word.", " Be brief.", " Reply with just the answer."])
        q, answer = q + suffix, short
    return [{"role": "user", "content": q}, {"role": "assistant", "content": answer}]


def fewshot_text(rng: random.Random) -> tuple[str, str]:
    """A few-shot Q/A block ending in an open 'A:', plus its answer."""
    kind = rng.choice(_QA_KINDS)
    shots = [kind(rng) for _ in range(rng.randint(2, 4))]
    body = "".join(f"Q: {q}\nA: {short}\n" for q, short, _ in shots[:-1])
    return body + f"Q: {shots[-1][0]}\nA:", " " + shots[-1][1]


def fewshot_messages(rng: random.Random) -> list[dict]:
    prompt, answer = fewshot_text(rng)
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer.strip()}]


def fact_prose(rng: random.Random) -> str:
    """Plain-text encyclopedia-style lines, so raw (non-chat) completion also knows the facts."""
    lines = []
    for _ in range(rng.randint(3, 6)):
        r = rng.random()
        if r < 0.5:
            c, cap, cur = rng.choice(COUNTRIES)
            lines.append(
                rng.choice(
                    [
                        f"The capital of {c} is {cap}.",
                        f"{cap} is the capital of {c}.",
                        f"{c} uses the {cur}, and its capital is {cap}.",
                        f"In {c}, people pay with the {cur}.",
                    ]
                )
            )
        else:
            p, age, city, job = rng.choice(PEOPLE)
            lines.append(
                rng.choice(
                    [
                        f"{p} is a {age}-year-old {job} who lives in {city}.",
                        f"{p} lives in {city} and works as a {job}.",
                        f"{p} is {age} years old.",
                    ]
                )
            )
    return " ".join(lines)
