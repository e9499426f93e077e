"""Medusa heads: k extra LM heads on the target's last hidden state (Medusa-1).

Head i reads the target's final hidden state h_t (after its final norm, the row that just
sampled token t+1) and predicts token t+2+i:

    x = h_t;  x = x + SiLU(W_ij x + b_ij)  for each of the head's `medusa_num_layers` blocks
    logits_i = LM_i(x)

The checkpoint layout is the published Medusa-1 one (FasterDecoding/Medusa): `config.json`
with `medusa_num_heads` / `medusa_num_layers`, tensors `medusa_head.{i}.{j}.linear.weight`
/ `.bias` (the residual blocks) and `medusa_head.{i}.{L}.weight` (head i's LM head; the
`medusa_head.` prefix may be absent, as in `medusa_lm_head.pt` files). A folder without the
LM-head tensors shares the TARGET's LM head (what loom's trainer writes: the bundled heads
are then ~1 MB instead of k vocab x hidden matrices). All heads run as one batched call.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

_NAME = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(?:linear\.)?(weight|bias)$")


class MedusaHeads(nn.Module):
    """`num_heads` heads of `num_layers` residual SiLU blocks each, stacked so that all heads
    run as one batched matmul; `lm_weight` [k, V, H] when the heads have their own LM heads,
    else the target's LM head is used."""

    def __init__(self, num_heads: int, num_layers: int, target: nn.Module, own_lm_head: bool):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(
                f"medusa_num_heads / medusa_num_layers: need >= 1 / >= 0, got {num_heads} / "
                f"{num_layers}"
            )
        h, v = target.config.hidden_size, target.config.vocab_size
        self.num_heads, self.num_layers = num_heads, num_layers
        self.hidden_size, self.vocab_size = h, v
        self.res_weight = nn.Parameter(torch.zeros(num_heads, num_layers, h, h))
        self.res_bias = nn.Parameter(torch.zeros(num_heads, num_layers, h))
        self.lm_weight = nn.Parameter(torch.zeros(num_heads, v, h)) if own_lm_head else None
        object.__setattr__(self, "target_lm_head", target.lm_head)  # not a parameter of ours
        # serving only: the target ids the drafter ranks (None: the whole vocabulary); a
        # folder sets it with config `draft_vocab_size` and a `d2t` tensor (EAGLE-3's
        # convention: draft id i is target id i + d2t[i])
        self.draft_ids: torch.Tensor | None = None

    @property
    def shares_lm_head(self) -> bool:
        return self.lm_weight is None

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> each head's hidden state after its residual blocks, [k, ..., H]."""
        shape = h.shape
        x = h.reshape(1, -1, shape[-1]).expand(self.num_heads, -1, -1)
        for j in range(self.num_layers):
            w, b = self.res_weight[:, j], self.res_bias[:, j]
            x = x + F.silu(torch.baddbmm(b[:, None, :], x, w.transpose(1, 2)))
        return x.reshape(self.num_heads, *shape)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> float32 logits [k, ..., Vd] over the draft vocabulary (`draft_ids`)."""
        logits = self(h)
        return logits if self.draft_ids is None else logits.index_select(-1, self.draft_ids)

    def lm_rows(self) -> torch.Tensor:
        """The LM-head rows the drafter ranks: [Vd, H] shared, or [k, Vd, H] per head."""
        if self.lm_weight is None:
            w = self.target_lm_head.weight[: self.vocab_size]
            return w if self.draft_ids is None else w[self.draft_ids]
        return self.lm_weight if self.draft_ids is None else self.lm_weight[:, self.draft_ids]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., H] -> float32 logits [k, ..., V]: head i's prediction of token t+2+i."""
        x = self.hidden(h)
        if self.lm_weight is None:
            return self.target_lm_head.compute_logits(x).float()
        k = self.num_heads
        flat = x.reshape(k, -1, self.hidden_size)
        logits = torch.bmm(flat, self.lm_weight.transpose(1, 2))
        return logits.reshape(*x.shape[:-1], self.vocab_size).float()

    # ------------------------------------------------------------ checkpoints
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i in range(self.num_heads):
            for j in range(self.num_layers):
                out[f"medusa_head.{i}.{j}.linear.weight"] = self.res_weight[i, j].detach().clone()
                out[f"medusa_head.{i}.{j}.linear.bias"] = self.res_bias[i, j].detach().clone()
            if self.lm_weight is not None:
                out[f"medusa_head.{i}.{self.num_layers}.weight"] = (
                    self.lm_weight[i].detach().clone()
                )
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        k, n, h, v = self.num_heads, self.num_layers, self.hidden_size, self.vocab_size
        seen: set[tuple[int, int, str]] = set()
        with torch.no_grad():
            for name, t in tensors.items():
                m = _NAME.match(name)
                if m is None:
                    raise ValueError(f"medusa checkpoint tensor {name!r} has no place in the heads")
                i, j, kind = int(m.group(1)), int(m.group(2)), m.group(3)
                if i >= k or j > n or (j == n and kind == "bias"):
                    raise ValueError(
                        f"medusa checkpoint tensor {name!r}: outside medusa_num_heads {k} / "
                        f"medusa_num_layers {n}"
                    )
                if j == n and self.lm_weight is None:
                    raise ValueError(f"medusa checkpoint: unexpected LM-head tensor {name!r}")
                want = (v, h) if j == n else (h, h) if kind == "weight" else (h,)
                if tuple(t.shape) != want:
                    raise ValueError(
                        f"medusa checkpoint: {name} has shape {tuple(t.shape)}, the heads expect "
                        f"{want} (heads for another target?)"
                    )
                if j == n:
                    self.lm_weight[i].copy_(t)
                elif kind == "weight":
                    self.res_weight[i, j].copy_(t)
                else:
                    self.res_bias[i, j].copy_(t)
                seen.add((i, j, kind))
        need = {(i, j, kind) for i in range(k) for j in range(n) for kind in ("weight", "bias")}
        if self.lm_weight is not None:
            need |= {(i, n, "weight") for i in range(k)}
        missing = sorted(need - seen)
        if missing:
            i, j, kind = missing[0]
            raise ValueError(
                f"medusa checkpoint is missing {len(missing)} tensors, e.g. medusa_head.{i}.{j}"
                f"{'.linear' if j < n else ''}.{kind}"
            )


