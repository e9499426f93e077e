"""Train an EAGLE-3 head over the target's features computed once (no target pass per step).

`train_eagle` reruns the target on every training step; for a head over a fixed corpus that is
the same pass every epoch, and on a CPU it is most of the cost (SmolLM2-135M: ~15 s a step of
4 x 128 tokens). Here `precompute` runs the target once per document (one whole-sequence pass,
`eagle_unroll.target_pass`) and stores what training reads: the token ids, the three residual
streams EAGLE-3 fuses (bf16) and the target's greedy next token at every position. `train`
then trains the head alone over them with the same unrolled, teacher-forced objective as
`train_eagle` (step s of row p predicts the target's greedy token at p + s + 2; weights
0.8 ** s), hard labels restricted to the draft vocabulary.

Documents are self-distilled chats (prompt + the target's own greedy answer), so the held-out
documents' answers ARE the target's greedy continuations: `evaluate` walks them with greedy
chain drafting (`chain_accept_lengths`) for the mean accepted length (tokens per verify) and
reports top-1 per draft step over answer positions, with no extra target pass.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from loom.runtime.spec.eagle_unroll import chain_accept_lengths, target_pass, unroll

LOSS_DECAY = 0.8


def precompute(model, docs: list[tuple[list[int], int]], capture: tuple[int, ...], out: Path,
               progress: bool = True, save_every: int = 25) -> None:  # fmt: skip
    """docs: (token ids, answer start) -> `out` (a torch file): ids, answer starts, features
    [T, 3H] bf16 and the target's argmax [T] per document. Saved every `save_every` documents
    and resumed from there (a partial file holds the first documents, in order)."""
    from tqdm import tqdm

    rec = {"ids": [], "start": [], "feats": [], "argmax": [], "capture": list(capture)}
    if out.exists():
        rec = torch.load(out, weights_only=False)
        if rec["capture"] != list(capture):
            raise ValueError(f"{out} holds layers {rec['capture']}, not {list(capture)}")

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        torch.save(rec, tmp)
        tmp.replace(out)

    done = len(rec["ids"])
    with torch.no_grad():
        for n, (ids, start) in enumerate(tqdm(docs[done:], desc="target features", unit="doc",
                                              disable=not progress, initial=done,
                                              total=len(docs)), 1):  # fmt: skip
            t = torch.tensor([ids])
            logits, feats = target_pass(model, t, capture)
            rec["ids"].append(t[0].to(torch.int32))
            rec["start"].append(start)
            rec["feats"].append(feats[0].to(torch.bfloat16))
            rec["argmax"].append(logits[0].argmax(-1).to(torch.int32))
            if n % save_every == 0:
                save()
    save()


def choose_draft_vocab(recs: dict, size: int) -> torch.Tensor:
    """The `size` target ids the target predicts most often on the training documents, sorted."""
    counts = torch.zeros(int(max(a.max() for a in recs["argmax"])) + 1, dtype=torch.long)
    for a in recs["argmax"]:
        counts += torch.bincount(a.long(), minlength=counts.numel())
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


def feature_scale(recs: dict, idx: list[int]) -> torch.Tensor:
    """Per feature dimension RMS over documents `idx` (their first position aside: the
    attention-sink token's residual reaches ~25,000 on SmolLM2's middle layer)."""
    total = None
    count = 0
    for i in idx:
        x = recs["feats"][i][1:].float()
        total = x.pow(2).sum(0) if total is None else total + x.pow(2).sum(0)
        count += x.shape[0]
    return (total / max(1, count)).sqrt().clamp_min(1e-3)


def _batch(recs: dict, idx: list[int], t2d: torch.Tensor, scale: torch.Tensor | None = None):
    """Padded [B, T] ids, next ids, features, draft-vocabulary labels (-100: none) and answer
    mask for documents `idx`. Padding sits at the end of rows (causal: earlier rows unaffected)."""
    t = max(recs["ids"][i].numel() for i in idx)
    b = len(idx)
    fdim = recs["feats"][idx[0]].shape[-1]
    ids = torch.zeros(b, t, dtype=torch.long)
    feats = torch.zeros(b, t, fdim)
    labels = torch.full((b, t), -100, dtype=torch.long)
    answer = torch.zeros(b, t, dtype=torch.bool)
    for r, i in enumerate(idx):
        n = recs["ids"][i].numel()
        ids[r, :n] = recs["ids"][i].long()
        feats[r, :n] = recs["feats"][i].float()
        # row p's label is the target's greedy token after position p + 1 (the token at p + 2)
        labels[r, : n - 1] = t2d[recs["argmax"][i][1:].long()]
        answer[r, max(0, recs["start"][i] - 1) : n - 1] = True
    if scale is not None:
        feats /= scale
    next_ids = torch.zeros_like(ids)
    next_ids[:, :-1] = ids[:, 1:]
    return ids, next_ids, feats, labels, answer


def step_losses(head, batch, steps: int):
    _, next_ids, feats, labels, answer = batch
    outs = unroll(head, feats, next_ids, steps, teacher_forcing=True)
    t = labels.shape[1]
    losses, accs = [], []
    for s, out in enumerate(outs):
        # step s at row p continues the chain after p - s: its label is row p's (as step 0's)
        pred = out[:, s:t]
        lab = labels[:, s:t]
        losses.append(F.cross_entropy(pred.reshape(-1, pred.shape[-1]), lab.reshape(-1),
                                      ignore_index=-100))  # fmt: skip
        keep = (lab != -100) & answer[:, s:t]
        hit = (pred.argmax(-1) == lab) & keep
        accs.append((int(hit.sum()), int(keep.sum())))  # answer positions: (hits, count)
    return losses, accs


def evaluate(head, recs: dict, idx: list[int], t2d: torch.Tensor, steps: int,
             scale: torch.Tensor | None = None):  # fmt: skip
    """(top-1 per draft step over answer positions, mean accepted length of greedy chain
    drafting of `steps` tokens along the answers)."""
    hits = [0] * steps
    total = [0] * steps
    lengths: list[int] = []
    with torch.no_grad():
        for i in idx:
            batch = _batch(recs, [i], t2d, scale)
            _, next_ids, feats, labels, answer = batch
            outs = unroll(head, feats, next_ids, steps, teacher_forcing=False)
            drafts = torch.stack([head.to_target_ids(o[0].argmax(-1)) for o in outs])
            ids = recs["ids"][i].long()
            lengths += chain_accept_lengths(drafts, ids, recs["start"][i] - 1)
            _, tf = step_losses(head, batch, steps)  # teacher-forced top-1 per step
            for s, (h, n) in enumerate(tf):
                hits[s] += h
                total[s] += n
    return [h / max(1, n) for h, n in zip(hits, total)], sum(lengths) / max(1, len(lengths))


def train(head, recs: dict, train_idx: list[int], hold_idx: list[int], t2d: torch.Tensor, *,
          epochs: int, unroll_steps: int, eval_steps: int, tokens_per_batch: int, lr: float,
          max_minutes: float | None, save, log=print, seed: int = 0,
          scale: torch.Tensor | None = None) -> list[dict]:  # fmt: skip
    """AdamW, cosine learning rate, gradient clipping; batches of documents of similar length
    (about `tokens_per_batch` tokens); after each epoch the held-out evaluation and `save(head)`.
    Returns one record per epoch.

    `scale` (per feature dimension, e.g. `feature_scale`) preconditions fc: training reads
    features / scale and fc's columns are multiplied by scale (the same function), so Adam's
    steps are not swamped by the few massive dimensions of the target's residual stream; fc is
    divided back around every `save`, so the saved head reads raw features."""
    from tqdm import tqdm

    if scale is not None:
        with torch.no_grad():
            head.fc.weight.mul_(scale)

    def save_raw(h, rec) -> None:
        if scale is None:
            return save(h, rec)
        kept = h.fc.weight.detach().clone()
        with torch.no_grad():
            h.fc.weight.div_(scale)
        try:
            save(h, rec)
        finally:
            with torch.no_grad():
                h.fc.weight.copy_(kept)

    rng = random.Random(seed)
    by_len = sorted(train_idx, key=lambda i: recs["ids"][i].numel())
    batches, cur = [], []
    for i in by_len:
        cur.append(i)
        if len(cur) * recs["ids"][i].numel() >= tokens_per_batch:
            batches.append(cur)
            cur = []
    if cur:
        batches.append(cur)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    total = len(batches) * epochs
    history = []
    t0 = time.time()
    step = 0
    top1, acc_len = evaluate(head, recs, hold_idx, t2d, eval_steps, scale)
    log(f"untrained: held-out top-1 per step {[round(a, 3) for a in top1]}, "
        f"mean accepted length {acc_len:.3f}")  # fmt: skip
    history.append({"epoch": 0, "heldout_top1": top1, "accept_length": acc_len})
    for epoch in range(epochs):
        rng.shuffle(batches)
        head.train()
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{epochs}", unit="batch")
        over = False
        for idx in bar:
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            losses, accs = step_losses(head, _batch(recs, idx, t2d, scale), unroll_steps)
            loss = sum(LOSS_DECAY**s * x for s, x in enumerate(losses))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{accs[0][0] / max(1, accs[0][1]):.2f}")
            if max_minutes is not None and time.time() - t0 > max_minutes * 60:
                over = True
                break
        head.eval()
        top1, acc_len = evaluate(head, recs, hold_idx, t2d, eval_steps, scale)
        rec = {"epoch": epoch + 1, "step": step, "heldout_top1": top1,
               "accept_length": acc_len, "minutes": (time.time() - t0) / 60}  # fmt: skip
        history.append(rec)
        log(f"epoch {epoch + 1} (step {step}, {rec['minutes']:.1f} min): held-out top-1 per "
            f"step {[round(a, 3) for a in top1]}, mean accepted length {acc_len:.3f}")  # fmt: skip
        save_raw(head, rec)
        if over:
            log(f"--max-minutes {max_minutes} reached in epoch {epoch + 1}")
            break
    return history
