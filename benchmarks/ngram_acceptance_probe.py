"""What n-gram drafting can reach on a real model: every step drafts its full length and
verifies it (no cost gate), so acceptance is known at every position, by Spec-Bench category
and by the matched suffix's length. Held-out prompts (`load_questions(heldout=True)`: not the
timed rows), after bench_specbench's WARMUP prompts, batch 1, greedy.

    python benchmarks/ngram_acceptance_probe.py --model DIR --questions question.jsonl \\
        [--per-category 2] [--max-new-tokens 96] [--json-out probe.json]

Prints, per category and per match length: verify steps, draft tokens accepted per verify,
the share whose first position was accepted. An upper bound of chain drafting's speed-up is
(1 + accepted per verify) / (1 + a verify's extra cost) at batch 1.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_specbench import WARMUP, _ids, chat_ids, load_questions  # noqa: E402
from spec_protocol import run_scheduler  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--questions", required=True, type=Path)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import torch

    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.spec import speculator
    from loom.runtime.spec.cost import VerifyCost
    from loom.runtime.tokenizer import load_tokenizer

    torch.set_num_threads(ServerArgs().effective_cpu_threads)
    speculator.TOKEN_COST = 0.0  # every position is drafted ...
    speculator.PROBE_EVERY = 1
    sched = Scheduler(ServerArgs(model_path=args.model, speculative_algorithm="NGRAM",
                                 speculative_verify_cost="bundled", max_total_tokens=16384))  # fmt: skip
    spec = sched.decode.drafter
    spec.set_verify_cost(VerifyCost((-100.0, 0, 0, 0), "verify everything"))  # ... and verified
    drafter, trie = spec.ngram, spec.ngram.trie
    last: dict = {}

    def depth(node) -> int:
        d = 0
        while node and d < 64:  # the root is 0
            node, d = trie.parent[node], d + 1
        return d

    match = drafter._match

    def matched(pointers, after, skip=True):
        node = match(pointers, after, skip)
        last["depth"] = depth(node) if node is not None else 0
        return node

    drafter._match = matched
    records = []
    verified = spec.on_verified

    def on_verified(req, drafted, accepted):
        records.append((req.rid.rsplit("-", 1)[0], last.get("depth", 0), drafted, accepted))
        return verified(req, drafted, accepted)

    spec.on_verified = on_verified
    tok = load_tokenizer(args.model)
    warm = [(_ids(chat_ids(tok, t)), {"max_new_tokens": 64}) for t in WARMUP]
    run_scheduler(sched, warm, len(warm), "warmup-")
    records.clear()
    for cat, text, _ in load_questions(args.questions, args.per_category, heldout=True):
        job = [(_ids(chat_ids(tok, text)), {"max_new_tokens": args.max_new_tokens})]
        run_scheduler(sched, job, 1, f"{cat}-")
    sched.close()
    for name, key in (("category", lambda r: r[0]), ("match length", lambda r: min(r[1], 8))):
        by = collections.defaultdict(lambda: [0, 0, 0])
        for r in records:
            b = by[key(r)]
            b[0], b[1], b[2] = b[0] + 1, b[1] + r[3], b[2] + (r[3] > 0)
        for k in sorted(by, key=str):
            n, acc, first = by[k]
            print(
                f"{name} {k}: {n} verifies, {acc / n:.2f} accepted a verify, first {first / n:.2f}"
            )
    n = len(records) or 1
    print(f"all: {len(records)} verifies, {sum(r[3] for r in records) / n:.2f} accepted a verify, "
          f"loadavg {os.getloadavg()}")  # fmt: skip
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
