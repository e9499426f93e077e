"""The loom language end to end: three programs, each run three ways on the same engine build.

- few-shot QA: a ~1,000-token few-shot prefix of capital/currency questions, 32 questions,
  through `run_batch` (8 new tokens each);
- tree of thought: a ~300-token shared context, `fork(8)` with 48 new tokens per branch
  (`ignore_eos`, so the work is fixed), `join("concate_and_append")`, a final 24-token gen;
  4 problems through `run_batch`;
- JSON agent: 4 dependent chat turns, each gen constrained by a JSON schema (the last turn is
  built from what the first two extracted), 8 inputs through `run_batch`.

The ways: the language on an Engine with the radix cache (the default); the language on a
second Engine with `disable_radix_cache=True`; and two without the language, replaying the
generate calls the program sent (recorded from the first way: prompt text and sampling
parameters, exactly) on the cache-on engine after `flush_cache()`:
- "batched calls", what a user would write by hand: the calls grouped by dependency depth (a
  call depends on an earlier one when its prompt holds that call's prompt tail followed by its
  output), each group sent as one batched `engine.generate` — this is the baseline that the
  language's speed-up is quoted against;
- "sequential calls": one after another in one thread (the strictly serial lower bound).
Greedy decoding throughout, so the replays should reproduce the program's outputs; the
"replay same" column says whether they did. Each engine runs every program once on one input
(untimed) first, so grammar compilation and first-call costs are not measured. The ways
alternate within each round (--rounds); times are medians, ratios median per-round ratios.

    python benchmarks/bench_programs.py [--model bundled|qwen0.5b-f32|PATH] [--torch-threads N]
        [--rounds 3] [--scale 1]

`--torch-threads 1` is for shared machines: on a 2-core box at load ~4, torch's two-thread
kernels contended so badly that an 8-request decode step took 0.24 s instead of 0.005 s, which
swamps everything measured here (that run took 6 min; with one thread, under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time

import common

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


def workloads(tok, scale: float = 1.0) -> dict:
    """name -> (program, batch of kwargs); scale shrinks prefixes and batch sizes."""

    def sz(base: int) -> int:
        return max(1, round(base * scale))

    shots = few_shot_prefix(tok, sz(1000))
    questions = [f"What is the capital of {c}?" for c, _, _ in COUNTRIES[: sz(32)]]
    context = fact_context(tok, sz(300))
    problems = [f"plan a three-day trip to {c}." for c, _, _ in COUNTRIES[27 : 27 + sz(4)]]
    texts = [
        f"{n} is {a} and lives in {c}. {n.split()[0]} works as a {j} and enjoys {h}."
        for n, a, c, j, h in PEOPLE[: sz(8)]
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


def stages(calls: list[tuple[dict, str]]) -> list[list[int]]:
    """Call indices grouped by dependency depth. Call i depends on an earlier call j when i's
    prompt holds the tail of j's prompt followed by j's output (a chat turn continued, a fork
    joined); calls of one depth never depend on each other, so each group is one batch."""
    depth: list[int] = []
    for i, (body, _) in enumerate(calls):
        d = 0
        for j in range(i):
            prev, out = calls[j][0]["text"], calls[j][1]
            if out and prev[-40:] + out in body["text"]:
                d = max(d, depth[j] + 1)
        depth.append(d)
    return [[i for i, d in enumerate(depth) if d == k] for k in range(max(depth, default=-1) + 1)]


def replay_batched(engine, calls: list[tuple[dict, str]], groups: list[list[int]]) -> list[str]:
    """The recorded calls as a user would batch them by hand: one generate per dependency depth."""
    texts: list[str] = [""] * len(calls)
    for group in groups:
        outs = engine.generate(
            [calls[i][0]["text"] for i in group], [calls[i][0]["sampling_params"] for i in group]
        )
        for i, o in zip(group, outs, strict=True):
            texts[i] = o["text"]
    return texts


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


WAYS = {
    "language": "language + cache",
    "batched": "batched calls",
    "sequential": "sequential calls",
    "no-cache": "language, no cache",
}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="bundled", help=f"one of {common.MODELS} or a folder")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="threads for the engines' schedulers (default: loom's, CPU count - 1)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--scale", type=float, default=1.0, help="workload size factor")
    parser.add_argument("--skip-sequential", action="store_true")
    args = parser.parse_args(argv)
    label, path = common.resolve_model(args.model)
    kw = {"log_level": "warning", "cpu_threads": args.torch_threads}
    print(common.header("bench_programs"))

    secs: dict[tuple[str, str], list[float]] = {}
    hits: dict[tuple[str, str], list[float]] = {}
    notes: dict[str, tuple[int, int, bool, bool, str]] = {}
    engine = sgl.Engine(path, **kw)
    nocache = sgl.Engine(path, disable_radix_cache=True, **kw)
    try:
        tok = engine.tokenizer
        work = workloads(tok, args.scale)
        shots = work["few-shot QA"][0].bind_arguments["shots"]
        context = work["tree of thought"][0].bind_arguments["context"]
        print(
            f"model {label}, threads {engine.server_args.effective_cpu_threads}, "
            f"{os.cpu_count()} CPUs, scale {args.scale}, {args.rounds} rounds alternating; "
            f"few-shot prefix {len(tok.encode(shots))} tokens, "
            f"tree-of-thought context {len(tok.encode(context))} tokens\n",
            flush=True,
        )
        warm_up(engine, work)
        warm_up(nocache, work)
        for name, (program, batch) in work.items():
            recorder = None
            same_b = same_s = True
            for _ in range(args.rounds):

                def note(way, elapsed, hit, name=name):
                    secs.setdefault((name, way), []).append(elapsed)
                    hits.setdefault((name, way), []).append(hit)

                rec = RecordingBackend(engine)
                engine.flush_cache()
                states, elapsed, hit = measure(engine, run_program, program, batch, rec)
                note("language", elapsed, hit)
                if recorder is None:
                    recorder, first_states = rec, states
                calls = recorder.calls
                expected = [text for _, text in calls]
                _, elapsed, hit = measure(nocache, run_program, program, batch, nocache)
                note("no-cache", elapsed, hit)
                groups = stages(calls)
                engine.flush_cache()
                outs, elapsed, hit = measure(engine, replay_batched, engine, calls, groups)
                note("batched", elapsed, hit)
                same_b &= outs == expected
                if not args.skip_sequential:
                    engine.flush_cache()
                    outs, elapsed, hit = measure(engine, replay, engine, calls)
                    note("sequential", elapsed, hit)
                    same_s &= outs == expected
            for way, title in WAYS.items():
                if (name, way) in secs:
                    report(
                        name,
                        title,
                        statistics.median(secs[(name, way)]),
                        len(batch),
                        statistics.median(hits[(name, way)]),
                    )
            notes[name] = (len(calls), len(groups), same_b, same_s, quality(name, first_states))
    finally:
        engine.shutdown()
        nocache.shutdown()

    print(
        "\nprogram          programs calls stages  vs batched calls        vs no-cache"
        "              vs sequential   hit rate lang/batched  replay same (batched/seq)  outputs"
    )
    out = {"model": label, "programs": {}}
    for name, (_, batch) in work.items():
        # programs/s ratios = inverse time ratios, per round
        lang = secs[(name, "language")]
        row = {}
        cols = []
        for way in ("batched", "no-cache", "sequential"):
            if (name, way) in secs:
                row[way] = common.ratio_summary(secs[(name, way)], lang)
                cols.append(f"{row[way][0]:6.2f}x ({row[way][1]:.2f}-{row[way][2]:.2f})")
            else:
                cols.append("     -")
        out["programs"][name] = row
        calls, ngroups, same_b, same_s, q = notes[name]
        h = f"{100 * statistics.median(hits[(name, 'language')]):.1f}% / {100 * statistics.median(hits[(name, 'batched')]):.1f}%"
        same = f"{'yes' if same_b else 'NO'}/{'yes' if same_s else 'NO'}"
        print(
            f"{name:16s} {len(batch):8d} {calls:5d} {ngroups:6d}  {cols[0]:22s} {cols[1]:22s} "
            f"{cols[2]:22s} {h:>17s}  {same:>12s}  {q}"
        )
    print(common.loadavg())
    return out


if __name__ == "__main__":
    main()
