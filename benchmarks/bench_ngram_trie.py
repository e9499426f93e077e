"""The n-gram trie's own speed, this tree's against a baseline revision's, in one process.

Token streams: the bundled model's tokenizer over docs/ (real text), and bench_spec's jobs
(json, fewshot, chat: 16 each since issue 33, 30 jobs in all before, so earlier figures are
not comparable; each prompt, chat-templated as bench_spec sends it, and its greedy output
from plain decoding on the bundled model). Per repeat, for each trie (the order alternating),
thread time of:

- serve (3 times): the jobs one after another through a fresh `NgramLookup(1, 12, 7, 1 M)`
  with a `PromptCopy`, as a scheduler drafts them: a `propose(req, state, 7)` before each
  output token, the finished request learnt (`PromptCopy.learn`); the drafts of both tries
  must be identical (checked every repeat);
- extend: the text inserted into a fresh `NgramTrie(19, 1 M)` (no eviction; one
  `extend_many` call where the store has it);
- walk: every 12-token window of the text walked from the root of that trie;
- churn: the text inserted into a trie of 50,000 nodes (evicting a node per node created).

Prints per measure this tree's time / the baseline's, median and range over the repeats.
`--baseline py`: this tree with the Python node store (`PyNgramTrie`) against this tree's
default store (the C one where a compiler is found).

    python benchmarks/bench_ngram_trie.py [--baseline 367b78f|py] [--repeats 7]
        [--text-tokens 60000]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _git_show(rev: str, path: str) -> str | None:
    res = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:{path}"], capture_output=True, text=True
    )
    return res.stdout if res.returncode == 0 else None


def _module(name: str, src: str, deps: dict | None = None):
    """`src` run as module `name`, with `deps` (module name -> module) in sys.modules while
    it imports."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    saved = {k: sys.modules.get(k) for k in deps or {}}
    sys.modules.update(deps or {})
    try:
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


def load_ngram(rev: str | None):
    """The `ngram` module of this tree (rev None), this tree's with the Python store as its
    own module (rev "py"), or revision `rev`'s (its own module, over that revision's
    `ngram_store.py` where it has one)."""
    if rev is None:
        from loom.runtime.spec import ngram

        return ngram
    if rev == "py":
        from loom.runtime.spec.ngram_store import PyNgramTrie

        module = _module("ngram_py", (REPO / "runtime/spec/ngram.py").read_text())
        module.new_ngram_store = module.NgramTrie = PyNgramTrie
        return module
    src = _git_show(rev, "runtime/spec/ngram.py")
    store = _git_show(rev, "runtime/spec/ngram_store.py")
    deps = {}
    if store is not None:
        deps["loom.runtime.spec.ngram_store"] = _module(f"ngram_store_{rev}", store)
    return _module(f"ngram_{rev}", src, deps)


def new_store(ngram):
    """The store factory of an `ngram` module: `new_ngram_store` (NgramTrie before it had
    that name)."""
    return getattr(ngram, "new_ngram_store", None) or ngram.NgramTrie


class Req:
    def __init__(self, prompt: list[int]):
        self.origin_input_ids = prompt
        self.output_ids: list[int] = []

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.origin_input_ids)
        if end <= n:
            return self.origin_input_ids[start:end]
        return (self.origin_input_ids + self.output_ids)[start:end]


def job_streams() -> tuple[object, list[tuple[list[int], list[int]]]]:
    """(tokenizer, [(prompt ids, greedy output ids)] of bench_spec's jobs, workload by
    workload)."""
    from bench_spec import make, workloads

    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.sampling_params import make_sampling_params

    sched = make(False)
    tok = sched.tokenizer
    jobs = [job for batch in workloads(tok).values() for job in batch]
    prompts, outputs = {}, {}
    for i, (prompt, params) in enumerate(jobs):
        rid = f"r{i}"
        prompts[rid] = tok.encode(prompt)
        outputs[rid] = []
        sched.add_request(
            TokenizedGenerateReq(
                rid=rid,
                input_ids=prompts[rid],
                sampling_params=make_sampling_params({"temperature": 0, **params}),
                seed=0,
            )
        )
        while not sched.is_idle:
            for out in sched.step():
                ids = outputs[out.rid]
                del ids[len(ids) - out.rewind :]
                ids += out.new_ids
    return tok, [(prompts[f"r{i}"], outputs[f"r{i}"]) for i in range(len(jobs))]


