"""Self-distil a corpus from a target model and train an EAGLE-3 head on it, in one command.

    python scripts/train_eagle3_smollm2.py --target ~/.cache/loom/models/smollm2-135m-f32 \\
        --work /tmp/eagle3-smollm2 [--prompts 512] [--minutes 60] [--epochs 3] \\
        [--draft-vocab-size 4096] [--spec-bench question.jsonl]

1. **Prompts, from the model itself**: for each of SEED_TOPICS x ASKS, the target writes one
   question (temperature 0.8, a seed per prompt, <= 48 tokens); duplicates dropped. No
   Spec-Bench text is involved; with `--spec-bench` the script counts the prompts' 8-grams found
   in Spec-Bench's questions and stops above 1% (a contamination check, not a source).
2. **Answers, the target's own greedy outputs** (`--max-new-tokens`, batch 16 through Engine):
   the head learns what the target emits when speculation verifies against it.
3. **Training**: `python -m loom.train_eagle --eagle3` on `work/data/distill.jsonl` (chat
   messages, rendered with the target's chat template), `--holdout` of the rows held out: every
   epoch prints held-out loss, top-1 per draft step and the held-out mean accepted length, which
   is what epochs, depth (`--unroll`, `--eval-steps`) and the draft vocabulary are chosen on.
   A progress bar per stage; `--minutes` caps the training (it saves at the cap).
4. The head is saved in bf16 (`work/head/`); the script refuses a head over 25 MB.

Each stage is skipped when its output exists (delete the file to redo it); training resumes
from `work/head/checkpoint.pt`.

Expected time (SmolLM2-135M f32, one thread of an idle 2-core machine; estimated from the
loaded run in docs/benchmarks.md, "EAGLE-3 head for SmolLM2", whose processes got ~10% of a
core): stage 1 ~1.1 s of CPU a prompt (512: ~10 min); stage 2 ~8 ms an answer token at batch
16 (512 x 192 tokens: ~13 min); stage 3 ~15 s of CPU a training step of 4 x 128-token rows,
twice that at `--seq-len` 256 (512 answers ~ 100k tokens ~ 400 rows of 256: ~100 steps, ~50
min an epoch, ~2.5 h for 3 epochs), plus the held-out evaluation each epoch (continuations
made once with a KV cache; the accepted length: one target pass a prompt). Each stage draws a
progress bar with its ETA; `--minutes` caps stage 3.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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


def _engine(target: str):
    from loom.runtime.engine import Engine

    return Engine(target, dtype="float32", max_running_requests=16)


def make_prompts(engine, n: int) -> list[str]:
    from tqdm import tqdm

    asks = [a.format(t=t) for t in SEED_TOPICS for a in ASKS]
    out: list[str] = []
    seen: set[str] = set()
    seed = 0
    bar = tqdm(total=n, desc="prompts", unit="prompt")
    while len(out) < n and seed < 4 * n:
        group = [asks[(seed + i) % len(asks)] for i in range(16)]
        res = engine.generate(
            [_as_chat(engine, g) for g in group],
            [{"temperature": 0.8, "max_new_tokens": 48, "sampling_seed": seed + i} for i in range(16)],
        )
        seed += 16
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


def answer(engine, prompts: list[str], max_new: int) -> list[str]:
    from tqdm import tqdm

    answers = []
    for i in tqdm(range(0, len(prompts), 16), desc="answers (greedy)", unit="batch"):
        group = prompts[i : i + 16]
        res = engine.generate(
            [_as_chat(engine, p) for p in group],
            [{"temperature": 0, "max_new_tokens": max_new} for _ in group],
        )
        answers += [r["text"] for r in res]
    return answers


def contamination(prompts: list[str], questions: Path, tok) -> float:
    """Share of the prompts' token 8-grams that occur in Spec-Bench's question turns."""
    grams: set[tuple[int, ...]] = set()
    for line in questions.read_text().splitlines():
        if line.strip():
            for turn in json.loads(line)["turns"]:
                ids = tok.encode(turn, add_special_tokens=False)
                grams |= {tuple(ids[i : i + 8]) for i in range(len(ids) - 7)}
    hits = total = 0
    for p in prompts:
        ids = tok.encode(p, add_special_tokens=False)
        for i in range(len(ids) - 7):
            total += 1
            hits += tuple(ids[i : i + 8]) in grams
    return hits / max(1, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="target model folder (HF layout)")
    ap.add_argument("--work", required=True, type=Path, help="folder for data and the head")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--minutes", type=float, default=None, help="cap on the training stage")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--draft-vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--unroll", type=int, default=3)
    ap.add_argument("--holdout", type=float, default=0.1)
    ap.add_argument("--spec-bench", type=Path, default=None, help="question.jsonl to check against")
    args = ap.parse_args()
    data = args.work / "data" / "distill.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    if not data.exists():
        engine = _engine(args.target)
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
            answers = answer(engine, prompts, args.max_new_tokens)
        finally:
            engine.shutdown()
        tmp = data.with_suffix(".tmp")
        tmp.write_text(
            "".join(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": p},
                            {"role": "assistant", "content": a},
                        ]
                    }  # fmt: skip
                )
                + "\n"
                for p, a in zip(prompts, answers)
            )
        )
        tmp.replace(data)
        print(f"wrote {data}: {len(prompts)} prompt / greedy answer pairs", flush=True)
    head = args.work / "head"
    cmd = [
        sys.executable, "-m", "loom.train_eagle", "--eagle3", "--target", args.target,
        "--data", str(data), "--out", str(head), "--epochs", str(args.epochs),
        "--draft-vocab-size", str(args.draft_vocab_size), "--seq-len", str(args.seq_len),
        "--batch-size", str(args.batch_size), "--unroll", str(args.unroll),
        "--holdout", str(args.holdout), "--save-dtype", "bfloat16",
    ]  # fmt: skip
    if args.minutes:
        cmd += ["--max-minutes", str(args.minutes)]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in head.glob("*.safetensors")) / 2**20
    print(f"head: {head} ({size:.1f} MB bf16)")
    if size > HEAD_LIMIT_MB:
        raise SystemExit(f"the head is {size:.1f} MB, over the {HEAD_LIMIT_MB} MB limit")


if __name__ == "__main__":
    main()
