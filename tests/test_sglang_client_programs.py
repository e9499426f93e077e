"""SGLang programs run by SGLang's own frontend (`sglang.RuntimeEndpoint`, the sglang wheel
unchanged) against a loom server. Not a test module itself: test_sglang_client.py runs it in a
subprocess whose path holds the sglang wheel (importing sglang patches transformers, which the
test process must not see), and asserts on the JSON it prints.

    python tests/test_sglang_client_programs.py URL   ->  {"name": {"ok": ..., ...}, ...}
"""

from __future__ import annotations

import json
import sys
import traceback

SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ann", "bob"]}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def programs(sgl, url: str):
    greedy = {"temperature": 0}

    @sgl.function
    def plain(s):
        s += "Q: say something\nA:" + sgl.gen("a", max_tokens=8, ignore_eos=True)

    @sgl.function
    def stopped(s, marker):
        s += "Q: say something\nA:" + sgl.gen("a", max_tokens=8, ignore_eos=True, stop=marker)

    @sgl.function
    def stop_regex(s, pattern):
        s += "Q: say something\nA:" + sgl.gen(
            "a", max_tokens=8, ignore_eos=True, stop_regex=pattern
        )

    @sgl.function
    def regex(s):
        s += "Code:" + sgl.gen("code", max_tokens=8, regex=r"[0-9]{3}-[a-c]{2}")

    @sgl.function
    def typed(s):
        s += "Age:" + sgl.gen_int("age", max_tokens=6) + "\nName:"
        s += sgl.gen_string("name", max_tokens=10)

    @sgl.function
    def schema(s):
        s += "Person:" + sgl.gen("p", max_tokens=48, json_schema=json.dumps(SCHEMA))

    @sgl.function
    def pick(s, method):
        s += "The best fruit is" + sgl.select(
            "f", choices=[" apple", " banana", " cherry pie"], choices_method=method
        )

    @sgl.function
    def gather(s):
        s += "Start:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" branch {i}:" + sgl.gen("b", max_tokens=4, ignore_eos=True)
        forks.join()

    @sgl.function
    def concat(s):
        s += "Start:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" branch {i}:" + sgl.gen("b", max_tokens=4, ignore_eos=True)
        forks.join(mode="concate_and_append")
        s += " end:" + sgl.gen("tail", max_tokens=4, ignore_eos=True)

    @sgl.function
    def minimum(s, stop_id, min_tokens):
        s += "Q: say something\nA:" + sgl.gen(
            "a", max_tokens=8, min_tokens=min_tokens, stop_token_ids=[stop_id]
        )

    def run_plain():
        st = plain.run(**greedy)
        return {"text": st["a"], "meta": st.get_meta_info("a"), "full": st.text()}

    def run_stop():
        free = plain.run(**greedy)["a"]
        st = stopped.run(marker=free[3:5], **greedy)
        return {"free": free, "text": st["a"], "stop": free[3:5], "meta": st.get_meta_info("a")}

    def run_stop_regex():
        import re

        free = plain.run(**greedy)["a"]
        default = stop_regex.run(pattern=[], **greedy)  # what SGLang's gen sends by default
        st = stop_regex.run(pattern=[re.escape(free[3:5]) + "|never"], **greedy)
        return {
            "free": free,
            "default": default["a"],
            "text": st["a"],
            "meta": st.get_meta_info("a"),
        }

    def run_regex():
        return {"code": regex.run(**greedy)["code"]}

    def run_typed():
        st = typed.run(**greedy)
        return {"age": st["age"], "name": st["name"]}

    def run_schema():
        return {"p": schema.run(**greedy)["p"]}

    def run_select(method):
        def run():
            st = pick.run(method=getattr(sgl, method), **greedy)
            if st.error() is not None:  # the executor thread's exception
                raise st.error()
            meta = st.get_meta_info("f")
            return {"f": st["f"], "meta": meta}

        return run

    def run_gather():
        st = gather.run(**greedy)
        return {"text": st.text(), "b": st["b"]}

    def run_concat():
        st = concat.run(**greedy)
        return {"text": st.text(), "tail": st["tail"]}

    def run_batch():
        args = [{} for _ in range(4)]
        states = plain.run_batch(args, num_threads=4, **greedy)
        return {"texts": [s["a"] for s in states]}

    def run_stream():
        st = plain.run(stream=True, return_logprob=True, top_logprobs_num=2, **greedy)
        chunks = list(st.text_iter("a"))
        meta = st.get_meta_info("a")
        return {"chunks": chunks, "text": st["a"], "meta": meta}

    def run_min_tokens(url):
        import requests

        body = {"text": "Q: say something\nA:", "sampling_params": {"max_new_tokens": 1, **greedy}}
        first = requests.post(url + "/generate", json=body, timeout=60).json()["output_ids"][0]
        free = minimum.run(stop_id=first, min_tokens=0, **greedy)
        st = minimum.run(stop_id=first, min_tokens=6, **greedy)
        return {"free_meta": free.get_meta_info("a"), "meta": st.get_meta_info("a")}

    return {
        "plain": run_plain,
        "stop": run_stop,
        "stop_regex": run_stop_regex,
        "regex": run_regex,
        "typed": run_typed,
        "json_schema": run_schema,
        "select_token_length_normalized": run_select("token_length_normalized"),
        "select_greedy_token_selection": run_select("greedy_token_selection"),
        "select_unconditional_likelihood_normalized": run_select(
            "unconditional_likelihood_normalized"
        ),
        "fork_gather_variable": run_gather,
        "fork_concate_and_append": run_concat,
        "run_batch": run_batch,
        "stream_logprobs": run_stream,
        "min_tokens": lambda: run_min_tokens(url),
    }


def main(url: str) -> None:
    import sglang as sgl

    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    results = {}
    for name, fn in programs(sgl, url).items():
        try:
            results[name] = {"ok": True, **fn()}
        except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:2000]}
            results[name]["traceback"] = traceback.format_exc()[-3000:]
    print("RESULTS " + json.dumps(results, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
