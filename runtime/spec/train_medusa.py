"""Train Medusa heads for a loom-supported target model.

    python -m loom.train_eagle --medusa --target PATH --data FILE|DIR --out DIR [--medusa-heads 4]

The target runs once over the packed data through loom's own model code (`target_pass`):
its final hidden states are the heads' inputs and its greedy next tokens their labels
(self-distillation: head i at position p learns the token the target would put at p+2+i).
Epochs then train only the heads (the target's LM head shared, frozen). Every epoch prints
the held-out loss and the held-out mean accepted length: tokens per verify step of Medusa
trees (`best_first_tree`, the serving drafter's) along the target's greedy continuation of
held-out prompts, for a few tree sizes and for top-1 chains. `--out` receives the heads
(published Medusa layout), `checkpoint.pt` (resumed automatically), `history.json` and
`loss.png`.
"""

from __future__ import annotations

import time
from pathlib import Path

EVAL_TREE_SIZES = (1, 4, 7, 15)  # draft nodes per verify; 1 = the first head's top-1 only


# ------------------------------------------------------------------ features
def target_features(model, rows, batch: int = 8):
    """Final hidden states [N, T, H] and the target's greedy next ids [N, T] of every row."""
    import torch

    from loom.runtime.spec.eagle_unroll import target_pass

    feats, greedy = [], []
    with torch.no_grad():
        for i in range(0, len(rows), batch):
            logits, f = target_pass(model, rows[i : i + batch], None)
            feats.append(f)
            greedy.append(logits.argmax(-1))
    return torch.cat(feats), torch.cat(greedy)


def head_losses(heads, feats, greedy):
    """Per head: cross-entropy of head i at row p against the target's greedy token after row
    p+1+i (the token at p+2+i), and its top-1 accuracy."""
    import torch.nn.functional as F

    t = feats.shape[1]
    k = heads.num_heads
    logits = heads(feats[:, : t - 1 - 1])  # rows whose first label exists: p + 1 <= t - 1
    losses, accs = [], []
    for i in range(k):
        n = t - 1 - 1 - i  # rows p with label row p + 1 + i <= t - 1
        if n <= 0:
            break
        pred = logits[i, :, :n]
        label = greedy[:, 1 + i : 1 + i + n]
        losses.append(F.cross_entropy(pred.reshape(-1, pred.shape[-1]), label.reshape(-1)))
        accs.append((pred.argmax(-1) == label).float().mean().item())
    return losses, accs


def tree_accept_lengths(heads, feats, seq: list[int], start: int, sizes, topk: int = 4):
    """Simulated Medusa decoding along `seq` (the target's greedy output; `feats` its final
    hidden states) from committed row `start`: tokens per verify step for each tree size."""
    import torch

    from loom.runtime.spec.medusa_drafter import best_first_tree

    with torch.no_grad():
        logp, ids = heads(feats).log_softmax(-1).topk(topk, dim=-1)  # [k, T, K]
    logp_l, ids_l = logp.transpose(0, 1).tolist(), ids.transpose(0, 1).tolist()
    out = {}
    for size in sizes:
        lengths, c = [], start
        # row c sampled seq[c + 1]; the tree drafts seq[c + 2], ...
        while c + 2 < len(seq):
            if size == 1:
                tokens, parents = [ids_l[c][0][0]], [-1]
            else:
                tokens, parents = best_first_tree(ids_l[c], logp_l[c], size)
            node, accepted = -1, 0
            while True:
                want = c + 2 + accepted
                nxt = next((j for j, (t, p) in enumerate(zip(tokens, parents))
                            if p == node and want < len(seq) and t == seq[want]), None)  # fmt: skip
                if nxt is None:
                    break
                node, accepted = nxt, accepted + 1
            lengths.append(1 + accepted)
            c += 1 + accepted
        out[size] = lengths
    return out


def evaluate(heads, model, sequences, sizes) -> dict[int, float]:
    import torch

    from loom.runtime.spec.eagle_unroll import target_pass

    totals: dict[int, list[int]] = {s: [] for s in sizes}
    with torch.no_grad():
        for prompt_len, seq in sequences:
            _, feats = target_pass(model, torch.tensor([seq]), None)
            for s, lens in tree_accept_lengths(heads, feats[0], seq, prompt_len - 1, sizes).items():
                totals[s] += lens
    return {s: sum(v) / max(1, len(v)) for s, v in totals.items()}


# ------------------------------------------------------------------ main
def main(args) -> int:
    """`args`: train_eagle's parsed arguments (with --medusa)."""
    import torch

    from loom.runtime.spec.head_training import cast_copy, heldout_continuations, prepare, train
    from loom.runtime.spec.medusa import build_medusa_heads, save_medusa_heads

    if args.medusa_heads < 1 or args.medusa_layers < 1:
        raise SystemExit("--medusa-heads / --medusa-layers: must be >= 1")
    model, _tcfg, tokenizer, train_rows, hold_rows = prepare(args)

    t0 = time.time()
    feats, greedy = target_features(model, train_rows)
    hold_feats, hold_greedy = target_features(model, hold_rows[:16])
    sequences = heldout_continuations(model, tokenizer, hold_rows, args)
    print(f"target features of {len(train_rows) + min(16, len(hold_rows))} rows and "
          f"{len(sequences)} held-out greedy continuations in {time.time() - t0:.1f}s",
          flush=True)  # fmt: skip

    # Medusa's init: residual blocks start as the identity (zero weights), so every head
    # starts as the target's own next-token prediction
    heads = build_medusa_heads(args.medusa_heads, args.medusa_layers, model, False,
                               torch.float32, "cpu")  # fmt: skip

    def save(h) -> None:
        save_medusa_heads(cast_copy(h, args.save_dtype), Path(args.out),
                          {"torch_dtype": args.save_dtype})  # fmt: skip

    return train(
        heads,
        args,
        name="train_medusa",
        state_key="heads",
        unit="head",
        what="heads",
        train_rows=len(train_rows),
        step_losses=lambda idx: head_losses(heads, feats[idx], greedy[idx]),
        heldout_losses=lambda: head_losses(heads, hold_feats, hold_greedy),
        accept_length=lambda: evaluate(heads, model, sequences, EVAL_TREE_SIZES),
        save=save,
        fmt=_fmt,
    )


def _fmt(acc: dict) -> str:
    return ", ".join(f"{'top-1 chain' if int(s) == 1 else f'{s}-node tree'} {v:.2f}"
                     for s, v in acc.items())  # fmt: skip
