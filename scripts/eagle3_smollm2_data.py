"""SmolLM2's EAGLE-3 head: self-distilled data in resumable shards, and training over them.

    python scripts/eagle3_smollm2_data.py generate [--minutes 60] [--tokens 5000000]
    python scripts/eagle3_smollm2_data.py train --out /tmp/head [--max-train-tokens N] [--epochs 4]

Everything lives in `--cache` (default ~/.cache/loom/eagle3_smollm2/, it survives sessions):
`heldout.pt` (the held-out documents every choice is made on), `shards/*.pt` (training
documents; `import-legacy` turns wave 3's `/tmp/e3/features.pt` into `heldout.pt` + one shard,
keeping its split: `random.Random(0)` over its 320 documents, 8% = 25 held out, the split the
shipped head's 1.46 tokens a verify was measured on).

`generate` (runtime/spec/eagle_data.py), a batch (`--batch`, default 64) a shard, until
`--minutes` / `--tokens` / disk below 5 GB:
1. prompts written by the data model (`--data-model`, default `smollm2`: the Q4_1 GGUF kept
   quantized, C forward) from SEED_TOPICS x ASKS (temperature 0.9, a seed per request, <= 48
   tokens, first line); dropped when seen before (every shard's and the held-out prompts) or
   when any token 8-gram occurs in Spec-Bench's questions (`--spec-bench`; counted);
2. the data model's greedy answers (<= `--max-new-tokens`), the whole batch in flight;
3. one prefill of prompt + answer per document on the target (`--target`, the f32 folder)
   with the head's layers captured (the C forward's `ForwardOutput.hidden`, as serving) and
   the target's greedy next token at every position (prompt top-1 logprobs): the labels.
No Spec-Bench text is a source. A run continues after the last shard.

`train`: `eagle_features.train` over the shards (no target pass per step), evaluated after
every epoch on `heldout.pt` (top-1 per draft step, mean accepted length of greedy chains).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time
from pathlib import Path

CACHE = Path("~/.cache/loom/eagle3_smollm2").expanduser()
F32 = "~/.cache/loom/models/smollm2-135m-f32"
# the recipe's 50 seed topics and 3 asks (wave 3) stay where they were written; this script
# adds topics and asks for the large run. Run from the repo (`python scripts/...`), the
# scripts folder is on sys.path.
from train_eagle3_smollm2 import ASKS as _ASKS  # noqa: E402
from train_eagle3_smollm2 import HEAD_LIMIT_MB, spec_bench_grams  # noqa: E402
from train_eagle3_smollm2 import SEED_TOPICS as _TOPICS  # noqa: E402

SEED_TOPICS = [
    *_TOPICS,
    # added for the large run (the 50 above are wave 3's)
    "cats", "horses", "whales", "rivers", "rain forests", "glaciers", "earthquakes", "tides",
    "the moon", "stars", "black holes", "gravity", "magnets", "electricity", "batteries",
    "solar panels", "wind turbines", "nuclear power", "plastics", "glass", "paper", "cotton",
    "wool", "leather shoes", "bicycles", "motorcycles", "airplanes", "ships", "rockets",
    "satellites", "maps", "compasses", "clocks", "calendars", "money", "banks", "taxes",
    "insurance", "renting a flat", "buying a car", "cooking rice", "soups", "salads", "cheese",
    "chocolate", "fruit", "vegetables", "vitamins", "exercise", "stretching", "walking",
    "hiking", "cycling", "tennis", "basketball", "baseball", "golf", "skiing", "surfing",
    "fishing", "knitting", "sewing", "woodworking", "pottery", "drawing", "sculpture",
    "photosynthesis", "cells", "DNA", "evolution", "dinosaurs", "fossils", "insects", "spiders",
    "frogs", "snakes", "sharks", "octopuses", "penguins", "owls", "ants", "forests", "soil",
    "composting", "water", "clouds", "snow", "thunderstorms", "hurricanes", "climate",
    "ancient Egypt", "ancient Greece", "the Middle Ages", "castles", "knights", "the Vikings",
    "the Renaissance", "the industrial revolution", "inventions", "the telephone", "radio",
    "television", "newspapers", "books", "novels", "short stories", "fairy tales", "myths",
    "music", "the guitar", "the violin", "drums", "singing", "dancing", "theatre", "opera",
    "cinema history", "cartoons", "video games", "smartphones", "email", "social media",
    "programming", "Python", "databases", "websites", "robots", "artificial intelligence",
    "cybersecurity", "backups", "printers", "keyboards", "mathematics", "fractions",
    "percentages", "geometry", "statistics", "probability", "algebra", "chemistry", "atoms",
    "acids", "physics", "light", "sound", "heat", "engines", "cars", "roads", "cities", "villages",
    "farms", "cows", "chickens", "bees and honey", "wine", "beer", "juice", "breakfast",
    "lunch boxes", "dinner parties", "birthdays", "weddings", "holidays", "gifts", "letters",
    "resumes", "meetings", "teamwork", "leadership", "negotiation", "customer service",
    "small businesses", "marketing", "advertising", "shopping", "online shopping", "cleaning",
    "laundry", "cooking eggs", "kitchen knives", "home repairs", "plumbing", "painting walls",
    "furniture", "houseplants", "lawns", "flowers", "trees", "fruit trees", "herbs",
    "first aid", "headaches", "colds", "teeth", "eyes", "hearing", "the brain", "memory",
    "habits", "motivation", "stress", "meditation", "happiness", "parenting", "babies",
    "teenagers", "school", "homework", "exams", "university", "scholarships", "teachers",
    "languages", "grammar", "spelling", "reading", "writing essays", "journaling", "history",
    "geography", "countries", "flags", "oceans", "islands", "lakes", "caves", "volcano safety",
]  # fmt: skip
ASKS = [
    *_ASKS,
    "Write one question a student might ask a teacher about {t}. Reply with the question only.",
    "Write one request asking an assistant to compare two things related to {t}. Reply with "
    "the request only.",
    "Write one request asking for a short list about {t}. Reply with the request only.",
    "Write one question a beginner might ask about {t}. Reply with the question only.",
    "Write one request asking an assistant to write a short paragraph about {t}. Reply with "
    "the request only.",
]


def written_prompt(tok, out: list[int], grams: set) -> str | None:
    """The prompt a data-model output writes: its first line, quotes stripped; "" when 12
    characters or fewer, None when one of its token 8-grams occurs in Spec-Bench's questions
    (`grams`), so no Spec-Bench text becomes a source."""
    text = tok.decode(out, skip_special_tokens=True).strip().split("\n")[0].strip()
    text = text.strip('"').strip()
    if len(text) <= 12:
        return ""
    q = tok.encode(text, add_special_tokens=False)
    if any(tuple(q[i : i + 8]) in grams for i in range(len(q) - 7)):
        return None
    return text


def written_prompts(tok, outs, grams: set, seen: set, by_text: bool = False):
    """([(text, chat ids)], how many were dropped for a Spec-Bench 8-gram): the new prompts
    among a batch of data-model outputs (`written_prompt`), each once: a prompt whose chat key
    (`_prompt_key`) is in `seen`, or with `by_text` its lowercased text, is skipped; `seen`
    gains the key (or the text) of each prompt kept."""
    prompts, dropped = [], 0
    for o in outs:
        text = written_prompt(tok, o, grams)
        if text is None:
            dropped += 1
            continue
        if not text:
            continue
        ids = _chat(tok, text)
        key = _prompt_key(tok, ids, len(ids))
        mark = text.lower() if by_text else key
        if key not in seen and mark not in seen:
            seen.add(mark)
            prompts.append((text, ids))
    return prompts, dropped


def _chat(tok, text: str) -> list[int]:
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)  # fmt: skip
    return tok.encode(chat, add_special_tokens=False)


def _prompt_key(tok, ids: list[int], start: int) -> str:
    return tok.decode(ids[:start]).strip().lower()


def _shards(cache: Path) -> list[Path]:
    return sorted((cache / "shards").glob("*.pt"))


def import_legacy(args) -> None:
    """wave 3's features.pt -> heldout.pt (its 25 held-out documents) + shards/legacy.pt."""
    import torch

    from loom.runtime.spec.eagle_data import write_shard

    recs = torch.load(args.legacy, weights_only=False)
    n = min(320, len(recs["ids"]))
    order = list(range(n))
    random.Random(0).shuffle(order)
    n_hold = max(1, int(n * 0.08))
    (args.cache / "shards").mkdir(parents=True, exist_ok=True)
    for name, idx in (("heldout.pt", order[:n_hold]), ("shards/legacy.pt", order[n_hold:])):
        sub = {k: [recs[k][i] for i in idx] for k in ("ids", "start", "feats", "argmax")}
        sub["capture"] = recs["capture"]
        sub["source"] = f"{args.legacy} (wave 3: eager f32 pass), documents {idx}"
        write_shard(args.cache / name, sub)
        print(f"{args.cache / name}: {len(idx)} documents")


