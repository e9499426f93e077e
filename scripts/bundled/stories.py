"""Template short stories and small talk, for fluent free-form chat."""

from __future__ import annotations

import random

from .facts import _FIRST, CITIES

_ANIMALS = [
    "cat",
    "dog",
    "fox",
    "owl",
    "rabbit",
    "bear",
    "turtle",
    "mouse",
    "horse",
    "dragon",
    "robot",
    "penguin",
]
_ADJ = ["brave", "curious", "sleepy", "clever", "shy", "happy", "tiny", "grumpy", "kind", "lonely"]
_GOALS = [
    ("find a lost key", "found the key under an old stone"),
    ("learn to sing", "sang a song that made the whole village smile"),
    ("cross the river", "built a small raft and crossed the river at sunrise"),
    ("make a new friend", "met a friend who liked the same games"),
    ("climb the tall mountain", "reached the top and saw the sea far away"),
    ("bake a cake", "baked a cake with apples and honey"),
    ("fix a broken clock", "fixed the clock, and it ticked again"),
    ("see the stars", "watched the stars all night from the hill"),
]
_PLACES = [
    "a small village",
    "a quiet forest",
    "a busy city",
    "an old castle",
    "a sunny island",
    "a snowy valley",
]
_MIDDLE = [
    "The road was long and the wind was cold.",
    "At first, nothing seemed to work.",
    "Along the way, {hero} asked an old {helper} for help.",
    "Some days were hard, but {hero} did not give up.",
    "{hero} tried again and again, learning a little each time.",
]
_ENDINGS = [
    "From that day on, {hero} was never afraid again.",
    "And everyone agreed it was the best day of the year.",
    "{hero} smiled, knowing that patience pays off.",
    "That night, {hero} slept happily, dreaming of new adventures.",
]


_SYLLABLES = (
    "ka lo mi ra zen tor vel an is bru dor fen gal hul jin kor lun mar nor pel qui ros sul tam "
    "ur vex wyn xan yor zul bel cor dra eth fal gor hin ith jor kel lor mor nev oth par rin sar "
    "thal ul vor wen yl zar ash bri cal dun el fir gwen har ion kas lis mel nim"
).split()


def invented_name(rng: random.Random) -> str:
    """Fantasy names give the tokenizer a long tail of rare words, as real vocabularies have."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def story(rng: random.Random, animal: str, adj: str, goal: int) -> str:
    hero = rng.choice(_FIRST) if rng.random() < 0.6 else invented_name(rng)
    place = rng.choice(_PLACES) if rng.random() < 0.5 else f"the land of {invented_name(rng)}"
    want, done = _GOALS[goal]
    parts = [
        f"Once upon a time, in {place}, there lived a {adj} {animal} named {hero}.",
        f"{hero} wanted to {want}.",
    ]
    for s in rng.sample(_MIDDLE, rng.randint(1, 3)):
        parts.append(s.format(hero=hero, helper=rng.choice(_ANIMALS)))
    parts.append(f"In the end, {hero} {done}.")
    parts.append(rng.choice(_ENDINGS).format(hero=hero))
    return " ".join(parts)


def story_messages(rng: random.Random) -> list[dict]:
    animal, adj, goal = rng.choice(_ANIMALS), rng.choice(_ADJ), rng.randrange(len(_GOALS))
    q = rng.choice(
        [
            "Write a short story about a {adj} {animal}.",
            "Tell me a story about a {animal} who wants to {want}.",
            "Can you write a short story about a {adj} {animal} who wants to {want}?",
        ]
    ).format(adj=adj, animal=animal, want=_GOALS[goal][0])
    return [
        {"role": "user", "content": q},
        {"role": "assistant", "content": story(rng, animal, adj, goal)},
    ]


_SMALL_TALK = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What can I do for you?"),
    ("Who are you?", "I am Loom, a small assistant model trained on synthetic data."),
    (
        "What can you do?",
        "I can answer simple questions about countries and people, do arithmetic, extract JSON, use tools and tell short stories.",
    ),
    ("Thank you!", "You're welcome!"),
    ("Thanks for the help.", "Happy to help. Anything else?"),
    ("Goodbye.", "Goodbye! Have a nice day."),
    ("How are you?", "I am doing well, thank you. How can I help?"),
]


def small_talk_messages(rng: random.Random) -> list[dict]:
    if rng.random() < 0.3:
        city = rng.choice(CITIES)
        q, a = (
            f"Tell me something about {city}.",
            f"{city} is a city I know a little about. I can tell you facts about capitals and currencies.",
        )
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    q, a = rng.choice(_SMALL_TALK)
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
