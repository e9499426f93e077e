"""The language against a fake native backend that records requests and answers with fixed
log-probabilities: semantics, parameters on the wire, select scoring, fork/join, errors."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time

import pytest

import loom as sgl
from loom.backends.native import NativeBackend
from loom.chat_template import get_chat_template
from loom.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from loom.ir import REGEX_INT, REGEX_STR

_TOKEN = re.compile(r"\s?\w+|\s|[^\w\s]")


class FakeBackend(NativeBackend):
    """Words are tokens (a leading space joins the word, so "is " + "Paris" heals into
    " Paris"); gens answer from `reply(prompt, params)`; token log-probabilities come from
    `logprobs` (token text -> value, default -1.0)."""

    def __init__(self, reply=None, logprobs=None, delay=0.0, stream_delay=0.0):
        self.chat_template = get_chat_template("chatml")
        self.vocab: dict[str, int] = {"<bos>": 0}
        self.requests: list[dict] = []
        self.reply = reply or (lambda prompt, sp: "ok")
        self.logprobs = logprobs or {}
        self.delay = delay
        self.stream_delay = stream_delay
        self._lock = threading.Lock()

    def _ids(self, text: str) -> list[int]:
        with self._lock:
            return [0] + [self.vocab.setdefault(t, len(self.vocab)) for t in _TOKEN.findall(text)]

    def token_text(self, tid: int) -> str:
        return next(k for k, v in self.vocab.items() if v == tid)

    def tokenize(self, texts):
        return [self._ids(t) for t in texts]

    def _one(self, ids, sp, start, text=None):
        out_text = "" if sp.get("max_new_tokens") == 0 else self.reply(text, sp)
        meta = {
            "id": "x",
            "prompt_tokens": len(ids),
            "completion_tokens": len(_TOKEN.findall(out_text)),
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
        }
        if start is not None:
            meta["input_token_logprobs"] = [
                [None if i == 0 else self.logprobs.get(self.token_text(t), -1.0), t, None]
                for i, t in enumerate(ids)
            ][start:]
            meta["output_token_logprobs"] = []
        return {"text": out_text, "output_ids": [], "meta_info": meta}

    def _request(self, body):
        with self._lock:
            self.requests.append(json.loads(json.dumps(body)))
        if self.delay:
            time.sleep(self.delay)
        sp = body["sampling_params"]
        if "input_ids" in body:
            starts = body.get("logprob_start_len")
            return [self._one(ids, sp, s) for ids, s in zip(body["input_ids"], starts)]
        start = body.get("logprob_start_len") if body.get("return_logprob") else None
        if body.get("return_logprob") and start is None:
            start = 0
        n = sp.get("n", 1)
        outs = [self._one(self._ids(body["text"]), sp, start, body["text"]) for _ in range(n)]
        return outs if n > 1 else outs[0]

    def _request_stream(self, body):
        final = self._request(body)
        text = final["text"]
        for i in range(1, len(text) + 1):
            time.sleep(self.stream_delay)
            yield {"text": text[:i], "meta_info": final["meta_info"]}

    def gens(self):
        return [
            r for r in self.requests if "text" in r and r["sampling_params"].get("max_new_tokens")
        ]


def chatml(role, text):
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


# ---------------------------------------------------------------------- roles and gen
def test_roles_messages_and_stop_in_assistant():
    be = FakeBackend(reply=lambda p, sp: "Hi there")

    @sgl.function
    def chat(s, question):
        s += sgl.system("Be brief.")
        with s.user():
            s += question
        s += sgl.assistant(sgl.gen("answer", max_tokens=16, stop="\n\n"))
        s += sgl.user_begin() + "Again?" + sgl.user_end()
        s += "free text " + sgl.gen("free", max_tokens=4)

    state = chat.run(question="Hello?", backend=be, temperature=0.0)
    assert state["answer"] == "Hi there"
    assert state.messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "Again?"},
    ]
    expected = (
        chatml("system", "Be brief.")
        + chatml("user", "Hello?")
        + chatml("assistant", "Hi there")
        + chatml("user", "Again?")
        + "free text Hi there"
    )
    assert state.text() == expected
    first, second = be.gens()
    assert first["text"].endswith("<|im_start|>assistant\n")
    assert first["sampling_params"]["stop"] == ["\n\n", "<|im_end|>"]
    assert first["sampling_params"]["max_new_tokens"] == 16
    assert first["sampling_params"]["temperature"] == 0.0
    assert second["sampling_params"]["stop"] == []  # outside the assistant role


def test_gen_params_reach_backend():
    be = FakeBackend(reply=lambda p, sp: "42")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}

    @sgl.function
    def prog(s):
        s += "n: " + sgl.gen_int("i", max_tokens=5)
        s += " s: " + sgl.gen_string("st")
        s += " r: " + sgl.gen("r", regex=r"[ab]+", top_k=3, top_p=0.9, min_p=0.1, min_tokens=1)
        s += " j: " + sgl.gen("j", json_schema=schema, frequency_penalty=0.5, presence_penalty=0.25)
        s += " d: " + sgl.gen("d", dtype=int, ignore_eos=True, stop_token_ids=[7])
        s += sgl.gen(
            "lp",
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=2,
            return_text_in_logprobs=True,
        )

    state = prog.run(backend=be, max_new_tokens=9)
    i, st, r, j, d, lp = (g for g in be.gens())
    assert i["sampling_params"]["regex"] == REGEX_INT
    assert i["sampling_params"]["stop"] == [" ", "\n"]
    assert i["sampling_params"]["max_new_tokens"] == 5
    assert st["sampling_params"]["regex"] == REGEX_STR
    assert st["sampling_params"]["max_new_tokens"] == 9  # inherited from run()
    want = {"regex": "[ab]+", "top_k": 3, "top_p": 0.9, "min_p": 0.1, "min_new_tokens": 1}
    assert {k: r["sampling_params"][k] for k in want} == want
    assert json.loads(j["sampling_params"]["json_schema"]) == schema
    assert (
        j["sampling_params"]["frequency_penalty"],
        j["sampling_params"]["presence_penalty"],
    ) == (0.5, 0.25)
    assert d["sampling_params"]["regex"] == REGEX_INT and d["sampling_params"]["ignore_eos"]
    assert d["sampling_params"]["stop_token_ids"] == [7]
    assert lp["return_logprob"] and lp["logprob_start_len"] == 0 and lp["top_logprobs_num"] == 2
    assert lp["return_text_in_logprobs"]
    assert "input_token_logprobs" in state.get_meta_info("lp")
    with pytest.raises(re.error):
        sgl.gen("bad", regex="(")


def test_gen_n_makes_a_list():
    be = FakeBackend(reply=lambda p, sp: "x")

    @sgl.function
    def prog(s):
        s += "Q: " + sgl.gen("samples", n=3, max_tokens=2)

    state = prog.run(backend=be)
    assert state["samples"] == ["x", "x", "x"]
    assert state.text() == "Q: x"
    assert len(state.get_meta_info("samples")) == 3


def test_var_scope_and_set_var():
    be = FakeBackend(reply=lambda p, sp: "blue")

    @sgl.function
    def prog(s):
        s += "Color: "
        with s.var_scope("scoped"):
            s += "the sky is " + sgl.gen("c")
        s["extra"] = 5

    state = prog.run(backend=be)
    assert state["scoped"] == "the sky is blue"
    assert state["extra"] == 5


# ---------------------------------------------------------------------- select
def test_select_token_healing_and_shared_prefix_request():
    lp = {" Paris": -0.5, " London": -2.0, " New": -0.1, " York": -3.0}
    be = FakeBackend(logprobs=lp)

    @sgl.function
    def prog(s):
        s += "The capital is " + sgl.select("city", choices=["Paris", "London", "New York"])

    state = prog.run(backend=be)
    assert state["city"] == "Paris"  # means: -0.5, -2.0, (-0.1 - 3.0) / 2
    assert state.text() == "The capital is Paris"
    (req,) = [r for r in be.requests if "input_ids" in r]
    ids = be._ids("The capital is ")
    # "is " + "Paris" tokenizes as " Paris": scoring starts where the prompt's " " was
    assert req["logprob_start_len"] == [len(ids) - 1] * 3
    assert req["sampling_params"] == {"max_new_tokens": 0}
    assert [x[: len(ids) - 1] for x in req["input_ids"]] == [ids[:-1]] * 3
    meta = state.get_meta_info("city")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-0.5, -2.0, -1.55])


def test_select_always_returns_a_choice():
    be = FakeBackend(logprobs={"zzz": 5.0})
    for choices in (["a", "b"], ["", "x"], ["same", "same"], [" lead", "trail "]):

        @sgl.function
        def prog(s, choices=choices):
            s += "Pick:" + sgl.gen("v", choices=choices)

        state = prog.run(backend=be)
        assert state["v"] in choices


FIXED = [
    [[-1.0, 1, None], [-3.0, 2, None]],  # mean -2.0
    [[-2.5, 3, None]],  # mean -2.5
    [[-1.0, 1, None], [-1.0, 4, None], [-0.4, 5, None]],  # mean -0.8
]
UNCOND = [
    [[None, 1, None], [-1.0, 2, None]],
    [[None, 3, None]],
    [[None, 1, None], [-4.0, 4, None], [-2.0, 5, None]],
]


def call(method, unconditional=None):
    normalized = [sum(t[0] for t in o) / len(o) for o in FIXED]
    return method(
        choices=["A", "B", "C"],
        normalized_prompt_logprobs=normalized,
        input_token_logprobs=FIXED,
        output_token_logprobs=[[], [], []],
        unconditional_token_logprobs=unconditional,
    )


def test_choice_methods_hand_computed():
    d = call(token_length_normalized)
    assert d.decision == "C"
    assert d.meta_info["normalized_prompt_logprobs"] == pytest.approx([-2.0, -2.5, -0.8])
    # greedy: column 0 = -1.0, -2.5, -1.0 -> A and C tie; column 1: -3.0 vs -1.0 -> C
    d = call(greedy_token_selection)
    assert d.decision == "C"
    m = d.meta_info["greedy_logprob_matrix"]
    assert m[1] == pytest.approx([-2.5, -2.5, -2.5])  # padded with its own mean
    assert m[0] == pytest.approx([-1.0, -3.0, -2.0])
    # unconditional: A mean(-1-0, -3+1) = -1.5; B -2.5; C mean(-1, 3, 1.6) = 1.2
    d = call(unconditional_likelihood_normalized, UNCOND)
    assert d.decision == "C"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx(
        [-1.5, -2.5, 1.2]
    )
    with pytest.raises(ValueError):
        call(unconditional_likelihood_normalized)


def test_greedy_prefers_best_first_token_where_length_normalized_does_not():
    lp = {" yes": -0.1, " no": -0.3, " way": -5.0}
    be = FakeBackend(logprobs=lp)

    @sgl.function
    def prog(s, method):
        s += "Answer: " + sgl.select("a", choices=["yes", "no way"], choices_method=method)

    assert prog.run(method=token_length_normalized, backend=be)["a"] == "yes"
    lp[" no"] = -0.05  # best first token, terrible second
    assert prog.run(method=greedy_token_selection, backend=be)["a"] == "no way"
    assert prog.run(method=token_length_normalized, backend=be)["a"] == "yes"


def test_unconditional_method_sends_choice_tails_alone():
    be = FakeBackend(logprobs={" cat": -1.0, " dog": -2.0})

    @sgl.function
    def prog(s):
        s += "Pet: " + sgl.select(
            "p", choices=["cat", "dog"], choices_method=unconditional_likelihood_normalized
        )

    state = prog.run(backend=be)
    (req,) = [r for r in be.requests if "input_ids" in r]
    assert len(req["input_ids"]) == 4
    assert req["input_ids"][2] == [0, be.vocab[" cat"]]  # BOS + the choice's own tokens
    assert req["logprob_start_len"][2:] == [1, 1]
    assert state["p"] in ("cat", "dog")
    assert "normalized_unconditional_prompt_logprobs" in state.get_meta_info("p")


# ---------------------------------------------------------------------- fork / join
def test_fork_gather_and_concat():
    be = FakeBackend(reply=lambda p, sp: f"[{p.count('branch')}]")

    @sgl.function
    def prog(s):
        s += "Root. "
        forks = s.fork(3)
        forks += lambda i: f"branch {i} " + sgl.gen("idea", max_tokens=4)
        forks[0] += " extra"
        forks.join()
        s += "After: " + sgl.gen("after")
        more = s.fork(2)
        more += ["A:", "B:"]
        more += sgl.gen("x")
        more.join("concate_and_append")

    state = prog.run(backend=be)
    assert state["idea"] == ["[1]", "[1]", "[1]"]
    assert state["after"] == "[0]"
    assert state.text() == "Root. After: [0]A:[0]B:[0]"
    # the shared prefix is prefilled once (prefill-only) before the branches generate
    kinds = [(r["text"], r["sampling_params"]["max_new_tokens"]) for r in be.requests]
    assert kinds[0] == ("Root. ", 0)
    assert all(k[1] != 0 for k in kinds[1:4])


def test_fork_branches_run_concurrently():
    # every branch's reply waits until all 6 are in flight: run one after another, the first
    # would wait alone and the barrier break (no wall-clock bound, so load cannot fail it)
    gate = threading.Barrier(6, timeout=30)
    be = FakeBackend(reply=lambda p, sp: (gate.wait(), "y")[1])

    @sgl.function
    def prog(s):
        s += "go"
        forks = s.fork(6)
        forks += sgl.gen("v")
        forks.join()

    state = prog.run(backend=be)
    assert state["v"] == ["y"] * 6 and not gate.broken
    # one cache request (prefill-only), then the branches
    assert [r["sampling_params"]["max_new_tokens"] for r in be.requests][0] == 0


# ---------------------------------------------------------------------- batch / stream / async
def test_run_batch_order_and_progress_bar(capsys):
    be = FakeBackend(reply=lambda p, sp: p.split()[-1], delay=0.01)

    @sgl.function
    def echo(s, word):
        s += "say " + word + " " + sgl.gen("out")

    words = [f"w{i}" for i in range(12)]
    states = echo.run_batch(
        [{"word": w} for w in words], backend=be, progress_bar=True, num_threads=4
    )
    assert [st["out"] for st in states] == words
    assert "12/12" in capsys.readouterr().err
    gen = echo.run_batch([{"word": "a"}, {"word": "b"}], backend=be, generator_style=True)
    assert [st["out"] for st in gen] == ["a", "b"]


def test_stream_chunks_concatenate():
    be = FakeBackend(reply=lambda p, sp: "streamed words here", stream_delay=0.005)

    @sgl.function
    def prog(s):
        s += "Tell: " + sgl.gen("story")
        s += " / " + sgl.gen("second")

    state = prog.run(backend=be, stream=True)
    chunks = list(state.text_iter())
    assert len(chunks) > 3
    assert "".join(chunks) == state.text() == "Tell: streamed words here / streamed words here"
    state = prog.run(backend=be, stream=True)
    assert "".join(state.text_iter("second")) == "streamed words here"


def test_async_programs():
    be = FakeBackend(reply=lambda p, sp: "pong")

    @sgl.function
    def sync_prog(s, q):
        s += q + sgl.gen("a")

    @sgl.function
    async def async_prog(s):
        s += "ping " + sgl.gen("a")
        first = await s.aget("a")
        forks = s.fork(2)
        forks += sgl.gen("b")
        forks.join()
        s += f" then {first}"

    async def main():
        main_thread = threading.get_ident()
        states = await asyncio.gather(
            *(sync_prog.run_async(q=f"q{i} ", backend=be) for i in range(5))
        )
        assert [st["a"] for st in states] == ["pong"] * 5
        st = await async_prog.run_async(backend=be)
        assert st["b"] == ["pong", "pong"]
        assert st.text().endswith("pong then pong")
        st = await sync_prog.run_async(q="x ", backend=be, stream=True)
        chunks = [c async for c in st.text_async_iter("a")]
        assert "".join(chunks) == "pong"
        assert threading.get_ident() == main_thread

    asyncio.run(main())


# ---------------------------------------------------------------------- errors
class Boom(RuntimeError):
    pass


def test_errors_surface():
    def reply(prompt, sp):
        if "fail" in prompt:
            raise Boom("backend failed")
        return "fine"

    be = FakeBackend(reply=reply)

    @sgl.function
    def user_error(s):
        s += "x" + sgl.gen("a")
        raise ValueError("in the program")

    @sgl.function
    def backend_error(s):
        s += "please fail " + sgl.gen("a")
        s += sgl.gen("b")

    @sgl.function
    def branch_error(s):
        forks = s.fork(2)
        forks += lambda i: "fail" if i else "ok"
        forks += sgl.gen("v")
        forks.join()

    @sgl.function
    def reads_missing(s):
        s += "hi"
        return s["never_set"]

    with pytest.raises(ValueError, match="in the program"):
        user_error.run(backend=be)
    with pytest.raises(Boom):
        backend_error.run(backend=be)
    with pytest.raises(Boom):
        branch_error.run(backend=be)
    with pytest.raises(KeyError):
        reads_missing.run(backend=be)
    state = backend_error.run(backend=be, stream=True)
    with pytest.raises(Boom):
        list(state.text_iter())
    with pytest.raises(Boom):
        asyncio.run(backend_error.run_async(backend=be))

    @sgl.function
    def blocking_read_on_loop(s):
        s += "x" + sgl.gen("a")
        s += s["a"]  # a sync read inside run_async cannot block the loop

    with pytest.raises(RuntimeError, match="aget"):
        asyncio.run(blocking_read_on_loop.run_async(backend=be))

    @sgl.function
    def endless(s):
        while True:
            s += "more "

    assert len(endless.trace(backend=be).exprs) == 10_000
    with pytest.raises(ValueError, match="no backend"):
        sgl.global_config.default_backend = None
        user_error.run()


# ---------------------------------------------------------------------- misc
def test_bind_trace_and_precache():
    be = FakeBackend(reply=lambda p, sp: "r")
    system = "You are a careful assistant who answers in one word. " * 3

    @sgl.function
    def qa(s, question, style):
        s += sgl.system(system)
        s += sgl.user(question + " " + style)
        s += sgl.assistant(sgl.gen("answer"))

    bound = qa.bind(style="tersely")
    assert bound.run(question="Why?", backend=be)["answer"] == "r"
    traced = qa.trace(backend=be)
    assert traced.prefix == chatml("system", system) + "<|im_start|>user\n"
    be.requests.clear()
    qa.run_batch([{"question": "a", "style": "b"}] * 3, backend=be)
    assert be.requests[0]["text"] == traced.prefix
    assert be.requests[0]["sampling_params"] == {"max_new_tokens": 0}


def test_default_backend_and_chat_templates():
    be = FakeBackend()
    sgl.set_default_backend(be)
    try:
        state = sgl.function(lambda s: s.__iadd__(sgl.gen("v"))).run()
        assert state["v"] == "ok"
    finally:
        sgl.global_config.default_backend = None
    llama = get_chat_template("llama-3-instruct")
    assert llama.get_prompt([{"role": "user", "content": "hi"}]) == (
        "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
    )
    assert not math.isnan(0.0)


# ---------------------------------------------------------------------- chat templates
class JinjaTokenizer:
    """Just enough of a HF tokenizer for `from_tokenizer`: a Jinja chat template."""

    def __init__(self, template, bos_token=None, eos_token=None):
        import jinja2

        self.chat_template = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._t = jinja2.Environment().from_string(template)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return self._t.render(
            messages=messages,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            add_generation_prompt=add_generation_prompt,
        )


QWEN_LIKE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
)


def test_template_derived_from_jinja():
    from loom.chat_template import from_tokenizer

    qwen = from_tokenizer(JinjaTokenizer(QWEN_LIKE, eos_token="<|im_end|>"))
    assert qwen.default_system_prompt == "You are helpful."
    assert qwen.role_prefix_and_suffix["assistant"] == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert qwen.stop_str == ("<|im_end|>",)
    llama = from_tokenizer(JinjaTokenizer(LLAMA3_LIKE, bos_token="<|begin_of_text|>"))
    assert llama.role_prefix_and_suffix["system"][0] == (
        "<|start_header_id|>system<|end_header_id|>\n\n"  # BOS left to the tokenizer
    )
    assert llama.stop_str == ("<|eot_id|>",) and llama.default_system_prompt is None
    broken = from_tokenizer(JinjaTokenizer("{{ raise_error }}<|im_start|>{{ messages[5] }}"))
    assert broken.name == "chatml"  # unrenderable: matched by its markers

    be = FakeBackend()
    be.chat_template = qwen

    @sgl.function
    def prog(s):
        s += sgl.user("hi")

    state = prog.run(backend=be)
    assert state.messages()[0] == {"role": "system", "content": "You are helpful."}


def test_text_async_iter_over_a_threaded_stream():
    be = FakeBackend(reply=lambda p, sp: "abcdef", stream_delay=0.002)

    @sgl.function
    def prog(s):
        s += "x: " + sgl.gen("v")

    async def main():
        state = prog.run(backend=be, stream=True)
        got = [c async for c in state.text_async_iter("v", return_meta_data=True)]
        return state, got

    state, got = asyncio.run(main())
    assert "".join(c for c, _ in got) == "abcdef" == state["v"]
    assert all(isinstance(m, dict) for _, m in got)


def test_openai_backend_request_mapping():
    from types import SimpleNamespace as NS

    calls = []

    class Completions:
        def create(self, **kw):
            calls.append(kw)
            return NS(
                id="c", usage=None, choices=[NS(message=NS(content="fine"), finish_reason="stop")]
            )

    client = NS(chat=NS(completions=Completions()))
    be = sgl.OpenAI("m", client=client)

    @sgl.function
    def prog(s):
        s += sgl.user("hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=5, regex="[a-z]+", top_k=4, stop="."))
        s += sgl.user("pick")
        s += sgl.assistant(sgl.select("c", choices=["fine", "bad"]))

    state = prog.run(backend=be, temperature=0.3)
    assert state["a"] == "fine" and state["c"] == "fine"
    first = calls[0]
    assert first["messages"] == [{"role": "user", "content": "hi"}]
    assert first["max_tokens"] == 5 and first["temperature"] == 0.3 and first["stop"] == ["."]
    assert first["extra_body"] == {"top_k": 4, "regex": "[a-z]+"}
    assert calls[1]["temperature"] == 0.0  # select without echoed logprobs: greedy generation