def generate(args) -> None:
    import torch
    import transformers
    from tqdm import tqdm

    from loom.runtime.spec.eagle_data import Distiller, check_against_eager, write_shard

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(os.path.expanduser(args.target))
    capture = tuple(int(x) for x in args.aux_layers.split(","))
    seen: set[str] = set()
    tokens = 0
    for p in [args.cache / "heldout.pt", *_shards(args.cache)]:
        if p.exists():
            r = torch.load(p, weights_only=False)
            seen |= {_prompt_key(tok, i.tolist(), s) for i, s in zip(r["ids"], r["start"])}
            if p.name != "heldout.pt":
                tokens += sum(int(i.numel()) for i in r["ids"])
    grams = spec_bench_grams(tok, args.spec_bench) if args.spec_bench else set()
    (args.cache / "shards").mkdir(parents=True, exist_ok=True)
    d = Distiller(args.data_model, args.feature_model or args.target, capture,
                  batch=args.batch, threads=1)  # fmt: skip
    asks = [a.format(t=t) for t in SEED_TOPICS for a in ASKS]
    model = None
    if args.check:
        from loom.runtime.model_loader import load_config, load_model

        path = os.path.expanduser(args.target)
        model = load_model(path, torch.float32, "cpu", load_config(path))
    t_end = time.time() + args.minutes * 60
    bar = tqdm(total=args.tokens, initial=tokens, desc="training tokens", unit="tok")
    dropped_sb = 0
    while time.time() < t_end and tokens < args.tokens:
        if shutil.disk_usage(args.cache).free < 5 * 2**30:
            print("disk below 5 GB free: stopping")
            break
        k = 1 + max([int(p.stem) for p in _shards(args.cache) if p.stem.isdigit()] or [0])
        rng = random.Random(k)
        group = [rng.choice(asks) for _ in range(args.batch)]
        t0 = time.time()
        outs = d.generate([_chat(tok, g) for g in group], 48, temperature=0.9,
                          seeds=[k * 100_000 + i for i in range(args.batch)])  # fmt: skip
        prompts, dropped = written_prompts(tok, outs, grams, seen)
        dropped_sb += dropped
        t1 = time.time()
        answers = d.generate([ids for _, ids in prompts], args.max_new_tokens)
        t2 = time.time()
        rec = {"ids": [], "start": [], "feats": [], "argmax": [], "capture": list(capture),
               "prompts": [], "source": f"{args.data_model} answers, "
               f"{args.feature_model or args.target} features"}  # fmt: skip
        for (text, ids), ans in zip(prompts, answers):
            if len(ans) < 2:
                continue
            doc = ids + ans
            feats, argmax = d.features(doc)
            if model is not None and len(rec["ids"]) < args.check:
                errs, agree = check_against_eager(model, capture, doc, feats, argmax)
                print(f"check against the eager f32 pass: relative error per layer "
                      f"{[round(e, 4) for e in errs]}, greedy token agreement {agree:.3f}")  # fmt: skip
            rec["ids"].append(torch.tensor(doc, dtype=torch.int32))
            rec["start"].append(len(ids))
            rec["feats"].append(feats)
            rec["argmax"].append(argmax)
            rec["prompts"].append(text)
        t3 = time.time()
        write_shard(args.cache / "shards" / f"{k:06d}.pt", rec)
        n_tok = sum(int(i.numel()) for i in rec["ids"])
        tokens += n_tok
        bar.update(n_tok)
        bar.write(f"shard {k:06d}: {len(rec['ids'])} documents, {n_tok} tokens; prompts "
                  f"{t1 - t0:.1f} s, answers {t2 - t1:.1f} s, features {t3 - t2:.1f} s; "
                  f"dropped for Spec-Bench 8-grams {dropped_sb} so far; loadavg "
                  f"{[round(x, 1) for x in os.getloadavg()]}")  # fmt: skip
    bar.close()


