"""Replay the n-gram drafter over fixed greedy outputs: deterministic step counts, no model.

    python benchmarks/bench_spec_replay.py --model ~/.cache/loom/models/smollm2-135m-f32 \\
        --questions question.jsonl --heldout --per-category 6 --outputs /tmp/heldout6.json \\
        [--extra 0,0.06,0.15,0.11,0.15,0.19,0.21,0.23] [--spec-arg NAME=VALUE]

A greedy answer does not depend on speculation (verification keeps exactly the target's
tokens), so the drafter's whole run at batch 1 is determined by the answers: `--outputs`
holds them (the WARMUP prompts' and the Spec-Bench rows', speculation off, in bench_specbench's
order), generated once by the target if the file is missing. Each request then replays as the
scheduler drives `NgramSpeculator`: the prefill's draft (`draft_prefill`), then per decode
step `draft`, the gate (`worth_verifying`, which cuts the chain), and the accepted run (the
draft's common prefix with the answer) reported by `on_verified`; `on_finished` at the end.
Time is counted in decode steps: a verify of d drafts costs 1 + extra[d] (`--extra`: batch 1,
from bench_spec_step's profile of the f32 target, session 17; the Q4_1 file's is ~0, 0.36,
0.60, 0.84, 1.03, 1.22, 1.42, 2.81). Printed per category: steps, the share of steps that
verified no draft, verifies, tokens per verify, tokens per step, tokens per decode step of
time (the ratio a memory-bound target's decode could reach), the accept-length histogram.
A choice is made on `--heldout` rows (bench_specbench's tuning split), never the timed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_specbench import CATEGORIES, WARMUP, _ids, chat_ids, load_questions  # noqa: E402

F32_EXTRA = "0,0.06,0.15,0.11,0.15,0.19,0.21,0.23"


class Replayed:
    """The request fields the n-gram speculator reads, over a fixed answer (`full`)."""

    def __init__(self, prompt: list[int], full: list[int], rid: str):
        self.rid, self.origin_input_ids, self.full = rid, list(prompt), list(full)
        self.output_ids: list[int] = []
        self.spec_state = self.grammar = self.draft_masks = None
        self.draft_forced = 0
        self.sampling_params = SimpleNamespace(is_greedy=True)
        self.return_logprob = False

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def tokens(self, a: int, b: int) -> list[int]:
        return (self.origin_input_ids + self.output_ids)[a:b]


def accepted(draft, answer: list[int], at: int) -> tuple[int, int]:
    """(positions drafted, draft tokens accepted) of a chain or a DraftTree at answer[at:]."""
    if isinstance(draft, list):
        n = 0
        while n < len(draft) and at + n < len(answer) and draft[n] == answer[at + n]:
            n += 1
        return len(draft), n
    depth, ok, best = [], {}, 0
    for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)):
        depth.append(0 if p < 0 else depth[p] + 1)
        if (p < 0 or p in ok) and at + depth[i] < len(answer) and answer[at + depth[i]] == t:
            ok[i] = True
            best = max(best, depth[i] + 1)
    return 1 + max(depth), best


def load_corpus(path: Path, tokens: int, prompt_tail: int) -> list[list[int]]:
    """Documents of a `scripts/ngram_corpus.py` datastore (its `corpus.jsonl`): each answer
    after its prompt's last `prompt_tail` tokens (the chat template's assistant header: an
    answer's opening), in file order until `tokens` answer tokens."""
    docs, n = [], 0
    for line in path.read_text().splitlines():
        if not line.strip() or n >= tokens:
            continue
        d = json.loads(line)
        docs.append((d["prompt_ids"][-prompt_tail:] if prompt_tail else []) + d["answer"])
        n += len(d["answer"])
    return docs


def leakage(rows: list[dict], docs: list[list[int]], n: int = 8) -> tuple[int, int]:
    """(the rows' output n-grams found in the datastore, all of them)."""
    grams = {tuple(d[i : i + n]) for d in docs for i in range(len(d) - n + 1)}
    outs = [tuple(r["output"][i : i + n]) for r in rows if r["cat"] != "warmup"
            for i in range(len(r["output"]) - n + 1)]  # fmt: skip
    return sum(g in grams for g in outs), len(outs)


