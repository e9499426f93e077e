"""Is the SmolLM2 EAGLE-3 head undertrained or mis-served? (issue 33)

Reads the stored features of `scripts/train_eagle3_smollm2.py`'s run (`--work`/features.pt)
and its held-out split (the script's `random.Random(0)` order, `--holdout` of `--max-docs`):

1. offline: `eagle_features.evaluate` (top-1 per draft step, mean accepted length of greedy
   chains) on held-out documents and on as many training documents;
2. serving: each held-out prompt through an in-process scheduler with the head (`--target`:
   the f32 folder, or the GGUF with `--quantization gguf`), the head's gate forced on so every
   step drafts and verifies: the prefill's captured features (the C forward's) against the
   training pass's stored ones, position by position, and the served tokens per verify.

    python scripts/check_eagle3_smollm2.py --work /tmp/e3 [--docs 12] \\
        [--target ~/.cache/loom/models/SmolLM2-135M-Instruct.Q4_1.gguf --quantization gguf]

3. `--spec-bench question.jsonl` (evaluation only, never training data): the first
   `--per-category` questions of each Spec-Bench category (first turn, chat template), the
   f32 target's greedy answers (<= 128 tokens) and one capturing prefill each
   (`eagle_data.Distiller`, as `scripts/eagle3_smollm2_data.py`), kept in
   `~/.cache/loom/eagle3_smollm2/eval/` (outside the training shards), then
   `eagle_features.evaluate` of `--head` on them, per category and overall:

    python scripts/check_eagle3_smollm2.py --spec-bench question.jsonl [--head DIR]
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

HEAD = Path(__file__).resolve().parent.parent / "runtime/bundled/eagle/smollm2-135m-eagle3"
F32 = "~/.cache/loom/models/smollm2-135m-f32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=None, help="the training run's folder")
    ap.add_argument("--head", default=str(HEAD))
    ap.add_argument("--eval-target", default=F32, help="the f32 folder the features came from")
    ap.add_argument("--target", default=F32, help="the served target")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--max-docs", type=int, default=320)
    ap.add_argument("--holdout", type=float, default=0.08)
    ap.add_argument("--docs", type=int, default=12)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-offline", action="store_true")
    ap.add_argument("--spec-bench", type=Path, default=None,
                    help="offline evaluation on Spec-Bench's questions (section 3)")
    ap.add_argument("--per-category", type=int, default=4)
    args = ap.parse_args()
    import torch

    if args.spec_bench is not None:
        return spec_bench_offline(args)

    from loom.runtime.io_struct import TokenizedGenerateReq
    from loom.runtime.model_loader import load_config, load_model
    from loom.runtime.sampling_params import make_sampling_params
    from loom.runtime.scheduler.scheduler import Scheduler
    from loom.runtime.server_args import ServerArgs
    from loom.runtime.spec import eagle_features as ef
    from loom.runtime.spec import head_policy
    from loom.runtime.spec.eagle import load_eagle_head

    torch.set_num_threads(1)
    recs = torch.load(args.work / "features.pt", weights_only=False)
    n = min(args.max_docs, len(recs["ids"]))
    order = list(range(n))
    random.Random(0).shuffle(order)
    n_hold = max(1, int(n * args.holdout))
    hold, train = order[:n_hold][: args.docs], order[n_hold:][: args.docs]
    hidden = None
    if not args.no_offline:
        path = os.path.expanduser(args.eval_target)
        model = load_model(path, torch.float32, "cpu", load_config(path))
        head = load_eagle_head(args.head, model, torch.float32, "cpu")
        hidden = model.config.hidden_size
        dv = head.draft_vocab_size
        t2d = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
        t2d[torch.arange(dv) + head.d2t.long()] = torch.arange(dv)
        for name, idx in (("held-out", hold), ("training", train)):
            top1, length = ef.evaluate(head, recs, idx, t2d, args.steps)
            print(f"offline, {len(idx)} {name} documents: top-1 per step "
                  f"{[round(a, 3) for a in top1]}, mean accepted length {length:.3f}")  # fmt: skip
    # serving: every step drafts and verifies (acceptance only, not speed)
    head_policy.HeadGate.enabled = lambda self, b, n: True
    kw = {"dtype": "float32", "max_total_tokens": 16384, "speculative_algorithm": "EAGLE3",
          "speculative_draft_model_path": args.head,
          "speculative_num_steps": args.steps}  # fmt: skip
    if args.quantization:
        kw["quantization"] = args.quantization
    sched = Scheduler(ServerArgs(model_path=os.path.expanduser(args.target), **kw))
    drafter = sched.decode.drafter
    drafter.worth_verifying = lambda reqs, drafts: True
    grabbed = []
    after = drafter.after_forward

    def keep(inp, out):
        if out.hidden is not None:
            grabbed.append((torch.as_tensor(inp.input_ids).clone(), torch.cat(out.hidden[1], -1).clone()))
        return after(inp, out)

    drafter.after_forward = keep
    errs, tokens = [], 0
    v0 = drafter.stats.verify_ct
    for i in hold:
        ids, start = recs["ids"][i].long().tolist(), recs["start"][i]
        grabbed.clear()
        params = {"temperature": 0, "max_new_tokens": len(ids) - start, "ignore_eos": True}
        sched.add_request(TokenizedGenerateReq(rid=f"d{i}", input_ids=ids[:start],
                                               sampling_params=make_sampling_params(params),
                                               seed=0))  # fmt: skip
        while not sched.is_idle:
            tokens += sum(len(o.new_ids) for o in sched.step())
        fed, feats = grabbed[0]  # the prefill: a radix-cached prefix is not fed again
        m = fed.numel()
        assert fed.tolist() == ids[start - m : start]
        want = recs["feats"][i][start - m : start].float()
        h = hidden or want.shape[-1] // 3
        errs.append([
            float((feats[1:m, k * h:(k + 1) * h] - want[1:, k * h:(k + 1) * h]).norm()
                  / want[1:, k * h:(k + 1) * h].norm())
            for k in range(want.shape[-1] // h)
        ])  # fmt: skip
    verifies = drafter.stats.verify_ct - v0
    worst = [max(e[k] for e in errs) for k in range(len(errs[0]))]
    print(f"served ({Path(args.target).name}, {args.quantization or 'unquantized'}), "
          f"{len(hold)} held-out prompts: prefill features vs training's, relative error per "
          f"captured layer (worst prompt) {[round(w, 4) for w in worst]}; {tokens} tokens / "
          f"{verifies} verifies = {tokens / max(1, verifies):.2f} tokens a verify; loadavg "
          f"{os.getloadavg()}")  # fmt: skip


def spec_bench_offline(args) -> None:
    import json

    import torch
    import transformers

    from loom.runtime.model_loader import load_config, load_model
    from loom.runtime.spec import eagle_features as ef
    from loom.runtime.spec.eagle import load_eagle_head
    from loom.runtime.spec.eagle_data import Distiller, load_shards, write_shard

    torch.set_num_threads(1)
    path = os.path.expanduser(args.eval_target)
    out = Path("~/.cache/loom/eagle3_smollm2/eval").expanduser()
    out.mkdir(parents=True, exist_ok=True)
    cached = out / f"specbench_{args.per_category}.pt"
    if not cached.exists():
        tok = transformers.AutoTokenizer.from_pretrained(path)
        picked: dict[str, list[str]] = {}
        for line in args.spec_bench.read_text().splitlines():
            if line.strip():
                q = json.loads(line)
                got = picked.setdefault(q["category"], [])
                if len(got) < args.per_category:
                    got.append(q["turns"][0])
        prompts, cats = [], []
        for cat, turns in picked.items():
            for t in turns:
                chat = tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True)  # fmt: skip
                prompts.append(tok.encode(chat, add_special_tokens=False))
                cats.append(cat)
        d = Distiller(path, path, (1, 15, 29), batch=len(prompts), threads=1, max_len=4096)
        answers = d.generate(prompts, 128)
        rec = {"ids": [], "start": [], "feats": [], "argmax": [], "capture": [1, 15, 29],
               "prompts": cats}  # fmt: skip
        for p, a in zip(prompts, answers):
            feats, argmax = d.features(p + a)
            rec["ids"].append(torch.tensor(p + a, dtype=torch.int32))
            rec["start"].append(len(p))
            rec["feats"].append(feats)
            rec["argmax"].append(argmax)
        write_shard(cached, rec)
    recs = load_shards([cached])
    model = load_model(path, torch.float32, "cpu", load_config(path))
    head = load_eagle_head(args.head, model, torch.float32, "cpu")
    dv = head.draft_vocab_size
    t2d = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    t2d[torch.arange(dv) + head.d2t.long()] = torch.arange(dv)
    cats = recs["prompts"]
    rows = {}
    for cat in dict.fromkeys(cats):
        idx = [i for i, c in enumerate(cats) if c == cat]
        rows[cat] = ef.evaluate(head, recs, idx, t2d, args.steps)
    rows["overall"] = ef.evaluate(head, recs, list(range(len(cats))), t2d, args.steps)
    for cat, (top1, length) in rows.items():
        print(f"Spec-Bench offline, {cat}: top-1 per step {[round(a, 3) for a in top1]}, "
              f"mean accepted length {length:.3f}")  # fmt: skip
    print(f"head {args.head}; {len(cats)} questions; loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()
