"""Self-distil a corpus from a target model and train an EAGLE-3 head on it, in one command.

    python scripts/train_eagle3_smollm2.py --target ~/.cache/loom/models/smollm2-135m-f32 \\
        --work /tmp/eagle3-smollm2 [--prompts 1000] [--max-new-tokens 160] [--epochs 3] \\
        [--minutes 30] [--draft-vocab-size 4096] [--spec-bench question.jsonl]

1. **Prompts, from the model itself** (`--data-model`, default `smollm2`: the Q4_1 GGUF kept
   quantized, through Engine at batch 32): for each of SEED_TOPICS x ASKS, the model writes
   one question (temperature 0.8, a seed per prompt, <= 48 tokens); duplicates dropped. No
   Spec-Bench text is involved; with `--spec-bench` the script counts the prompts' 8-grams found
   in Spec-Bench's questions and stops above 1% (a contamination check, not a source).
2. **Answers, the model's own greedy outputs** (`--max-new-tokens`), appended to
   `work/data/distill.jsonl` a batch at a time (a rerun continues): the head learns what the
   target emits when speculation verifies against it. (The GGUF's greedy tokens agree with
   the f32 folder's teacher-forced ones; the features below come from `--target`.)
3. **Features, once** (`runtime/spec/eagle_features.py`): one f32 pass of `--target` per
   document stores the residual streams after `--aux-layers` (bf16) and the target's greedy
   next tokens in `work/features.pt`.
4. **Training the head alone** over the stored features (no target pass per step): unrolled
   `--unroll` steps, teacher-forced, hard labels over the draft vocabulary (the target's
   `--draft-vocab-size` most frequent greedy tokens on the training documents). After every
   epoch, on the held-out documents (`--holdout`, chosen by document; their answers are the
   target's greedy continuations): top-1 per draft step and the mean accepted length of
   greedy chains of `--eval-steps` tokens. That is what epochs, unroll and the draft
   vocabulary are chosen on. `--minutes` caps the training.
5. The head is saved in bf16 (`work/head/`, with `history.json`) after every epoch; the
   script refuses a head over 25 MB.

Each stage is skipped when its output exists (delete the file to redo it).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED_TOPICS = [
    "gardening", "cooking pasta", "saving money", "learning a language", "running", "sleep",
    "the solar system", "volcanoes", "bees", "the ocean", "electric cars", "recycling",
    "photography", "chess", "the piano", "ancient Rome", "the printing press", "rainbows",
    "coffee", "bread baking", "job interviews", "writing emails", "time management", "friendship",
    "dogs", "birds", "mountains", "deserts", "weather forecasts", "the human heart", "vaccines",
    "computers", "the internet", "passwords", "spreadsheets", "budget travel", "camping",
    "painting", "poetry", "movies", "board games", "football", "swimming", "yoga", "tea",
    "trains", "bridges", "libraries", "museums", "public speaking",
]  # fmt: skip
ASKS = [
    "Write one question a curious person might ask about {t}. Reply with the question only.",
    "Write one short instruction asking an assistant to explain something about {t}. Reply "
    "with the instruction only.",
    "Write one request asking for practical tips about {t}. Reply with the request only.",
]
HEAD_LIMIT_MB = 25


BATCH = 32  # requests a generate call (Engine batch)


def _engine(model: str):
    """The data stage's engine: `model` as named (`smollm2`: the Q4_1 GGUF, kept quantized;
    its greedy tokens agree with the f32 folder's teacher-forced, see docs/benchmarks.md)."""
    from loom.runtime.engine import Engine

    return Engine(model, max_running_requests=BATCH)


def make_prompts(engine, n: int) -> list[str]:
    from tqdm import tqdm

    asks = [a.format(t=t) for t in SEED_TOPICS for a in ASKS]
    out: list[str] = []
    seen: set[str] = set()
    seed = 0
    bar = tqdm(total=n, desc="prompts", unit="prompt")
    while len(out) < n and seed < 4 * n:
        group = [asks[(seed + i) % len(asks)] for i in range(BATCH)]
        res = engine.generate(
            [_as_chat(engine, g) for g in group],
            [{"temperature": 0.8, "max_new_tokens": 48, "sampling_seed": seed + i}
             for i in range(BATCH)],
        )
        seed += BATCH
        for r in res:
            text = r["text"].strip().split("\n")[0].strip().strip('"')
            if len(text) > 12 and text.lower() not in seen and len(out) < n:
                seen.add(text.lower())
                out.append(text)
                bar.update(1)
    bar.close()
    return out


