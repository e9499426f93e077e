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

import json
import math
import random
import time
from pathlib import Path

LOSS_HEAD_DECAY = 0.8  # weight of head i: 0.8 ** i (later heads are harder and matter less)
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
    import transformers
    from tqdm import tqdm

    from loom.runtime.model_loader import load_config, load_model
    from loom.runtime.spec.medusa import build_medusa_heads, save_medusa_heads
    from loom.train_eagle import eval_prompts, greedy_generate, pack_rows, read_documents

    if args.medusa_heads < 1 or args.medusa_layers < 1:
        raise SystemExit("--medusa-heads / --medusa-layers: must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = load_config(args.target)
    model = load_model(args.target, torch.float32, "cpu", tcfg)
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.target)
    docs = read_documents(Path(args.data), tokenizer)
    random.Random(args.seed).shuffle(docs)
    if args.max_docs:
        docs = docs[: args.max_docs]
    rows = pack_rows(docs, tokenizer, args.seq_len)
    n_hold = max(1, int(len(rows) * args.holdout))
    train_rows, hold_rows = rows[:-n_hold], rows[-n_hold:]
    print(f"data: {len(docs)} documents, {rows.numel()} tokens; {len(train_rows)} training rows "
          f"of {args.seq_len}, {n_hold} held out", flush=True)  # fmt: skip

    t0 = time.time()
    feats, greedy = target_features(model, train_rows)
    hold_feats, hold_greedy = target_features(model, hold_rows[:16])
    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
           if t in tokenizer.get_vocab()}  # fmt: skip
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    prompts = eval_prompts(hold_rows, tokenizer, args.eval_prompts)
    with torch.no_grad():
        sequences = [(len(p), greedy_generate(model, p, args.eval_tokens, eos)) for p in prompts]
    print(f"target features of {len(train_rows) + min(16, n_hold)} rows and {len(sequences)} "
          f"held-out greedy continuations in {time.time() - t0:.1f}s", flush=True)  # fmt: skip

    # Medusa's init: residual blocks start as the identity (zero weights), so every head
    # starts as the target's own next-token prediction
    heads = build_medusa_heads(args.medusa_heads, args.medusa_layers, model, False,
                               torch.float32, "cpu")  # fmt: skip
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = math.ceil(len(train_rows) / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    history = {"step_loss": [], "epochs": [], "args": vars(args)}
    start_step = 0
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        heads.load_state_dict(ckpt["heads"])
        opt.load_state_dict(ckpt["opt"])
        history, start_step = ckpt["history"], ckpt["step"]
        print(f"resumed from {ckpt_path} at step {start_step}/{total_steps}", flush=True)
    else:
        untrained = evaluate(heads, model, sequences, EVAL_TREE_SIZES)
        history["untrained_accept_length"] = untrained
        print(f"untrained heads: held-out mean accepted length {_fmt(untrained)}", flush=True)

    def save_checkpoint(step: int) -> None:
        tmp = out / "checkpoint.pt.tmp"
        torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "history": history,
                    "step": step}, tmp)  # fmt: skip
        tmp.replace(ckpt_path)

    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(args.seed))
    bar = tqdm(total=total_steps, initial=start_step, disable=args.no_progress,
               desc="train_medusa", unit="step")  # fmt: skip
    t_start = time.time()
    stopped = False
    for step in range(start_step, total_steps):
        epoch, i = divmod(step, steps_per_epoch)
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        losses, accs = head_losses(heads, feats[idx], greedy[idx])
        loss = sum(LOSS_HEAD_DECAY**s * x for s, x in enumerate(losses))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        history["step_loss"].append([step, loss.item(), accs[0]])
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{accs[0]:.2f}")
        bar.update(1)
        over = args.max_minutes is not None and time.time() - t_start > args.max_minutes * 60
        if i + 1 == steps_per_epoch or over:
            with torch.no_grad():
                hl, ha = head_losses(heads, hold_feats, hold_greedy)
            acc = evaluate(heads, model, sequences, EVAL_TREE_SIZES)
            rec = {"epoch": epoch + 1, "step": step + 1, "heldout_loss": hl[0].item(),
                   "heldout_top1": ha, "accept_length": acc,
                   "minutes": (time.time() - t_start) / 60}  # fmt: skip
            history["epochs"].append(rec)
            bar.write(f"epoch {epoch + 1}: held-out loss (head 0) {rec['heldout_loss']:.3f}, "
                      f"top-1 per head {[round(a, 2) for a in ha]}, mean accepted length "
                      f"{_fmt(acc)}")  # fmt: skip
            save_checkpoint(step + 1)
            save_medusa_heads(_cast(heads, args.save_dtype), out, {"torch_dtype": args.save_dtype})
        elif (step + 1) % 50 == 0:
            save_checkpoint(step + 1)
        if over:
            bar.write(f"--max-minutes {args.max_minutes} reached at step {step + 1}")
            stopped = True
            break
    bar.close()
    history["epochs"] = [_json_keys(e) for e in history["epochs"]]
    if "untrained_accept_length" in history:
        history["untrained_accept_length"] = _json_keys(history["untrained_accept_length"])
    (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")
    plot_history(history, out / "loss.png")
    if history["epochs"]:
        last = history["epochs"][-1]["accept_length"]
        before = history.get("untrained_accept_length") or {}
        print(f"held-out mean accepted length: untrained {_fmt(before)} -> trained {_fmt(last)} "
              f"({'stopped early' if stopped else 'done'}; {(time.time() - t_start) / 60:.1f} "
              "min training)")  # fmt: skip
    return 0


def _fmt(acc: dict) -> str:
    return ", ".join(f"{'top-1 chain' if int(s) == 1 else f'{s}-node tree'} {v:.2f}"
                     for s, v in acc.items())  # fmt: skip


def _json_keys(d: dict) -> dict:
    return {str(k): (_json_keys(v) if isinstance(v, dict) else v) for k, v in d.items()}


def _cast(heads, dtype: str):
    import copy

    import torch

    return heads if dtype == "float32" else copy.deepcopy(heads).to(getattr(torch, dtype))


def plot_history(history: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name}; history.json has the curve")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _, _ in history["step_loss"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [x for _, x, _ in history["step_loss"]], lw=0.8, label="train loss (weighted)")
    if history["epochs"]:
        ep = history["epochs"]
        ax.plot([e["step"] for e in ep], [e["heldout_loss"] for e in ep], "o-",
                label="held-out loss (head 0)")  # fmt: skip
        ax2 = ax.twinx()
        for size in ep[-1]["accept_length"]:
            ax2.plot([e["step"] for e in ep], [e["accept_length"][size] for e in ep], "s--",
                     label=f"accepted length, {size} node(s)")  # fmt: skip
        ax2.set_ylabel("held-out mean accepted length")
        ax2.legend(loc="center right", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
