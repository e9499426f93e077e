"""Build loom's bundled model: synthetic corpus -> BPE tokenizer -> small Qwen3 -> runtime/bundled/.

    python scripts/build_bundled_model.py [--steps N] [--max-minutes M] [--out DIR]

Deterministic by default (fixed seeds, one data order, step-count based); `--max-minutes` is a
safety net that stops early and is then recorded in the model card.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bundled.card import write_card  # noqa: E402
from bundled.corpus import build_corpus  # noqa: E402
from bundled.facts import COUNTRIES, PEOPLE  # noqa: E402
from bundled.tokenizer import save_hf_tokenizer, train_tokenizer  # noqa: E402
from bundled.train import model_config, pack, train  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MAX_FLOAT32_MB = 22  # the whole folder must stay under 25 MB


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=REPO / "runtime" / "bundled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--n-docs", type=int, default=None, help="corpus size; default: enough for --steps"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=4000,
        help="BPE target, padded up to a multiple of 64 in the model",
    )
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    # torch.use_deterministic_algorithms(True) doubles the CPU step time here, so it stays off:
    # the CPU kernels used are deterministic for a fixed thread count anyway.
    t_start = time.time()

    n_docs = args.n_docs or int(args.steps * args.batch_size * (args.seq_len + 1) / 70) + 1000
    docs = build_corpus(n_docs, seed=args.seed)
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f}M chars", flush=True)

    tmp = REPO / "scripts" / "_work" / "bundled_tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_hf_tokenizer(train_tokenizer(docs, args.vocab_size), tmp, model_max_length=4096)
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(tmp))
    args.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
    args.endoftext_id = tok.convert_tokens_to_ids("<|endoftext|>")
    rows = pack(tok(docs, add_special_tokens=False)["input_ids"], args.seq_len)
    print(
        f"tokenizer: {len(tok)} tokens; packed {rows.shape[0]} rows of {args.seq_len + 1} "
        f"({rows.numel() / 1e6:.2f}M tokens; training uses {args.steps * args.batch_size / rows.shape[0]:.2f} epochs)",
        flush=True,
    )

    config = model_config(len(tok), args)
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {config.vocab_size}", flush=True)
    stats = train(model, rows, args.steps, args.batch_size, args.lr, args.max_minutes)

    dtype = torch.float32 if n_params * 4 / 1e6 <= MAX_FLOAT32_MB else torch.bfloat16
    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.to(dtype)
    model.config.use_cache = True
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = str(dtype).removeprefix(
        "torch."
    )  # transformers 4.x name; 5.x writes "dtype"
    cfg["dtype"] = cfg["torch_dtype"]
    cfg["rope_theta"] = (
        config.rope_parameters["rope_theta"] if hasattr(config, "rope_parameters") else 10000.0
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        eos_token_id=[args.im_end_id, args.endoftext_id],
        pad_token_id=args.endoftext_id,
        bos_token_id=None,
        do_sample=False,
    ).save_pretrained(str(out))
    for f in tmp.iterdir():
        shutil.copy(f, out / f.name)

    write_card(
        out,
        {
            "command": " ".join(["python", "scripts/build_bundled_model.py", *sys.argv[1:]]),
            "n_countries": len(COUNTRIES),
            "n_people": len(PEOPLE),
            "params": n_params,
            "layers": args.layers,
            "hidden": args.hidden,
            "intermediate": args.intermediate,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "tokenizer_vocab": len(tok),
            "vocab_size": config.vocab_size,
            "seq_len": args.seq_len,
            "dtype": str(dtype).removeprefix("torch."),
            "seed": args.seed,
            "steps": stats["steps"],
            "batch_size": args.batch_size,
            "tokens": stats["steps"] * args.batch_size * args.seq_len,
            "lr": args.lr,
            "hardware": f"{args.threads} CPU thread(s) ({platform.machine()}, torch {torch.__version__})",
            "seconds": stats["seconds"],
            "final_loss": stats["final_loss"],
            "final_loss_ema": stats["final_loss_ema"],
        },
    )
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(
        f"saved {out} ({size:.1f} MB, {dtype}); total {(time.time() - t_start) / 60:.1f} min",
        flush=True,
    )


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