def replay(rows: list[dict], spec, extra: list[float]) -> dict[str, Counter]:
    cost = lambda b, d, context=None: extra[min(d, len(extra) - 1)]  # noqa: E731
    spec.set_verify_cost(cost)
    ngram = spec.ngram
    from_corpus = [None]
    if ngram.corpus is not None:  # which drafts the datastore gave (counted per category)
        ask = ngram._corpus

        def asked(req, after, max_len):
            from_corpus[0] = ask(req, after, max_len)
            return from_corpus[0]

        ngram._corpus = asked
    per: dict[str, Counter] = {}
    for i, row in enumerate(rows):
        req = Replayed(row["prompt"], row["output"], f"r{i}")
        c = per.setdefault(row["cat"], Counter())
        answer, n = req.full, len(req.full)
        spec.enabled_for(1)
        draft = list(spec.draft_prefill(req, n - 1))[: n - 1]
        got = accepted(draft, answer, 0)[1]
        if draft:
            spec.on_verified(req, len(draft), got)
        c["prefill_accepted"] += got
        req.output_ids = answer[: got + 1]
        while len(req.output_ids) < n:
            spec.enabled_for(1)
            at = len(req.output_ids)
            from_corpus[0] = None
            draft = spec.draft(req, 1 << 20)
            c["steps"] += 1
            corpus = bool(from_corpus[0]) and list(draft) == from_corpus[0]
            if len(draft) and spec.worth_verifying([req], [draft]):
                positions, got = accepted(draft, answer, at)
                spec.on_verified(req, positions, got)
                if corpus:
                    c["corpus_verifies"] += 1
                    c["corpus_accepted"] += got
                c["verifies"] += 1
                c["verify_tokens"] += min(got + 1, n - at)  # none past the answer's end
                c[f"hist{got}"] += 1
                c["time"] += 1 + cost(1, len(draft))
            else:
                got = 0
                c["time"] += 1
                c["no_verify"] += 1
            req.output_ids = answer[: at + got + 1]
        c["tokens"] += n - 1  # the prefill samples the first
        spec.on_finished(req)
    return per


def report(per: dict[str, Counter], label: str) -> None:
    total = Counter()
    for cat in CATEGORIES:
        if cat not in per:
            continue
        c = per[cat]
        total.update(c)
        hist = [c[f"hist{k}"] for k in range(1 + max((int(h[4:]) for h in c if h.startswith("hist")), default=0))]  # fmt: skip
        print(
            f"  {cat:15s} tokens {c['tokens']} steps {c['steps']} no verify "
            f"{c['no_verify'] / c['steps']:.0%} verifies {c['verifies']} tokens/verify "
            f"{c['verify_tokens'] / max(1, c['verifies']):.2f} tokens/step "
            f"{c['tokens'] / c['steps']:.2f} per decode step's time "
            f"{c['tokens'] / c['time']:.2f}x hist {hist}"
            + (f" corpus verifies {c['corpus_verifies']} accepted/verify "
               f"{c['corpus_accepted'] / c['corpus_verifies']:.2f}" if c["corpus_verifies"] else "")
        )  # fmt: skip
    print(
        f"{label}: tokens per decode step's time {total['tokens'] / total['time']:.3f}x, "
        f"{total['steps']} steps, {total['verifies']} verifies, "
        f"{total['verify_tokens'] / max(1, total['verifies']):.2f} tokens/verify",
        flush=True,
    )


