"""What training a draft head shares, whichever head it is (EAGLE, EAGLE-3, Medusa).

`prepare` loads the target (frozen, through loom's own model code) and packs the corpus into
training and held-out rows; `heldout_continuations` makes the target's greedy continuations of
held-out prompts, the reference an accepted-length estimate walks; `train` is the loop: cosine
learning rate, gradient clipping, a checkpoint every 50 steps and at every epoch's end (a rerun
resumes from it), the held-out loss and accepted length printed per epoch, the head's files
written, `history.json` and the loss curve `loss.png`. What differs between heads comes in as
functions: the training step's per-step (or per-head) losses, the held-out ones, the accepted
length estimate and the writer of the head's folder.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

LOSS_DECAY = (
    0.8  # weight of unrolled step / head s: 0.8 ** s (later ones are harder and matter less)
)
CHECKPOINT_EVERY = 50  # steps


# ------------------------------------------------------------------ data
def read_documents(path: Path, tokenizer) -> list[str]:
    files = sorted(
        f for f in ([path] if path.is_file() else path.rglob("*")) if f.suffix in (".txt", ".jsonl")
    )
    if not files:
        raise SystemExit(f"--data: no .txt or .jsonl files in {path}")
    docs: list[str] = []
    for f in files:
        if f.suffix == ".txt":
            docs.extend(d for d in f.read_text().split("\n\n") if d.strip())
            continue
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "messages" in obj:
                docs.append(tokenizer.apply_chat_template(obj["messages"], tokenize=False))
            elif "text" in obj:
                docs.append(obj["text"])
            else:
                raise SystemExit(f"--data: {f}:{n} has neither 'text' nor 'messages'")
    return docs


def pack_rows(docs: list[str], tokenizer, seq_len: int):
    import torch

    sep = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    flat: list[int] = []
    for d in docs:
        flat.extend(tokenizer.encode(d, add_special_tokens=False))
        flat.append(sep)
    n = len(flat) // seq_len
    if n < 2:
        raise SystemExit(f"--data: only {len(flat)} tokens; need at least {2 * seq_len}")
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def eval_prompts(rows, tokenizer, n: int, max_len: int = 96) -> list[list[int]]:
    """Held-out prompts: up to and including an assistant header when a row has one (chat
    data), else the first 32 tokens."""
    header = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    prompts = []
    for row in rows.tolist():
        cut = 32
        for i in range(len(row) - len(header)):
            if row[i : i + len(header)] == header and 8 <= i + len(header) <= max_len:
                cut = i + len(header)
                break
        prompts.append(row[:cut])
        if len(prompts) == n:
            break
    return prompts


def greedy_generate(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """prompt + the target's greedy continuation (at most n tokens, to an eos), with a KV
    cache: the prompt is one extend, then each token an extend of one row over the cached
    prefix (the old whole-sequence pass per token cost O(length^2) rows: minutes a prompt
    for SmolLM2)."""
    import torch

    from loom.runtime.attention.torch_backend import TorchAttnBackend
    from loom.runtime.forward_batch import ForwardBatch, ForwardMode, forward_context
    from loom.runtime.memory_pool import ReqToTokenPool, TokenToKVPool
    from loom.runtime.models.llama import head_dim_of

    cfg = model.config
    total = len(prompt) + n
    dtype = next(model.parameters()).dtype
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    kv = TokenToKVPool(total + 1, cfg.num_hidden_layers, kv_heads, head_dim_of(cfg), dtype, "cpu")
    rows = ReqToTokenPool(1, total, "cpu")
    rows.req_to_token[0] = torch.arange(1, total + 1)  # slot 0 is the pool's padding slot
    seq, fed = list(prompt), 0
    while len(seq) < total:
        start, end = fed, len(seq)
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(seq[start:end]),
            positions=torch.arange(start, end),
            out_cache_loc=torch.arange(start + 1, end + 1),
            req_pool_indices=torch.tensor([0]),
            seq_lens=torch.tensor([end]),
            seq_lens_cpu=[end],
            prefix_lens_cpu=[start],
            req_to_token_pool=rows,
            token_to_kv_pool=kv,
            attn_backend=TorchAttnBackend(),
            logits_indices=torch.tensor([end - start - 1]),
        )
        batch.attn_backend.init_forward_metadata(batch)
        with forward_context(batch):
            logits = model(batch.input_ids, batch.positions)
        fed = end
        nxt = int(logits[-1].argmax())
        seq.append(nxt)
        if nxt in eos:
            break
    return seq


def prepare(args):
    """The frozen target, its config and tokenizer, and the packed rows split into training
    and held-out parts (`args`: train_eagle's parsed arguments)."""
    import torch
    import transformers

    from loom.runtime.model_loader import load_config, load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    Path(args.out).mkdir(parents=True, exist_ok=True)
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
    return model, tcfg, tokenizer, train_rows, hold_rows


def heldout_continuations(model, tokenizer, hold_rows, args) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + the target's greedy continuation) for held-out prompts."""
    import torch

    eos = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")
           if t in tokenizer.get_vocab()}  # fmt: skip
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    prompts = eval_prompts(hold_rows, tokenizer, args.eval_prompts)
    with torch.no_grad():
        return [(len(p), greedy_generate(model, p, args.eval_tokens, eos)) for p in prompts]


