"""Train an EAGLE draft head for a loom-supported target model.

    python -m loom.train_eagle --target PATH --data FILE|DIR --out DIR [--eagle3] [--medusa]

The target runs through loom's own model code (runtime/spec/eagle_unroll.py: `target_pass`),
and the head learns the target's next-token distribution (soft labels) over `--steps` unrolled
draft steps ("training-time test": later steps read the head's own previous output, as
drafting does). Data: .txt files (documents split on blank lines) and .jsonl files (one
{"text": ...} or chat {"messages": [...]} object a line, rendered with the target's chat
template), or a folder of them. Every epoch prints the held-out loss and the held-out mean
accepted length: tokens per verify step of greedy chain drafting against the target's own
greedy continuation of held-out prompts (1.0 = nothing accepted). `--out` receives the head
(published EAGLE layout, loadable by --speculative-draft-model-path), `checkpoint.pt`
(resumed automatically when present), `history.json` and `loss.png`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loom.train_eagle", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", required=True, help="target model folder (HF layout)")
    p.add_argument("--data", required=True, help=".txt / .jsonl file or a folder of them")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--eagle3", action="store_true", help="EAGLE-3 head (fused low/mid/high)")
    p.add_argument(
        "--medusa", action="store_true", help="Medusa heads (runtime/spec/train_medusa.py)"
    )
    p.add_argument("--medusa-heads", type=int, default=4, help="Medusa heads (draft depth)")
    p.add_argument("--medusa-layers", type=int, default=1, help="residual blocks per head")
    p.add_argument("--aux-layers", type=str, default=None, help="EAGLE-3 target layers, e.g. 1,2,3")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="EAGLE-3 reduced vocab")
    p.add_argument(
        "--head-intermediate-size",
        type=int,
        default=None,
        help="the head's MLP width (default: the target's; smaller drafts faster)",
    )
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--unroll", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--eval-steps", type=int, default=5, help="draft chain length evaluated")
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--eval-tokens", type=int, default=48)
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of rows held out")
    p.add_argument("--max-docs", type=int, default=None)
    p.add_argument("--max-minutes", type=float, default=None, help="stop training after this")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.medusa and (args.eagle3 or args.aux_layers or args.head_intermediate_size):
        p.error("--medusa: trains Medusa heads; --eagle3 / --aux-layers / --head-* do not apply")
    if args.draft_vocab_size is not None and not args.eagle3:
        p.error("--draft-vocab-size: only EAGLE-3 heads have a reduced draft vocabulary")
    for name in ("epochs", "seq_len", "batch_size", "unroll", "eval_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be >= 1")
    return args


# ------------------------------------------------------------------ model
def init_head(head, target, variant: str, seed: int) -> None:
    """Random init, except that fc starts as a pass-through of the (highest) feature and an
    EAGLE-3 head's norm / LM head start as the target's."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, p in head.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.data.fill_(1.0)
        elif p.dim() >= 2:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.02)
        else:
            p.data.zero_()
    h = head.config.hidden_size
    with torch.no_grad():
        head.fc.weight[:, -h:] += torch.eye(h)
        if variant == "eagle3":
            ids = head.to_target_ids(torch.arange(head.draft_vocab_size))
            head.lm_head.weight.copy_(target.lm_head.weight[ids])
            head.norm.weight.copy_(target.model.norm.weight)


def choose_draft_vocab(model, rows, size: int, capture):
    """The `size` target ids the target predicts most often on the training rows."""
    import torch

    counts = torch.zeros(model.config.vocab_size, dtype=torch.long)
    with torch.no_grad():
        for i in range(0, min(len(rows), 64), 8):
            logits, _ = _target(model, rows[i : i + 8], capture)
            counts += torch.bincount(logits.argmax(-1).flatten(), minlength=counts.numel())
    counts += torch.bincount(rows.flatten(), minlength=counts.numel())  # seen tokens too
    return counts.topk(size).indices.sort().values


def _target(model, ids, capture):
    from loom.runtime.spec.eagle_unroll import target_pass

    return target_pass(model, ids, capture)


def soft_targets(logits, draft_ids):
    """Target distribution restricted (and renormalised) to the draft vocabulary."""
    if draft_ids is not None:
        logits = logits[..., draft_ids]
    return logits.softmax(-1)


