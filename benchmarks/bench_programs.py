"""The loom language end to end: three programs, each run three ways on the same engine build.

- few-shot QA: a ~1,000-token few-shot prefix of capital/currency questions, 32 questions,
  through `run_batch` (8 new tokens each);
- tree of thought: a ~300-token shared context, `fork(8)` with 48 new tokens per branch
  (`ignore_eos`, so the work is fixed), `join("concate_and_append")`, a final 24-token gen;
  4 problems through `run_batch`;
- JSON agent: 4 dependent chat turns, each gen constrained by a JSON schema (the last turn is
  built from what the first two extracted), 8 inputs through `run_batch`.

The three ways: the language on an Engine with the radix cache (the default); the language on
a second Engine with `disable_radix_cache=True`; and "no language": the generate calls the
program sent (recorded from the first way: prompt text and sampling parameters, exactly),
replayed one after another with plain `engine.generate` in one thread, on the cache-on
engine after `flush_cache()`. Greedy decoding throughout, so the replay must reproduce the
program's outputs; the last column says whether it did. Each engine runs every program once
on one input (untimed) first, so grammar compilation and first-call costs are not measured.

    python benchmarks/bench_programs.py [--model-path PATH] [--torch-threads N]

`--torch-threads 1` is for shared machines: on a 2-core box at load ~4, torch's two-thread
kernels contended so badly that an 8-request decode step took 0.24 s instead of 0.005 s, which
swamps everything measured here (that run took 6 min; with one thread, under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import threading
import time

import loom as sgl
from loom.backends.engine import EngineBackend

COUNTRIES = [
    ("France", "Paris", "euro"),
    ("Germany", "Berlin", "euro"),
    ("Italy", "Rome", "euro"),
    ("Spain", "Madrid", "euro"),
    ("Portugal", "Lisbon", "euro"),
    ("Ireland", "Dublin", "euro"),
    ("Greece", "Athens", "euro"),
    ("Austria", "Vienna", "euro"),
    ("Finland", "Helsinki", "euro"),
    ("Netherlands", "Amsterdam", "euro"),
    ("United Kingdom", "London", "pound sterling"),
    ("Switzerland", "Bern", "Swiss franc"),
    ("Sweden", "Stockholm", "Swedish krona"),
    ("Norway", "Oslo", "Norwegian krone"),
    ("Denmark", "Copenhagen", "Danish krone"),
    ("Poland", "Warsaw", "zloty"),
    ("Hungary", "Budapest", "forint"),
    ("Czechia", "Prague", "Czech koruna"),
    ("Russia", "Moscow", "ruble"),
    ("Turkey", "Ankara", "lira"),
    ("Egypt", "Cairo", "Egyptian pound"),
    ("Nigeria", "Abuja", "naira"),
    ("Kenya", "Nairobi", "Kenyan shilling"),
    ("South Africa", "Pretoria", "rand"),
    ("Morocco", "Rabat", "dirham"),
    ("India", "New Delhi", "rupee"),
    ("China", "Beijing", "yuan"),
    ("Japan", "Tokyo", "yen"),
    ("South Korea", "Seoul", "won"),
    ("Thailand", "Bangkok", "baht"),
    ("Vietnam", "Hanoi", "dong"),
    ("Indonesia", "Jakarta", "rupiah"),
    ("Australia", "Canberra", "Australian dollar"),
    ("Canada", "Ottawa", "Canadian dollar"),
    ("Mexico", "Mexico City", "Mexican peso"),
    ("Brazil", "Brasilia", "real"),
    ("Peru", "Lima", "sol"),
]


def few_shot_prefix(tok, target: int) -> str:
    rng = random.Random(1)
    text = "Answer each question with a word or two.\n"
    while len(tok.encode(text)) < target:
        c, cap, cur = rng.choice(COUNTRIES)
        if rng.random() < 0.5:
            text += f"Q: What is the capital of {c}?\nA: {cap}\n"
        else:
            text += f"Q: What currency is used in {c}?\nA: {cur}\n"
    return text


def fact_context(tok, target: int) -> str:
    rng = random.Random(2)
    text = "You plan trips. Facts you may use:\n"
    while len(tok.encode(text)) < target:
        c, cap, cur = rng.choice(COUNTRIES)
        text += f"{c} uses the {cur}, and its capital is {cap}. "
    return text + "\n"


# ---------------------------------------------------------------------- the programs
@sgl.function
def few_shot_qa(s, question, shots):
    s += sgl.user(shots + "Q: " + question + "\nA:")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, stop="\n"))


@sgl.function
def tree_of_thought(s, problem, context):
    s += context + "Problem: " + problem + "\n"
    branches = s.fork(8)
    for i, b in enumerate(branches):
        b += f"Thought {i + 1}:" + sgl.gen("thought", max_tokens=48, ignore_eos=True) + "\n"
    branches.join("concate_and_append")
    s += "Best plan:" + sgl.gen("plan", max_tokens=24, stop="\n")


def _schema(**props) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 24}
AGE_SCHEMA = _schema(name=NAME, age={"type": "integer", "minimum": 0, "maximum": 120})
PLACE_SCHEMA = _schema(city={"type": "string", "maxLength": 16}, job=NAME)
HOBBY_SCHEMA = _schema(hobbies={"type": "array", "items": NAME, "maxItems": 3})
CARD_SCHEMA = _schema(name=NAME, city={"type": "string", "maxLength": 16}, job=NAME)


def _field(state, var: str, key: str) -> str:
    try:
        return str(json.loads(state[var]).get(key, "?"))
    except (json.JSONDecodeError, AttributeError):
        return "?"


@sgl.function
def json_agent(s, text):
    s += sgl.system("You are a helpful assistant. Reply with compact JSON.")
    s += sgl.user("Extract the name and age as JSON: " + text)
    s += sgl.assistant(sgl.gen("person", max_tokens=32, json_schema=AGE_SCHEMA))
    s += sgl.user("Extract the city and job as JSON: " + text)
    s += sgl.assistant(sgl.gen("place", max_tokens=32, json_schema=PLACE_SCHEMA))
    s += sgl.user("Extract the hobbies as JSON: " + text)
    s += sgl.assistant(sgl.gen("hobbies", max_tokens=40, json_schema=HOBBY_SCHEMA))
    name, city, job = (
        _field(s, "person", "name"),
        _field(s, "place", "city"),
        _field(s, "place", "job"),
    )
    s += sgl.user(f"Extract the name, city and job as JSON: {name} works as a {job} in {city}.")
    s += sgl.assistant(sgl.gen("card", max_tokens=40, json_schema=CARD_SCHEMA))


PEOPLE = [
    ("Alice Moreau", 34, "Paris", "teacher", "chess"),
    ("Bob Keller", 52, "Madrid", "doctor", "hiking and painting"),
    ("Carol Lind", 27, "Oslo", "baker", "skiing"),
    ("David Okafor", 45, "Nairobi", "pilot", "running and reading"),
    ("Emma Rossi", 61, "Rome", "lawyer", "gardening"),
    ("Farid Haddad", 38, "Cairo", "engineer", "football and music"),
    ("Grace Tan", 23, "Tokyo", "nurse", "photography"),
    ("Hugo Lopes", 70, "Lisbon", "farmer", "fishing and cooking"),
]


def workloads(tok) -> dict:
    """name -> (program, batch of kwargs)."""
    shots = few_shot_prefix(tok, 1000)
    questions = [f"What is the capital of {c}?" for c, _, _ in COUNTRIES[:32]]
    context = fact_context(tok, 300)
    problems = [f"plan a three-day trip to {c}." for c, _, _ in COUNTRIES[27:31]]
    texts = [
        f"{n} is {a} and lives in {c}. {n.split()[0]} works as a {j} and enjoys {h}."
        for n, a, c, j, h in PEOPLE
    ]
    return {
        "few-shot QA": (few_shot_qa.bind(shots=shots), [{"question": q} for q in questions]),
        "tree of thought": (
            tree_of_thought.bind(context=context),
            [{"problem": p} for p in problems],
        ),
        "JSON agent": (json_agent, [{"text": t} for t in texts]),
    }


# ---------------------------------------------------------------------- measuring
class RecordingBackend(EngineBackend):
    """The Engine backend, noting each generate request a program sends (and its output) so
    the same calls can be replayed without the language. Prefill-only requests (`cache_prefix`)
    are the language's own optimization and are not noted."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls: list[tuple[dict, str]] = []
        self._lock = threading.Lock()

    def _request(self, body: dict):
        out = super()._request(body)
        if body["sampling_params"].get("max_new_tokens"):
            with self._lock:
                self.calls.append((body, out["text"]))
        return out