def train(
    module,
    args,
    *,
    name: str,
    state_key: str,
    unit: str,
    what: str,
    train_rows: int,
    step_losses: Callable,
    heldout_losses: Callable,
    accept_length: Callable,
    save: Callable,
    fmt: Callable = lambda acc: f"{acc:.2f}",
) -> int:
    """Train `module`'s parameters that require grad; `step_losses(idx)` -> (losses per step or
    head, top-1 accuracies) of the training rows `idx`; `heldout_losses()` the same on held-out
    rows; `accept_length()` the held-out mean accepted length (a float, or a dict by tree
    size); `save(module)` writes the head's folder. `name` labels the progress bar and
    `state_key` the module's entry in the checkpoint; `unit` is what the losses are per
    ("step", "head") and `what` what is trained ("head", "heads")."""
    import torch
    from tqdm import tqdm

    out = Path(args.out)
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr,
                            betas=(0.9, 0.95), weight_decay=0.0)  # fmt: skip
    steps_per_epoch = math.ceil(train_rows / args.batch_size)
    total_steps = steps_per_epoch * args.epochs
    history = {"step_loss": [], "epochs": [], "args": vars(args)}
    start_step = 0
    ckpt_path = out / "checkpoint.pt"
    if ckpt_path.exists():
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        module.load_state_dict(ckpt[state_key])
        opt.load_state_dict(ckpt["opt"])
        history, start_step = ckpt["history"], ckpt["step"]
        print(f"resumed from {ckpt_path} at step {start_step}/{total_steps}", flush=True)
    else:
        module.eval()
        history["untrained_accept_length"] = accept_length()
        print(f"untrained {what}: held-out mean accepted length "
              f"{fmt(history['untrained_accept_length'])}", flush=True)  # fmt: skip

    def save_checkpoint(step: int) -> None:
        tmp = out / "checkpoint.pt.tmp"
        torch.save({state_key: module.state_dict(), "opt": opt.state_dict(), "history": history,
                    "step": step}, tmp)  # fmt: skip
        tmp.replace(ckpt_path)

    order = torch.randperm(train_rows, generator=torch.Generator().manual_seed(args.seed))
    bar = tqdm(total=total_steps, initial=start_step, disable=args.no_progress, desc=name,
               unit="step")  # fmt: skip
    t_start = time.time()
    stopped = False
    for step in range(start_step, total_steps):
        epoch, i = divmod(step, steps_per_epoch)
        idx = order[i * args.batch_size : (i + 1) * args.batch_size]
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / total_steps))
        for group in opt.param_groups:
            group["lr"] = lr
        module.train()
        losses, accs = step_losses(idx)
        loss = sum(LOSS_DECAY**s * x for s, x in enumerate(losses))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        history["step_loss"].append([step, loss.item(), accs[0]])
        bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{accs[0]:.2f}")
        bar.update(1)
        over = args.max_minutes is not None and time.time() - t_start > args.max_minutes * 60
        if i + 1 == steps_per_epoch or over:
            module.eval()
            with torch.no_grad():
                hl, ha = heldout_losses()
            acc = accept_length()
            rec = {"epoch": epoch + 1, "step": step + 1, "heldout_loss": hl[0].item(),
                   "heldout_top1": ha, "accept_length": acc,
                   "minutes": (time.time() - t_start) / 60}  # fmt: skip
            history["epochs"].append(rec)
            bar.write(f"epoch {epoch + 1}: held-out loss ({unit} 0) {rec['heldout_loss']:.3f}, "
                      f"top-1 per {unit} {[round(a, 2) for a in ha]}, mean accepted length "
                      f"{fmt(acc)}")  # fmt: skip
            save_checkpoint(step + 1)
            save(module)
        elif (step + 1) % CHECKPOINT_EVERY == 0:
            save_checkpoint(step + 1)
        if over:
            bar.write(f"--max-minutes {args.max_minutes} reached at step {step + 1}")
            stopped = True
            break
    bar.close()
    (out / "history.json").write_text(json.dumps(history, indent=1) + "\n")
    plot_history(history, out / "loss.png", unit)
    if history["epochs"]:
        last = history["epochs"][-1]["accept_length"]
        before = history.get("untrained_accept_length")
        print(f"held-out mean accepted length: untrained "
              f"{fmt(before) if before is not None else 'n/a'} -> trained {fmt(last)} "
              f"({'stopped early' if stopped else 'done'}; "
              f"{(time.time() - t_start) / 60:.1f} min training)")  # fmt: skip
    return 0


def cast_copy(module, dtype: str):
    """`module` itself for float32, else a copy in `dtype` (what a saved head is stored in)."""
    import copy

    import torch

    return module if dtype == "float32" else copy.deepcopy(module).to(getattr(torch, dtype))


def plot_history(history: dict, path: Path, unit: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (pip install matplotlib); "
              "history.json has the curve")  # fmt: skip
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _, _ in history["step_loss"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [x for _, x, _ in history["step_loss"]], lw=0.8, label="train loss (weighted)")
    if history["epochs"]:
        ep = history["epochs"]
        ax.plot([e["step"] for e in ep], [e["heldout_loss"] for e in ep], "o-",
                label=f"held-out loss ({unit} 0)")  # fmt: skip
        ax2 = ax.twinx()
        last = ep[-1]["accept_length"]
        series = {key: [e["accept_length"][key] for e in ep] for key in last} if isinstance(
            last, dict) else {None: [e["accept_length"] for e in ep]}  # fmt: skip
        for key, ys in series.items():
            label = "accepted length" if key is None else f"accepted length, {key} node(s)"
            ax2.plot([e["step"] for e in ep], ys, "s--", label=label)
        ax2.set_ylabel("held-out mean accepted length")
        ax2.legend(loc="center right", fontsize=7)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