def step_losses(head, model, ids, capture, steps: int, draft_ids):
    """Per unrolled step: soft cross-entropy against the target, and top-1 agreement."""
    import torch

    from loom.runtime.spec.eagle_unroll import unroll

    with torch.no_grad():
        logits, feats = _target(model, ids, capture)
        probs = soft_targets(logits, draft_ids)
    next_ids = torch.zeros_like(ids)
    next_ids[:, :-1] = ids[:, 1:]
    outs = unroll(head, feats, next_ids, steps, teacher_forcing=True)
    t = ids.shape[1]
    losses, accs = [], []
    for s, out in enumerate(outs):
        target = probs[:, s + 1 : t]  # row p predicts the token at p + 2: target row p + 1
        pred = out[:, s : t - 1]
        losses.append(-(target * pred.log_softmax(-1)).sum(-1).mean())
        accs.append((pred.argmax(-1) == target.argmax(-1)).float().mean().item())
    return losses, accs


def accepted_length(head, model, sequences, capture, steps: int) -> float:
    """Mean tokens per verify step of greedy chain drafting along the target's greedy output."""
    import torch

    from loom.runtime.spec.eagle_unroll import chain_accept_lengths, unroll

    lengths: list[int] = []
    with torch.no_grad():
        for prompt_len, seq in sequences:
            ids = torch.tensor([seq])
            _, feats = _target(model, ids, capture)
            next_ids = torch.zeros_like(ids)
            next_ids[:, :-1] = ids[:, 1:]
            outs = unroll(head, feats, next_ids, steps, teacher_forcing=False)
            drafts = torch.stack([head.to_target_ids(o[0].argmax(-1)) for o in outs])
            lengths += chain_accept_lengths(drafts, ids[0], prompt_len - 1)
    return sum(lengths) / max(1, len(lengths))


# ------------------------------------------------------------------ main
def main(argv=None) -> int:
    args = parse_args(argv)
    if args.medusa:
        from loom.runtime.spec.train_medusa import main as train_medusa

        return train_medusa(args)
    import torch

    from loom.runtime.spec.eagle import build_eagle_head, head_config, save_eagle_head
    from loom.runtime.spec.head_training import cast_copy, heldout_continuations, prepare, train

    variant = "eagle3" if args.eagle3 else "eagle"
    model, tcfg, tokenizer, train_rows, hold_rows = prepare(args)

    overrides = {}
    capture = None
    if variant == "eagle3":
        layers = (
            [int(x) for x in args.aux_layers.split(",")]
            if args.aux_layers
            else sorted({1, tcfg.num_hidden_layers // 2, tcfg.num_hidden_layers - 1})
        )
        overrides["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
        overrides["target_hidden_size"] = tcfg.hidden_size
        capture = tuple(layers)
        if args.draft_vocab_size:
            overrides["draft_vocab_size"] = args.draft_vocab_size
    if args.head_intermediate_size:
        overrides["intermediate_size"] = args.head_intermediate_size
    hcfg = head_config(tcfg, variant, **overrides)
    head = build_eagle_head(hcfg, model, torch.float32, "cpu")
    draft_ids = None
    if variant == "eagle3" and args.draft_vocab_size:
        draft_ids = choose_draft_vocab(model, train_rows, args.draft_vocab_size, capture)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    init_head(head, model, variant, args.seed)
    for p in head.parameters():
        p.requires_grad_(True)

    t0 = time.time()
    sequences = heldout_continuations(model, tokenizer, hold_rows, args)
    print(f"held-out: {len(sequences)} prompts, target greedy continuations made in "
          f"{time.time() - t0:.1f}s", flush=True)  # fmt: skip

    def save(h) -> None:
        save_eagle_head(cast_copy(h, args.save_dtype), Path(args.out),
                        {"torch_dtype": args.save_dtype, "dtype": args.save_dtype})  # fmt: skip

    return train(
        head,
        args,
        name="train_eagle",
        state_key="head",
        unit="step",
        what="head",
        train_rows=len(train_rows),
        step_losses=lambda idx: step_losses(
            head, model, train_rows[idx], capture, args.unroll, draft_ids
        ),  # fmt: skip
        heldout_losses=lambda: step_losses(
            head, model, hold_rows[:16], capture, args.unroll, draft_ids
        ),  # fmt: skip
        accept_length=lambda: accepted_length(head, model, sequences, capture, args.eval_steps),
        save=save,
    )


if __name__ == "__main__":
    sys.exit(main())
