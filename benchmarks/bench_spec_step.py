"""Where a speculative step goes beyond the target's forward, at batch 1 (issue 33).

Two in-process schedulers (speculation off / on) run the same Spec-Bench prompts one at a time
(greedy; the held-out rows of bench_specbench, never its timed ones). Each scheduler step is
split by wall-clock timers around its phases:

- sched:   Scheduler.schedule (prefill / decode scheduling, for speculation the drafter's
           `draft` and `worth_verifying`, KV slots for the drafts)
- draft:   of that, the drafter's `draft` + `worth_verifying` calls
- input:   ScheduleBatch.build_input (the step's tensors)
- forward: ModelRunner.forward's model call (the C forward: last_model_seconds)
- sample:  the rest of ModelRunner.forward (forward-batch set-up, logits, greedy verify)
- after:   the drafter's after_forward
- output:  OutputProcessor.process (accepting tokens, stop checks, freeing rejected slots)
- post:    decode.after_step + prefill.requeue + drain (+ the rest of step())

Decode steps are grouped by the rows they verify (1 = a plain decode step). Prints ms per step
of each phase, the verify-vs-decode ratio of the forward and of the whole step, and
os.getloadavg().

    python benchmarks/bench_spec_step.py --model ~/.cache/loom/models/smollm2-135m-f32 \\
        --questions /tmp/e3/question.jsonl [--per-category 1] [--max-new-tokens 128] \\
        [--quantization gguf] [--algorithm NGRAM] [--spec-arg NAME=VALUE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_specbench import WARMUP, _ids, chat_ids, load_questions  # noqa: E402
from spec_protocol import compare_outputs, run_scheduler  # noqa: E402

PHASES = ("sched", "draft", "input", "forward", "sample", "after", "output", "post")


class StepTimer:
    """Wraps one scheduler's phases with perf_counter timers; `rows` keys each decode step by
    its fed tokens (1 + drafts at batch 1)."""

    def __init__(self, sched):
        self.sched = sched
        self.cur: dict[str, float] = {}
        self.steps: dict[int, list[dict]] = defaultdict(list)
        self.on = False
        self._wrap(sched, "schedule", "sched")
        runner = sched.runner
        self._wrap(runner, "forward", "runner")
        self._wrap(sched.output, "process", "output")
        d = sched.decode.drafter
        self.drafts = defaultdict(int)  # proposed draft length -> count
        self.declined = defaultdict(int)  # longest draft of a step that decoded plainly
        if d is not None:
            orig_draft, orig_worth = d.draft, d.worth_verifying

            def draft(*a, **k):
                out = orig_draft(*a, **k)
                self.drafts[len(out)] += 1
                return out

            def worth(reqs, drafts):
                ok = orig_worth(reqs, drafts)
                if not ok:
                    self.declined[max(map(len, drafts))] += 1
                return ok

            d.draft, d.worth_verifying = draft, worth
            self.no_gain = [0]
            if hasattr(d, "_gains"):  # the n-gram speculator: steps whose rates allow no draft
                orig_gains = d._gains

                def gains(*a, **k):
                    out = orig_gains(*a, **k)
                    self.no_gain[0] += not out
                    return out

                d._gains = gains
            # calibration: what the drafter expected each verified chain to get accepted (its
            # running rates' product sum, `state.expected`) against what it got, by length
            # drafted -> [verifies, expected, got, expected by the rates before calibration]
            self.calib = defaultdict(lambda: [0, 0.0, 0, 0.0])
            if hasattr(d, "on_verified"):
                orig_verified = d.on_verified

                def on_verified(req, drafted, accepted):
                    st = req.spec_state
                    exp = getattr(st, "expected", None)
                    if exp is not None and exp != float("inf") and getattr(st, "gains", None):
                        c = self.calib[drafted]
                        c[0] += 1
                        c[1] += exp
                        c[2] += accepted
                        raw = getattr(st, "raw", None)
                        c[3] += sum(raw[: drafted - req.draft_forced]) if raw else exp
                    return orig_verified(req, drafted, accepted)

                d.on_verified = on_verified
            self._wrap(d, "draft", "draft")
            self._wrap(d, "worth_verifying", "draft")
            self._wrap(d, "after_forward", "after")
        import loom.runtime.scheduler.batch as batch_mod

        cls = batch_mod.ScheduleBatch
        orig = cls.build_input
        timer = self

        def build_input(self_, *a, **k):
            t = time.perf_counter()
            try:
                return orig(self_, *a, **k)
            finally:
                timer._add("input", time.perf_counter() - t)

        self._restore = (cls, orig)
        cls.build_input = build_input

    def close(self):
        cls, orig = self._restore
        cls.build_input = orig

    def _add(self, key, dt):
        self.cur[key] = self.cur.get(key, 0.0) + dt

    def _wrap(self, obj, name, key):
        orig = getattr(obj, name)

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self._add(key, time.perf_counter() - t)

        setattr(obj, name, wrapped)

    def step(self):
        self.cur = {}
        t = time.perf_counter()
        out = self._step()
        total = time.perf_counter() - t
        if self.on and "runner" in self.cur and self.last_decode is not None:
            c = self.cur
            fwd = self.sched.runner.last_model_seconds
            rec = {
                "total": total,
                "sched": c.get("sched", 0.0) - c.get("draft", 0.0),
                "draft": c.get("draft", 0.0),
                "input": c.get("input", 0.0),
                "forward": fwd,
                "sample": c["runner"] - fwd,
                "after": c.get("after", 0.0),
                "output": c.get("output", 0.0),
            }
            rec["post"] = total - sum(rec[p] for p in PHASES[:-1])
            self.steps[self.last_decode].append(rec)
        return out


def instrument(sched) -> StepTimer:
    timer = StepTimer(sched)
    timer._step = sched.step
    timer.last_decode = None
    orig_schedule = sched.schedule

    def schedule():  # note the fed rows of decode steps (None for a prefill)
        batch = orig_schedule()
        timer.last_decode = None
        if batch is not None and batch.is_decode:
            timer.last_decode = sum(r.extend_len for r in batch.reqs)
        return batch

    sched.schedule = schedule
    sched.step = timer.step
    return timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--questions", required=True, type=Path)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=64)
    ap.add_argument("--algorithm", default="NGRAM")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--quantization", default=None)
    ap.add_argument(
        "--timed", action="store_true", help="bench_specbench's timed rows (default: held-out)"
    )
    ap.add_argument("--spec-arg", action="append", default=[])
    args = ap.parse_args()

    import torch

    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.tokenizer import load_tokenizer

    torch.set_num_threads(ServerArgs().effective_cpu_threads)
    tok = load_tokenizer(args.model)
    qs = load_questions(args.questions, args.per_category, heldout=not args.timed)
    params = {"max_new_tokens": args.max_new_tokens}
    jobs = [(_ids(chat_ids(tok, text)), params) for _, text, _ in qs]
    warm = [(_ids(chat_ids(tok, t)), {"max_new_tokens": args.warmup_tokens}) for t in WARMUP]
    base = {"dtype": "float32", "max_running_requests": 16, "max_total_tokens": 16384}
    if args.quantization:
        base["quantization"] = args.quantization
    timers, outs, walls = {}, {}, {}
    for side in ("off", "on"):
        kw = dict(base)
        if side == "on":
            kw["speculative_algorithm"] = args.algorithm
            if args.draft:
                kw["speculative_draft_model_path"] = args.draft
            for item in args.spec_arg:
                name, _, value = item.partition("=")
                kw[name] = int(value) if value.lstrip("-").isdigit() else value
        sched = Scheduler(ServerArgs(model_path=args.model, **kw))
        try:
            run_scheduler(sched, warm, 1, "w")
            timer = instrument(sched)
            timer.on = True
            outs[side], walls[side], *_ = run_scheduler(sched, jobs, 1)
            timer.close()
        finally:
            sched.close()
        timers[side] = timer
        if side == "on":
            print("verify cost table:", getattr(sched.decode.drafter, "cost", None))
    compare_outputs(outs["off"], outs["on"], "timed")
    ntok = sum(len(v) for v in outs["off"].values())
    print(
        f"{len(jobs)} prompts, {ntok} tokens a side: off {walls['off']:.2f} s, on "
        f"{walls['on']:.2f} s ({walls['off'] / walls['on']:.2f}x), loadavg {os.getloadavg()}"
    )
    dec = timers["off"].steps[1]
    base_fwd = statistics.median(r["forward"] for r in dec)
    base_tot = statistics.median(r["total"] for r in dec)
    hdr = "side rows  steps " + " ".join(f"{p:>8}" for p in PHASES) + "    total  fwd/dec step/dec"
    print(hdr + "   (median ms a step)")
    for side in ("off", "on"):
        for rows, recs in sorted(timers[side].steps.items()):
            med = {p: statistics.median(r[p] for r in recs) * 1e3 for p in (*PHASES, "total")}
            print(
                f"{side:>4} {rows:>4} {len(recs):>6} "
                + " ".join(f"{med[p]:8.2f}" for p in PHASES)
                + f" {med['total']:8.2f} {med['forward'] / base_fwd / 1e3:6.2f} "
                f"{med['total'] / base_tot / 1e3:6.2f}"
            )
    t = timers["on"]
    print("drafts proposed by length:", dict(sorted(t.drafts.items())))
    print("drafts the running rates allowed none of:", t.no_gain[0])
    print("steps declined by worth_verifying, by longest draft:", dict(sorted(t.declined.items())))
    if t.calib:
        print("verified chains (not probes), by length: verifies, expected accepted "
              "(calibrated, by the rates alone), accepted")
        for n, (k, e, a, r) in sorted(t.calib.items()):
            print(f"  {n}: {k:4d}  {e / k:.2f}  {r / k:.2f}  {a / k:.2f}")
    for side in ("off", "on"):
        allr = [r for recs in timers[side].steps.values() for r in recs]
        tot = {p: sum(r[p] for r in allr) for p in (*PHASES, "total")}
        print(
            f"{side:>4} sums (s): "
            + " ".join(f"{p} {tot[p]:.2f}" for p in (*PHASES, "total"))
            + f" over {len(allr)} decode steps"
        )


if __name__ == "__main__":
    main()