def _as_chat(engine, text: str) -> str:
    return engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


def answer(engine, prompts: list[str], max_new: int, out: Path) -> None:
    """The target's greedy answers, appended to `out` a batch at a time (a rerun continues)."""
    from tqdm import tqdm

    done = len(out.read_text().splitlines()) if out.exists() else 0
    for i in tqdm(range(done, len(prompts), BATCH), desc="answers (greedy)", unit="batch"):
        group = prompts[i : i + BATCH]
        res = engine.generate(
            [_as_chat(engine, p) for p in group],
            [{"temperature": 0, "max_new_tokens": max_new} for _ in group],
        )
        with open(out, "a") as f:
            for p, r in zip(group, res):
                chat = [{"role": "user", "content": p}, {"role": "assistant", "content": r["text"]}]
                f.write(json.dumps({"messages": chat}) + "\n")


def spec_bench_grams(tok, questions: Path) -> set[tuple[int, ...]]:
    """Every token 8-gram of Spec-Bench's question turns."""
    grams: set[tuple[int, ...]] = set()
    for line in questions.read_text().splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
                ids = tok.encode(turn, add_special_tokens=False)
                grams |= {tuple(ids[i : i + 8]) for i in range(len(ids) - 7)}
    return grams


def contamination(prompts: list[str], questions: Path, tok) -> float:
    """Share of the prompts' token 8-grams that occur in Spec-Bench's question turns."""
    grams = spec_bench_grams(tok, questions)
    hits = total = 0
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False)
        for i in range(len(ids) - 7):
            total += 1
            hits += tuple(ids[i : i + 8]) in grams
    return hits / max(1, total)


