"""Model config and the training loop: a small Qwen3 trained on packed sequences on the CPU."""

from __future__ import annotations

import math
import time

import torch


def model_config(vocab_size: int, args) -> Qwen3Config:  # noqa: F821
    from transformers import Qwen3Config

    padded = (vocab_size + 63) // 64 * 64  # a padded vocab, as real checkpoints have
    return Qwen3Config(
        vocab_size=padded,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        hidden_act="silu",
        attention_bias=False,
        attention_dropout=0.0,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=[args.im_end_id, args.endoftext_id],
        pad_token_id=args.endoftext_id,
    )


def pack(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate documents (each already ends in <|endoftext|>) into rows of seq_len + 1."""
    flat = [t for ids in token_lists for t in ids]
    n = len(flat) // (seq_len + 1)
    return torch.tensor(flat[: n * (seq_len + 1)], dtype=torch.long).view(n, seq_len + 1)


def lr_at(progress: float, peak: float, warmup_frac: float = 0.05) -> float:
    """Linear warmup, then cosine decay to 10% of peak; progress runs from 0 to 1."""
    if progress < warmup_frac:
        return peak * max(progress, 1e-3) / warmup_frac
    t = min(1.0, (progress - warmup_frac) / (1 - warmup_frac))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(
    model,
    rows: torch.Tensor,
    steps: int,
    batch_size: int,
    lr: float,
    max_minutes: float | None,
    log_every: int = 20,
) -> dict:
    """Single pass over rows in order (wrapping if needed); stops at `steps` or `max_minutes`.

    Progress is step-based (deterministic). With `max_minutes`, progress is the larger of the
    step and the time fraction, so a time-limited run still anneals its learning rate.
    """
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    model.train()
    t0, ema, step = time.time(), None, 0
    for step in range(steps):
        idx = torch.arange(step * batch_size, (step + 1) * batch_size) % rows.shape[0]
        batch = rows[idx]
        progress = step / steps
        if max_minutes is not None:
            progress = max(progress, (time.time() - t0) / (max_minutes * 60))
        for g in opt.param_groups:
            g["lr"] = lr_at(progress, lr)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        elapsed = time.time() - t0
        if step % log_every == 0 or step == steps - 1:
            print(
                f"step {step:5d}/{steps}  loss {loss.item():.4f}  ema {ema:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {elapsed / (step + 1):.2f}s/step",
                flush=True,
            )
        if max_minutes is not None and elapsed >= max_minutes * 60:
            print(f"stopping at step {step}: --max-minutes {max_minutes} reached", flush=True)
            break
    model.eval()
    return {
        "steps": step + 1,
        "final_loss_ema": ema,
        "final_loss": loss.item(),
        "seconds": time.time() - t0,
    }