def counters(engine) -> tuple[int, int]:
    info = engine.get_server_info()
    return info["prompt_tokens"], info["cached_tokens"]


def measure(engine, fn, *args):
    """(fn(*args), seconds, cache hit rate from the engine's prompt/cached token counters)."""
    p0, c0 = counters(engine)
    t = time.perf_counter()
    result = fn(*args)
    elapsed = time.perf_counter() - t
    p1, c1 = counters(engine)
    return result, elapsed, (c1 - c0) / max(1, p1 - p0)


def run_program(program, batch: list[dict], backend) -> list:
    return program.run_batch(batch, backend=backend, temperature=0)


def replay(engine, calls: list[tuple[dict, str]]) -> list[str]:
    return [engine.generate(body["text"], body["sampling_params"])["text"] for body, _ in calls]


def warm_up(engine, work: dict) -> None:
    for program, batch in work.values():
        run_program(program, batch[:1], engine)
    engine.flush_cache()


def quality(name: str, states: list) -> str:
    """What the outputs are worth (the bundled model is a toy): capitals right, JSON valid."""
    if name == "few-shot QA":
        right = sum(cap in st["answer"] for st, (_, cap, _) in zip(states, COUNTRIES))
        return f"{right}/{len(states)} capitals right"
    if name == "JSON agent":
        valid = 0
        for st in states:
            for var in ("person", "place", "hobbies", "card"):
                try:
                    valid += isinstance(json.loads(st[var]), dict)
                except json.JSONDecodeError:
                    pass
        return f"{valid}/{4 * len(states)} gens valid JSON"
    firsts = [line.split(":", 1)[1] for st in states for line in st.text().splitlines()
              if line.startswith("Thought ")]  # fmt: skip
    return f"{len(set(firsts))}/{len(firsts)} distinct thoughts (first lines)"


