"""One suite of programs, run on every backend that serves a loom runtime: test_lang_engine.py
runs it in-process (EngineBackend), test_lang_runtime_endpoint.py over HTTP (RuntimeEndpoint).

Each `check_*` takes a backend on the tiny random llama (ChatML template) and asserts what a
random model makes checkable: shapes, constraints, selection mechanics, ordering, errors.
Greedy decoding is deterministic and batch-invariant, so a result can be compared with the
same program run another way. The select methods' arithmetic on fixed log-probabilities is
hand-checked in test_lang_unit.py; here each decision must follow from the scores the method
reported in meta_info.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import threading

import jsonschema
import pytest

import loom as sgl

GREEDY = {"temperature": 0}


# ---------------------------------------------------------------------- roles, gen, stop
def check_roles_and_messages(backend):
    @sgl.function
    def chat(s):
        s += sgl.system("You are terse.")
        for q in ("Hi?", "Bye?"):
            s += sgl.user(q)
            s += sgl.assistant(sgl.gen("a", max_tokens=6))

    state = chat.run(backend=backend, **GREEDY)
    msgs = state.messages()
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in msgs[:2]] == ["You are terse.", "Hi?"]
    assert msgs[-1]["content"] == state["a"].lstrip()
    assert "<|im_end|>" not in state["a"]  # the template's stop string ends an assistant gen
    assert state.text().startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert state.text().endswith(state["a"] + "<|im_end|>\n")
    meta = state.get_meta_info("a")
    assert meta["completion_tokens"] <= 6 and meta["prompt_tokens"] > 10


def check_gen_with_stop(backend):
    @sgl.function
    def prog(s, stops):
        s += "Q: tell me\nA:" + sgl.gen("a", max_tokens=16, ignore_eos=True, stop=stops)

    free = prog.run(stops=None, backend=backend, **GREEDY)["a"]
    assert len(free) >= 6, free
    stop = free[4:6]  # a string the model does produce: the stopped gen ends right before it
    state = prog.run(stops=[stop, "never seen"], backend=backend, **GREEDY)
    assert state["a"] == free[: free.index(stop)]
    assert state.get_meta_info("a")["finish_reason"]["type"] == "stop"
    assert state.text() == "Q: tell me\nA:" + state["a"]


# ---------------------------------------------------------------------- select
def _greedy_pick(matrix: list[list[float]]) -> int:
    remaining = list(range(len(matrix)))
    for j in range(len(matrix[0])):
        best = max(matrix[i][j] for i in remaining)
        remaining = [i for i in remaining if matrix[i][j] == best]
    return remaining[0]


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: values[i])


def check_select(backend):
    prompt = "The capital of France is "
    choices = ["Paris", "Berlin", "the lazy dog", "Par"]

    @sgl.function
    def pick(s, method):
        s += prompt + sgl.select("c", choices=choices, choices_method=method)

    methods = {
        "length": sgl.token_length_normalized,
        "greedy": sgl.greedy_token_selection,
        "unconditional": sgl.unconditional_likelihood_normalized,
    }
    for name, method in methods.items():
        state = pick.run(method=method, backend=backend)
        assert state["c"] in choices
        assert state.text() == prompt + state["c"]
        meta = state.get_meta_info("c")
        split = meta["select_prefix_tokens"]
        per_choice = meta["input_token_logprobs"]
        for choice, toks, mean in zip(choices, per_choice, meta["normalized_prompt_logprobs"]):
            # the scored tokens are the runtime's tokens of prompt + choice, after the split
            assert [t[1] for t in toks] == backend.tokenize([prompt + choice])[0][split:]
            assert mean == pytest.approx(sum(t[0] for t in toks) / len(toks), abs=1e-5)
        if name == "length":
            best = _argmax(meta["normalized_prompt_logprobs"])
        elif name == "greedy":
            best = _greedy_pick(meta["greedy_logprob_matrix"])
        else:
            uncond = meta["unconditional_token_logprobs"]
            scores = meta["normalized_unconditional_prompt_logprobs"]
            for toks, base, score in zip(per_choice, uncond, scores):
                diffs = [t[0] - (b[0] or 0.0) for t, b in zip(toks, base)]
                assert score == pytest.approx(sum(diffs) / len(diffs), abs=1e-5)
            best = _argmax(scores)
        assert state["c"] == choices[best], (name, meta)


# ---------------------------------------------------------------------- constrained gens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def check_constrained_outputs_parse(backend):
    @sgl.function
    def form(s):
        s += "Age: " + sgl.gen_int("age", max_tokens=8) + "\n"
        s += "Name: " + sgl.gen_string("name", max_tokens=32) + "\n"
        s += "Code: " + sgl.gen("code", regex=r"(yes|no)-[0-9]{2}", max_tokens=10) + "\n"
        s += "Person: " + sgl.gen("person", json_schema=PERSON, max_tokens=64)

    state = form.run(backend=backend, **GREEDY)
    int(state["age"])
    assert re.fullmatch(r"[-+]?[0-9]+", state["age"]), state["age"]
    assert re.fullmatch(r"\"[\w\d\s]*\"", state["name"]), state["name"]
    assert isinstance(json.loads(state["name"]), str)
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", state["code"]), state["code"]
    jsonschema.validate(json.loads(state["person"]), PERSON)
    for var in ("name", "code", "person"):  # each closed its pattern before max_tokens
        assert state.get_meta_info(var)["finish_reason"]["type"] == "stop", var


# ---------------------------------------------------------------------- var_scope
def check_var_scope(backend):
    @sgl.function
    def prog(s):
        s += "Intro. "
        with s.var_scope("scoped"):
            s += "Inside: " + sgl.gen("inner", max_tokens=4)
        s += " Outro."

    state = prog.run(backend=backend, **GREEDY)
    assert state["scoped"] == "Inside: " + state["inner"]
    assert state.text() == "Intro. " + state["scoped"] + " Outro."


# ---------------------------------------------------------------------- fork / join
def check_fork_gather_variable(backend):
    @sgl.function
    def prog(s):
        s += "Ideas about Paris. "
        forks = s.fork(3)
        forks += lambda i: f"Idea {i}:" + sgl.gen("idea", max_tokens=4)
        forks.join()
        s += "Done." + sgl.gen("after", max_tokens=3)
        return [f.text() for f in forks]

    state = prog.run(backend=backend, **GREEDY)
    branch_texts = state.ret_value
    assert len(state["idea"]) == 3 and len(state.get_meta_info("idea")) == 3
    for i, (idea, text) in enumerate(zip(state["idea"], branch_texts)):
        assert text == f"Ideas about Paris. Idea {i}:" + idea
    # gather_variable collects the variables; the parent's text does not take the branches'
    assert state.text() == "Ideas about Paris. Done." + state["after"]


def check_fork_concate_and_append(backend):
    @sgl.function
    def prog(s):
        s += "Root. "
        forks = s.fork(2)
        forks += ["A:", "B:"]
        forks += sgl.gen("x", max_tokens=4)
        forks.join("concate_and_append")
        before = s.text()
        s += sgl.gen("after", max_tokens=3)
        return before, [f["x"] for f in forks]

    state = prog.run(backend=backend, **GREEDY)
    before, xs = state.ret_value
    appended = "A:" + xs[0] + "B:" + xs[1]
    assert before == "Root. " + appended
    assert state.text() == before + state["after"]
    # the gen after the join was prompted with the appended text
    prompt_tokens = state.get_meta_info("after")["prompt_tokens"]
    assert prompt_tokens == len(backend.tokenize([before])[0])


# ---------------------------------------------------------------------- batch / stream / async
@sgl.function
def qa(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, ignore_eos=True)


QUESTIONS = [f"What is {i} + {i}?" for i in range(6)]


def check_run_batch_order_and_progress_bar(backend):
    singles = [qa.run(question=q, backend=backend, **GREEDY)["answer"] for q in QUESTIONS]
    assert len(set(singles)) > 1  # distinct answers make the order checkable
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        states = qa.run_batch(
            [{"question": q} for q in QUESTIONS],
            backend=backend,
            progress_bar=True,
            num_threads=3,
            **GREEDY,
        )
    assert [st["answer"] for st in states] == singles
    for q, st in zip(QUESTIONS, states):
        assert st.text() == f"Q: {q}\nA:" + st["answer"]
    assert f"{len(QUESTIONS)}/{len(QUESTIONS)}" in err.getvalue()


def check_stream_chunks_concatenate(backend):
    @sgl.function
    def prog(s):
        s += "Tell: " + sgl.gen("story", max_tokens=8, ignore_eos=True)
        s += " / " + sgl.gen("second", max_tokens=4, ignore_eos=True)

    whole = prog.run(backend=backend, **GREEDY)
    state = prog.run(backend=backend, stream=True, **GREEDY)
    chunks = list(state.text_iter())
    assert len(chunks) > 1
    assert "".join(chunks) == state.text() == whole.text()
    state = prog.run(backend=backend, stream=True, **GREEDY)
    assert "".join(state.text_iter("story")) == state["story"] == whole["story"]


def check_async_programs(backend):
    @sgl.function
    async def async_prog(s):
        s += "ping " + sgl.gen("a", max_tokens=4)
        first = await s.aget("a")
        forks = s.fork(2)
        forks += sgl.gen("b", max_tokens=3)
        forks.join()
        s += f" then {first}"

    expected = [qa.run(question=q, backend=backend, **GREEDY)["answer"] for q in QUESTIONS[:3]]

    async def main():
        states = await asyncio.gather(
            *(qa.run_async(question=q, backend=backend, **GREEDY) for q in QUESTIONS[:3])
        )
        st = await async_prog.run_async(backend=backend, **GREEDY)
        streamed = await qa.run_async(question="Async?", backend=backend, stream=True, **GREEDY)
        chunks = [c async for c in streamed.text_async_iter("answer")]
        return states, st, streamed, chunks

    states, st, streamed, chunks = asyncio.run(main())
    assert [s["answer"] for s in states] == expected
    assert len(st["b"]) == 2
    assert st.text() == "ping " + st["a"] + " then " + st["a"]
    assert "".join(chunks) == streamed["answer"]


# ---------------------------------------------------------------------- errors
class ProgramFailed(Exception):
    pass


def _raises_within(seconds: float, fn) -> BaseException:
    """Run `fn` in a thread: it must raise, and within `seconds` (no hang)."""
    box: list[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:  # the error is the result
            box.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{fn} hung"
    assert box, f"{fn} did not raise"
    return box[0]


def _frames(error: BaseException) -> list[str]:
    tb, names = error.__traceback__, []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def check_exception_in_program(backend):
    @sgl.function
    def failing_program(s):
        s += "x" + sgl.gen("a", max_tokens=3)
        forks = s.fork(2)  # branches in flight when the program fails
        forks += sgl.gen("b", max_tokens=8)
        raise ProgramFailed("inside the program")

    @sgl.function
    def bad_param(s):
        s += "x" + sgl.gen("v", top_p=5.0)

    runs = {
        "run": lambda: failing_program.run(backend=backend),
        "stream": lambda: list(failing_program.run(backend=backend, stream=True).text_iter()),
        "async": lambda: asyncio.run(failing_program.run_async(backend=backend)),
    }
    for how, fn in runs.items():
        error = _raises_within(30, fn)
        assert isinstance(error, ProgramFailed), (how, error)
        assert "failing_program" in _frames(error), (how, _frames(error))
    error = _raises_within(30, lambda: bad_param.run(backend=backend))
    assert "top_p" in str(error), error  # the runtime's rejection reaches the program
    # the backend still serves programs afterwards
    assert qa.run(question="Still up?", backend=backend, **GREEDY)["answer"]


CHECKS = [
    check_roles_and_messages,
    check_gen_with_stop,
    check_select,
    check_constrained_outputs_parse,
    check_var_scope,
    check_fork_gather_variable,
    check_fork_concate_and_append,
    check_run_batch_order_and_progress_bar,
    check_stream_chunks_concatenate,
    check_async_programs,
    check_exception_in_program,
]