def train(args) -> None:
    import torch

    from loom.runtime.model_loader import load_config, load_model
    from loom.runtime.spec import eagle_features as ef
    from loom.runtime.spec.eagle import (
        build_eagle_head,
        head_config,
        load_eagle_head,
        save_eagle_head,
    )  # fmt: skip
    from loom.runtime.spec.eagle_data import load_shards
    from loom.runtime.spec.head_training import cast_copy
    from loom.runtime.spec.train_eagle import init_head

    torch.set_num_threads(args.threads)
    shards = _shards(args.cache)
    recs = load_shards([args.cache / "heldout.pt", *shards])
    n_hold = len(torch.load(args.cache / "heldout.pt", weights_only=False)["ids"])
    hold_idx = list(range(n_hold))
    train_idx, total = [], 0
    for i in range(n_hold, len(recs["ids"])):  # shard order: legacy first, then generated
        if args.max_train_tokens and total >= args.max_train_tokens:
            break
        train_idx.append(i)
        total += int(recs["ids"][i].numel())
    path = os.path.expanduser(args.target)
    tcfg = load_config(path)
    model = load_model(path, torch.float32, "cpu", tcfg)
    for p in model.parameters():
        p.requires_grad_(False)
    capture = tuple(recs["capture"])
    if args.init_head:
        head = load_eagle_head(args.init_head, model, torch.float32, "cpu")
        dv = head.draft_vocab_size
        draft = (torch.arange(dv) + head.d2t.long()).sort().values
    else:
        draft = ef.choose_draft_vocab({"argmax": [recs["argmax"][i] for i in train_idx]},
                                      args.draft_vocab_size)  # fmt: skip
        hcfg = head_config(tcfg, "eagle3", eagle_config={"eagle_aux_hidden_state_layer_ids":
                           list(capture)}, target_hidden_size=tcfg.hidden_size,
                           draft_vocab_size=draft.numel())  # fmt: skip
        head = build_eagle_head(hcfg, model, torch.float32, "cpu")
        head.d2t.copy_(draft - torch.arange(draft.numel()))
        init_head(head, model, "eagle3", 0)
    t2d = torch.full((tcfg.vocab_size,), -100, dtype=torch.long)
    t2d[draft] = torch.arange(draft.numel())
    for p in head.parameters():
        p.requires_grad_(True)
    print(f"{len(train_idx)} training documents ({total} tokens) from {len(shards)} shards, "
          f"{n_hold} held out; draft vocabulary {draft.numel()}"
          f"{' (from ' + args.init_head + ')' if args.init_head else ''}; loadavg "
          f"{[round(x, 1) for x in os.getloadavg()]}", flush=True)  # fmt: skip
    out = args.out
    history = []

    def save(h, rec) -> None:
        rec = dict(rec, train_tokens=total, train_docs=len(train_idx),
                   loadavg=list(os.getloadavg()))  # fmt: skip
        history.append(rec)
        ep = out / f"epoch{rec['epoch']}"
        save_eagle_head(cast_copy(h, "bfloat16"), ep, {"torch_dtype": "bfloat16",
                                                       "dtype": "bfloat16"})  # fmt: skip
        (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")

    out.mkdir(parents=True, exist_ok=True)
    ef.train(head, recs, train_idx, hold_idx, t2d, epochs=args.epochs, unroll_steps=args.unroll,
             eval_steps=args.eval_steps, tokens_per_batch=args.tokens_per_batch, lr=args.lr,
             max_minutes=args.minutes, save=save)  # fmt: skip
    best = max(history, key=lambda r: r["accept_length"])
    size = sum(f.stat().st_size for f in (out / f"epoch{best['epoch']}").glob("*.safetensors"))
    print(f"best held-out epoch {best['epoch']}: mean accepted length "
          f"{best['accept_length']:.3f}, {size / 2**20:.1f} MB bf16"
          f"{' (over the 25 MB limit)' if size > HEAD_LIMIT_MB * 2**20 else ''}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--target", default=F32, help="the f32 folder (features, labels)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("import-legacy")
    g.add_argument("--legacy", type=Path, default=Path("/tmp/e3/features.pt"))
    g = sub.add_parser("generate")
    g.add_argument("--data-model", default="smollm2", help="writes prompts and answers")
    g.add_argument(
        "--feature-model",
        default=None,
        help="the model whose prefill gives features and labels (default: --target;"
        " `smollm2`, the Q4_1 GGUF the f32 folder was converted from, is the same "
        "weights in 4-bit blocks: --check compares it with the f32 eager pass)",
    )
    g.add_argument("--batch", type=int, default=64)
    g.add_argument("--max-new-tokens", type=int, default=160)
    g.add_argument("--minutes", type=float, default=60)
    g.add_argument("--tokens", type=int, default=5_000_000)
    g.add_argument("--aux-layers", default="1,15,29")
    g.add_argument("--spec-bench", type=Path, default=None, help="question.jsonl (a filter)")
    g.add_argument(
        "--check", type=int, default=0, help="compare the first N documents with the eager f32 pass"
    )
    g = sub.add_parser("train")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--max-train-tokens", type=int, default=None)
    g.add_argument("--epochs", type=int, default=4)
    g.add_argument("--minutes", type=float, default=None)
    g.add_argument("--draft-vocab-size", type=int, default=4096)
    g.add_argument("--init-head", default=None, help="start from this head (its vocabulary)")
    g.add_argument("--tokens-per-batch", type=int, default=512)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--unroll", type=int, default=3)
    g.add_argument("--eval-steps", type=int, default=5)
    g.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    {"import-legacy": import_legacy, "generate": generate, "train": train}[args.cmd](args)


if __name__ == "__main__":
    main()