def generate(args, path: Path) -> list[dict]:
    """The greedy answers (speculation off, one scheduler: the WARMUP prompts, then the rows
    one at a time in bench_specbench's order), written to `path`."""
    import torch
    from spec_protocol import run_scheduler

    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer(args.model)
    sched = Scheduler(ServerArgs(model_path=args.model, dtype=args.dtype, max_total_tokens=16384))
    rows = []
    try:
        warm = [(_ids(chat_ids(tok, t)), {"max_new_tokens": args.warmup_tokens}) for t in WARMUP]
        outs = run_scheduler(sched, warm, len(warm), "w")[0]
        rows += [{"cat": "warmup", "prompt": ids, "output": o} for (ids, _), o in zip(warm, outs.values())]  # fmt: skip
        qs = load_questions(args.questions, args.per_category, heldout=args.heldout)
        for i, (cat, text, qid) in enumerate(qs):
            ids = _ids(chat_ids(tok, text))
            out = run_scheduler(sched, [(ids, {"max_new_tokens": args.max_new_tokens})], 1, f"q{i}-")[0]  # fmt: skip
            rows.append({"cat": cat, "qid": qid, "prompt": ids, "output": next(iter(out.values()))})
    finally:
        sched.close()
    path.write_text(json.dumps(rows))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="target model folder (HF layout)")
    ap.add_argument("--questions", required=True, type=Path, help="Spec-Bench question.jsonl")
    ap.add_argument("--outputs", required=True, type=Path,
                    help="the greedy answers (JSON), generated here if missing")  # fmt: skip
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--heldout", action="store_true", help="the held-out rows (tuning)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--extra", default=F32_EXTRA,
                    help="a verify's cost beyond a decode step, in decode steps, by drafts 0, 1, ..")  # fmt: skip
    ap.add_argument("--spec-arg", action="append", default=[],
                    help="NAME=VALUE: a speculative_* server argument")  # fmt: skip
    ap.add_argument("--label", default="replay")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="a scripts/ngram_corpus.py corpus.jsonl: a read-only source of drafts")  # fmt: skip
    ap.add_argument("--corpus-tokens", type=int, default=1 << 40, help="its first N answer tokens")
    ap.add_argument("--corpus-prompt-tail", type=int, default=3,
                    help="prompt tokens kept before each answer (the assistant header)")  # fmt: skip
    ap.add_argument("--corpus-window", type=int, default=8)
    ap.add_argument("--corpus-min-window", type=int, default=1)
    ap.add_argument("--corpus-order", default="last", help="last: own, trie, corpus; before-trie")
    args = ap.parse_args()
    rows = json.loads(args.outputs.read_text()) if args.outputs.is_file() else generate(args, args.outputs)  # fmt: skip

    from loom.runtime.server_args import ServerArgs
    from loom.runtime.spec.speculator import NgramSpeculator
    from loom.runtime.tokenizer import load_tokenizer

    kw = {}
    for item in args.spec_arg:
        name, _, value = item.partition("=")
        kw[name] = int(value) if value.lstrip("-").isdigit() else value
    sa = ServerArgs(model_path=args.model, speculative_algorithm="NGRAM", **kw)
    tok = load_tokenizer(args.model)
    # a free request's drafts read neither the vocabulary size nor the stop tokens
    spec = NgramSpeculator(sa, tok, len(tok), [tok.eos_token_id])
    print(f"bench_spec_replay: {len(rows)} answers from {args.outputs}, extra {args.extra}, "
          f"{' '.join(args.spec_arg)} loadavg {os.getloadavg()}")  # fmt: skip
    if args.corpus is not None:
        from loom.runtime.spec.ngram_corpus import CorpusIndex

        docs = load_corpus(args.corpus, args.corpus_tokens, args.corpus_prompt_tail)
        spec.ngram.corpus = CorpusIndex(docs, args.corpus_window)
        spec.ngram.corpus_min_window = args.corpus_min_window
        spec.ngram.corpus_order = args.corpus_order
        hit, total = leakage(rows, docs)
        print(f"corpus {args.corpus}: {len(docs)} documents, {spec.ngram.corpus.tokens} tokens, "
              f"{len(spec.ngram.corpus)} windows, order {args.corpus_order}, min window "
              f"{args.corpus_min_window}; the rows' output 8-grams in it: {hit}/{total} "
              f"({hit / max(1, total):.1%})")  # fmt: skip
    report(replay(rows, spec, [float(x) for x in args.extra.split(",")]), args.label)


if __name__ == "__main__":
    main()