def read_medusa_config(path: str | Path) -> dict:
    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"speculative_draft_model_path: {folder} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    if "medusa_num_heads" not in cfg:
        raise ValueError(
            f"speculative_draft_model_path: {cfg_file} is not a Medusa config (no medusa_num_heads)"
        )
    return cfg


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    if not files:
        for f in sorted([*folder.glob("*.pt"), *folder.glob("*.bin")]):
            if f.name == "checkpoint.pt":  # the trainer's resumable state, not the heads
                continue
            out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    if not out:
        raise ValueError(f"speculative_draft_model_path: no Medusa weights in {folder}")
    return out


def build_medusa_heads(
    num_heads: int, num_layers: int, target, own_lm_head: bool, dtype, device
) -> MedusaHeads:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            heads = MedusaHeads(num_heads, num_layers, target, own_lm_head)
    finally:
        torch.set_default_dtype(previous)
    return heads


def load_medusa_heads(path: str | Path, target, dtype, device) -> MedusaHeads:
    """A published-layout Medusa folder for `target` (its hidden size and vocabulary)."""
    folder = Path(path)
    cfg = read_medusa_config(folder)
    tensors = _read_tensors(folder)
    k, n = int(cfg["medusa_num_heads"]), int(cfg.get("medusa_num_layers", 1))
    lm_names = [name for name in tensors if (m := _NAME.match(name)) and int(m.group(2)) == n]
    if "hidden_size" in cfg and cfg["hidden_size"] != target.config.hidden_size:
        raise ValueError(
            f"speculative_draft_model_path: Medusa hidden_size {cfg['hidden_size']} != target "
            f"{target.config.hidden_size}"
        )
    heads = build_medusa_heads(k, n, target, bool(lm_names), dtype, device)
    d2t = tensors.pop("d2t", None)
    size = cfg.get("draft_vocab_size")
    if (d2t is None) != (size is None) or (d2t is not None and tuple(d2t.shape) != (size,)):
        raise ValueError(
            "medusa checkpoint: draft_vocab_size in config.json and a d2t tensor of that "
            "length come together"
        )
    if d2t is not None:
        ids = torch.arange(size) + d2t.long()
        if not (0 <= int(ids.min()) and int(ids.max()) < heads.vocab_size):
            raise ValueError("medusa checkpoint: d2t maps outside the target's vocabulary")
        heads.draft_ids = ids.to(device)
    heads.load_tensors(tensors)
    for p in heads.parameters():
        p.requires_grad_(False)
    return heads.eval()


def save_medusa_heads(heads: MedusaHeads, folder: str | Path, extra: dict | None = None) -> None:
    """config.json + model.safetensors in the published layout."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["MedusaModel"],
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "medusa_shared_lm_head": heads.shares_lm_head,
        **(extra or {}),
    }
    tensors = heads.checkpoint_tensors()
    if heads.draft_ids is not None:
        cfg["draft_vocab_size"] = len(heads.draft_ids)
        d = heads.draft_ids.cpu()
        tensors["d2t"] = d - torch.arange(len(d))
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the package ships it