def extend_all(ngram, trie, tokens) -> None:
    """Each token in turn, as `NgramLookup.observe` inserts a request's new tokens: one
    `extend_many` call where the store has it (the C store's loop is in C), else `extend`
    token by token (older revisions)."""
    if hasattr(trie, "extend_many"):
        trie.extend_many([], tokens, len(tokens))
        return
    pointers = []
    for t in tokens:
        pointers = trie.extend(pointers, t)


def walk_all(trie, tokens, w: int = 12) -> int:
    found = 0
    for i in range(0, len(tokens) - w):
        found += trie.walk(trie.root, tokens[i : i + w]) is not None
    return found


def serve(ngram, copy_cls, tok, streams) -> list[list[int]]:
    d = ngram.NgramLookup(1, 12, 7, 1_000_000)
    d.copy = copy_cls(tok)
    drafts = []
    for prompt, output in streams:
        req, state = Req(prompt), ngram.NgramState(8)
        for t in output:
            drafts.append(d.propose(req, state, 7))
            req.output_ids.append(t)
        d.observe(req, state)
        d.copy.learn(prompt[-ngram.MAX_PROMPT_TOKENS :], output)
    return drafts


def serve_n(n: int, *args) -> list[list[list[int]]]:
    return [serve(*args) for _ in range(n)]


def timed(fn, *args):
    gc.collect()
    t = time.thread_time()
    out = fn(*args)
    return time.thread_time() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="367b78f")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--text-tokens", type=int, default=60_000)
    args = ap.parse_args()
    from loom.runtime.spec.ngram_copy import PromptCopy

    tok, streams = job_streams()
    text = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    tokens = tok.encode(text)[: args.text_tokens]
    tries = {"base": load_ngram(args.baseline), "this": load_ngram(None)}
    print(
        f"{len(tokens)} text tokens, {len(streams)} jobs ({sum(len(o) for _, o in streams)} "
        f"output tokens), baseline {args.baseline}, loadavg {os.getloadavg()}"
    )
    gc.collect()
    gc.freeze()
    ratios: dict[str, list[float]] = {}
    secs: dict[tuple[str, str], list[float]] = {}
    for r in range(args.repeats):
        order = ["base", "this"] if r % 2 == 0 else ["this", "base"]
        drafts = {}
        for name in order:
            ngram = tries[name]
            trie = new_store(ngram)(19, 1_000_000)
            for measure, fn, *fn_args in (
                ("serve", serve_n, 3, ngram, PromptCopy, tok, streams),
                ("extend", extend_all, ngram, trie, tokens),
                ("walk", walk_all, trie, tokens),
                ("churn", extend_all, ngram, new_store(ngram)(19, 50_000), tokens),
            ):
                s, out = timed(fn, *fn_args)
                secs.setdefault((name, measure), []).append(s)
                if measure == "serve":
                    drafts[name] = out[0]
            del trie
            gc.collect()
        assert drafts["base"] == drafts["this"], "the two tries drafted differently"
        for (name, measure), v in secs.items():
            if name == "this":
                ratios.setdefault(measure, []).append(v[-1] / secs[("base", measure)][-1])
    n_drafted = sum(len(d) for d in drafts["this"])
    print(f"serve: {len(drafts['this'])} proposals, {n_drafted} draft tokens, identical")
    for measure, v in ratios.items():
        base = statistics.median(secs[("base", measure)])
        this = statistics.median(secs[("this", measure)])
        print(
            f"{measure:6s} this/base thread time {statistics.median(v):.3f}x "
            f"[{min(v):.3f}-{max(v):.3f}] ({this * 1e3:.0f} ms / {base * 1e3:.0f} ms median)"
        )
    print(f"loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()