def report(name: str, way: str, elapsed: float, n: int, hit: float) -> None:
    print(
        f"{name:16s} {way:19s} {elapsed:7.2f} s  {n / elapsed:7.2f} programs/s  "
        f"hit rate {100 * hit:5.1f}%",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the bundled model")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the engines' processes (default: torch's own choice)",
    )
    args = parser.parse_args()
    if args.torch_threads:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # inherited by the fork server

    # (workload, way) -> (seconds, hit rate), way in language / sequential / no-cache
    results: dict[tuple[str, str], tuple[float, float]] = {}
    notes: dict[str, tuple[int, bool, str]] = {}  # name -> (calls, replay same, quality)

    engine = sgl.Engine(args.model_path, log_level="warning")
    try:
        tok = engine.tokenizer
        work = workloads(tok)
        shots = work["few-shot QA"][0].bind_arguments["shots"]
        context = work["tree of thought"][0].bind_arguments["context"]
        print(
            f"model {engine.server_args.model_path}, torch threads "
            f"{os.environ.get('OMP_NUM_THREADS', 'default')}, {os.cpu_count()} CPUs; "
            f"few-shot prefix {len(tok.encode(shots))} tokens, "
            f"tree-of-thought context {len(tok.encode(context))} tokens\n",
            flush=True,
        )
        warm_up(engine, work)
        for name, (program, batch) in work.items():
            recorder = RecordingBackend(engine)
            engine.flush_cache()
            states, elapsed, hit = measure(engine, run_program, program, batch, recorder)
            results[(name, "language")] = (elapsed, hit)
            report(name, "language + cache", elapsed, len(batch), hit)
            engine.flush_cache()
            outs, elapsed, hit = measure(engine, replay, engine, recorder.calls)
            results[(name, "sequential")] = (elapsed, hit)
            report(name, "sequential calls", elapsed, len(batch), hit)
            same = outs == [text for _, text in recorder.calls]
            notes[name] = (len(recorder.calls), same, quality(name, states))
    finally:
        engine.shutdown()

    engine = sgl.Engine(args.model_path, disable_radix_cache=True, log_level="warning")
    try:
        warm_up(engine, work)
        for name, (program, batch) in work.items():
            _, elapsed, hit = measure(engine, run_program, program, batch, engine)
            results[(name, "no-cache")] = (elapsed, hit)
            report(name, "language, no cache", elapsed, len(batch), hit)
    finally:
        engine.shutdown()

    print(
        "\nprogram          programs calls  speedup vs no-cache  vs sequential  "
        "hit rate lang/seq  replay same  outputs"
    )
    for name, (_, batch) in work.items():
        lang, off, seq = (results[(name, w)][0] for w in ("language", "no-cache", "sequential"))
        calls, same, q = notes[name]
        hits = f"{100 * results[(name, 'language')][1]:.1f}% / {100 * results[(name, 'sequential')][1]:.1f}%"
        print(
            f"{name:16s} {len(batch):8d} {calls:5d} {off / lang:19.2f}x {seq / lang:13.2f}x  "
            f"{hits:>17s}  {'yes' if same else 'NO':>11s}  {q}"
        )


if __name__ == "__main__":
    main()