def documents(data: Path, tok) -> list[tuple[list[int], int]]:
    """(token ids of the rendered chat, index of the answer's first token) per document."""
    docs = []
    for line in data.read_text().splitlines():
        msgs = json.loads(line)["messages"]
        prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
        full = tok.apply_chat_template(msgs, tokenize=False)
        p_ids = tok.encode(prompt, add_special_tokens=False)
        ids = tok.encode(full, add_special_tokens=False)
        if ids[: len(p_ids)] == p_ids and len(ids) > len(p_ids) + 2:
            docs.append((ids, len(p_ids)))
    return docs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target model folder (HF layout)")
    ap.add_argument("--work", required=True, type=Path, help="folder for data and the head")
    ap.add_argument("--data-model", default="smollm2",
                    help="the model that writes prompts and answers (default: the Q4_1 GGUF)")
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--minutes", type=float, default=None, help="cap on the training stage")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--aux-layers", default="1,15,29", help="the target layers EAGLE-3 fuses")
    ap.add_argument("--tokens-per-batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--eval-steps", type=int, default=6)
    ap.add_argument("--holdout", type=float, default=0.05)
    ap.add_argument("--max-docs", type=int, default=None,
                    help="use the first N documents (features are computed for these only)")
    ap.add_argument("--precondition", action="store_true",
                    help="train fc on features / their per-dim RMS, folded back into fc when "
                    "saved (default: raw features; see docs/benchmarks.md)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--spec-bench", type=Path, default=None, help="question.jsonl to check against")
    args = ap.parse_args()
    import torch
    import transformers

    from loom.runtime.model_loader import load_config, load_model
    from loom.runtime.spec import eagle_features as ef
    from loom.runtime.spec.eagle import build_eagle_head, head_config, save_eagle_head
    from loom.runtime.spec.head_training import cast_copy
    from loom.runtime.spec.train_eagle import init_head

    data = args.work / "data" / "distill.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    ready = data.exists() and len(data.read_text().splitlines()) >= args.prompts
    if not ready:
        engine = _engine(args.data_model)
        cached = args.work / "data" / "prompts.json"  # stage 1's output, kept across runs
        try:
            prompts = json.loads(cached.read_text()) if cached.exists() else []
            if len(prompts) < args.prompts:
                prompts = make_prompts(engine, args.prompts)
                cached.write_text(json.dumps(prompts))
            prompts = prompts[: args.prompts]
            if args.spec_bench:
                share = contamination(prompts, args.spec_bench, engine.tokenizer)
                print(f"prompts' 8-grams found in Spec-Bench: {share:.2%}", flush=True)
                if share > 0.01:
                    raise SystemExit("the generated prompts overlap Spec-Bench above 1%")
            answer(engine, prompts, args.max_new_tokens, data)
        finally:
            engine.shutdown()
    tok = transformers.AutoTokenizer.from_pretrained(args.target)
    docs = documents(data, tok)[: args.max_docs]
    torch.set_num_threads(args.threads)
    tcfg = load_config(args.target)
    model = load_model(args.target, torch.float32, "cpu", tcfg)
    for p in model.parameters():
        p.requires_grad_(False)
    capture = tuple(int(x) for x in args.aux_layers.split(","))
    feats = args.work / "features.pt"  # stage 2: the target's pass, once per document
    ef.precompute(model, docs, capture, feats)  # resumes; nothing to do when complete
    recs = torch.load(feats, weights_only=False)
    recs = {k: v[: len(docs)] if isinstance(v, list) and k != "capture" else v
            for k, v in recs.items()}  # fmt: skip
    n = len(recs["ids"])
    order = list(range(n))
    random.Random(0).shuffle(order)
    n_hold = max(1, int(n * args.holdout))
    hold_idx, train_idx = order[:n_hold], order[n_hold:]
    draft = ef.choose_draft_vocab({"argmax": [recs["argmax"][i] for i in train_idx]},
                                  args.draft_vocab_size)  # fmt: skip
    t2d = torch.full((tcfg.vocab_size,), -100, dtype=torch.long)
    t2d[draft] = torch.arange(draft.numel())
    covered = [float((t2d[recs["argmax"][i][recs["start"][i]:].long()] >= 0).float().mean())
               for i in hold_idx]  # fmt: skip
    print(f"{n} documents ({sum(r.numel() for r in recs['ids'])} tokens), {n_hold} held out; "
          f"draft vocabulary {draft.numel()} covers {sum(covered) / len(covered):.1%} of the "
          "held-out answers' target tokens", flush=True)  # fmt: skip
    hcfg = head_config(tcfg, "eagle3", eagle_config={"eagle_aux_hidden_state_layer_ids":
                       list(capture)}, target_hidden_size=tcfg.hidden_size,
                       draft_vocab_size=draft.numel())  # fmt: skip
    head = build_eagle_head(hcfg, model, torch.float32, "cpu")
    head.d2t.copy_(draft - torch.arange(draft.numel()))
    init_head(head, model, "eagle3", 0)
    for p in head.parameters():
        p.requires_grad_(True)
    out = args.work / "head"
    history = []

    def save(h, rec) -> None:
        save_eagle_head(cast_copy(h, "bfloat16"), out,
                        {"torch_dtype": "bfloat16", "dtype": "bfloat16"})  # fmt: skip
        history.append(rec)
        (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")

    scale = ef.feature_scale(recs, train_idx) if args.precondition else None
    ef.train(head, recs, train_idx, hold_idx, t2d, epochs=args.epochs, unroll_steps=args.unroll,
             eval_steps=args.eval_steps, tokens_per_batch=args.tokens_per_batch, lr=args.lr,
             max_minutes=args.minutes, save=save, scale=scale)  # fmt: skip
    size = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    print(f"head: {out} ({size:.1f} MB bf16)")
    if size > HEAD_LIMIT_MB:
        raise SystemExit(f"the head is {size:.1f} MB, over the {HEAD_LIMIT_MB} MB limit")


if __name__ == "__main__":
    main()
