"""The EAGLE draft head: a one-layer decoder that drafts from the target's own hidden states.

Two variants, chosen by the draft folder's `config.json` `architectures` (the names SGLang
uses for published checkpoints):

- `LlamaForCausalLMEagle` (EAGLE-1/2): `fc` maps [token embedding; target feature] (2H -> H),
  then `layers.*` (Llama decoder layers, the first without its input norm); the output goes
  straight through the TARGET's LM head. The target feature is the target's last hidden state
  (after its final norm).
- `LlamaForCausalLMEagle3` (EAGLE-3): the target feature is the residual stream after three
  target layers (low / mid / high: `eagle_config.eagle_aux_hidden_state_layer_ids`), fused by
  `fc` (3H -> H). `midlayer` attends over [norm(embedding); hidden_norm(feature)] (2H in),
  then `norm` and the head's OWN `lm_head` over a draft vocabulary of `draft_vocab_size`
  tokens; draft id i is target id `i + d2t[i]` (`t2d` marks the target ids that have one).

Both share the target's embedding. Entry p of the head (its KV and its output) reads
[emb(token p+1); feature p] at rotary position p and predicts token p+2; the head's output
hidden state is the feature of its next step. Weight names are the published ones (q/k/v and
gate/up unfused), so `load_eagle_head` reads published folders and `save_eagle_head` writes
one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from loom.runtime.layers.linear import QKVParallelLinear
from loom.runtime.layers.norm import RMSNorm
from loom.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM, head_dim_of

EAGLE_ARCHS = {"LlamaForCausalLMEagle": "eagle", "LlamaForCausalLMEagle3": "eagle3"}


def default_aux_layers(num_layers: int) -> list[int]:
    """Target layers whose output residual stream EAGLE-3 reads (SGLang's default)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def read_head_config(path: str | Path):
    """The draft folder's config as a transformers LlamaConfig (extra keys kept)."""
    import transformers

    folder = Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"speculative_draft_model_path: {folder} has no config.json")
    raw = json.loads(cfg_file.read_text())
    archs = raw.get("architectures") or []
    if not any(a in EAGLE_ARCHS for a in archs):
        raise ValueError(
            f"speculative_draft_model_path: architectures {archs} is not an EAGLE head "
            f"(one of {sorted(EAGLE_ARCHS)})"
        )
    raw.pop("model_type", None)
    return transformers.LlamaConfig(**raw)


class EagleHead(nn.Module):
    """The head for one target model (`target`: a loom LlamaForCausalLM-family model)."""

    def __init__(self, config, target: nn.Module):
        super().__init__()
        self.config = config
        self.variant = next(EAGLE_ARCHS[a] for a in config.architectures if a in EAGLE_ARCHS)
        h = config.hidden_size
        target_h = getattr(config, "target_hidden_size", None) or target.config.hidden_size
        # shared with the target, not parameters of the head (so not in its checkpoint)
        object.__setattr__(self, "embed_tokens", target.model.embed_tokens)
        object.__setattr__(self, "target_lm_head", target.lm_head)
        if self.variant == "eagle":
            self.aux_layers: list[int] | None = None
            bias = bool(getattr(config, "bias", False) or getattr(config, "fc_bias", False))
            self.fc = nn.Linear(2 * h, h, bias=bias)
            self.layers = nn.ModuleList(
                [LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
            )
            self.layers[0].input_layernorm = nn.Identity()
            self.draft_vocab_size = target.config.vocab_size
            reduced = getattr(config, "draft_vocab_size", None)
            if reduced is not None and reduced != self.draft_vocab_size:
                # drafting over a reduced vocabulary: the rows `i + d2t[i]` of the target's
                # LM head (loom's extension of EAGLE-1 with EAGLE-3's d2t convention)
                if not 0 < reduced < self.draft_vocab_size:
                    raise ValueError(
                        f"draft_vocab_size: {reduced} must be below the target's vocabulary "
                        f"{self.draft_vocab_size}"
                    )
                self.draft_vocab_size = reduced
                self.register_buffer("d2t", torch.zeros(reduced, dtype=torch.int64))
        else:
            eagle_cfg = getattr(config, "eagle_config", None) or {}
            n_target = target.config.num_hidden_layers
            self.aux_layers = list(
                eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(n_target)
            )
            if len(self.aux_layers) != 3 or not all(0 <= i < n_target for i in self.aux_layers):
                raise ValueError(
                    f"eagle_aux_hidden_state_layer_ids: {self.aux_layers} must be 3 layers "
                    f"of the target's {n_target}"
                )
            self.fc = nn.Linear(3 * target_h, h, bias=False)
            mid = LlamaDecoderLayer(config, 0)
            num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            mid.self_attn.qkv_proj = QKVParallelLinear(
                2 * h, head_dim_of(config), config.num_attention_heads, num_kv, bias=False
            )
            mid.hidden_norm = RMSNorm(h, config.rms_norm_eps)
            self.midlayer = mid
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        for p in self.parameters():
            p.requires_grad_(False)

    @property
    def feature_size(self) -> int:
        return self.fc.in_features - self.config.hidden_size * (self.variant == "eagle")

    def forward(
        self, positions: torch.Tensor, next_ids: torch.Tensor, features: torch.Tensor, fused: bool
    ) -> torch.Tensor:
        """One entry per row: rotary `positions`, the token after it `next_ids`, its feature
        (`fused`: a target feature, which EAGLE-3 first projects with fc; else the head's own
        previous output). Attention goes through the forward context. Returns the output
        hidden state (the next feature)."""
        embeds = self.embed_tokens(next_ids).to(features.dtype)
        if self.variant == "eagle":
            hidden = self.fc(torch.cat([embeds, features], dim=-1))
            residual = None
            for layer in self.layers:
                hidden, residual = layer(positions, hidden, residual)
            return hidden + residual
        hidden = self.fc(features) if fused else features
        mid = self.midlayer
        residual = hidden
        x = torch.cat([mid.input_layernorm(embeds), mid.hidden_norm(hidden)], dim=-1)
        x = mid.self_attn(positions, x)
        x, residual = mid.post_attention_layernorm(x, residual)
        return mid.mlp(x) + residual

    @property
    def reduced(self) -> bool:
        """Whether an EAGLE-1 head drafts over a subset of the target's vocabulary."""
        return self.variant == "eagle" and hasattr(self, "d2t")

    def draft_lm_weight(self) -> torch.Tensor:
        """An EAGLE-1 head's LM-head rows: the target's, or the draft vocabulary's subset."""
        weight = self.target_lm_head.weight[: self.target_lm_head.num_embeddings]
        if self.reduced:
            weight = weight[
                self.to_target_ids(torch.arange(self.draft_vocab_size, device=weight.device))
            ]
        return weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary."""
        if self.variant == "eagle":
            if self.reduced:
                return torch.nn.functional.linear(hidden, self.draft_lm_weight()).float()
            return self.target_lm_head.compute_logits(hidden).float()
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.variant == "eagle" and not self.reduced:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------ checkpoints
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The head's tensors under their published names (q/k/v, gate/up unfused)."""
        out: dict[str, torch.Tensor] = {}
        cfg = self.config
        hd = head_dim_of(cfg)
        q = cfg.num_attention_heads * hd
        kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * hd
        for name, t in self.state_dict().items():
            t = t.detach().contiguous()
            if ".qkv_proj." in name:
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    out[name.replace("qkv_proj", part)] = piece.contiguous()
            elif ".gate_up_proj." in name:
                gate, up = t.chunk(2)
                out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
                out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
            else:
                out[name] = t
        if self.variant == "eagle3":
            t2d = torch.zeros(self.target_lm_head.num_embeddings, dtype=torch.bool)
            t2d[self.to_target_ids(torch.arange(self.draft_vocab_size))] = True
            out["t2d"] = t2d
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, t in tensors.items():
            if name in ("t2d", "embed_tokens.weight") or name.startswith("model.embed_tokens"):
                continue  # the embedding is the target's; t2d is implied by d2t
            name = name.removeprefix("model.")
            if name in buffers:
                if buffers[name].shape != t.shape:
                    raise ValueError(f"draft checkpoint: {name} has shape {tuple(t.shape)}")
                buffers[name].copy_(t)
                loaded.add(name)
                continue
            target, shard = LlamaForCausalLM.map_weight_name(self, name)
            if target not in params:
                raise ValueError(f"draft checkpoint tensor {name!r} has no place in the head")
            param = params[target]
            if tuple(param.shape) != tuple(t.shape) and shard is None:
                raise ValueError(
                    f"draft checkpoint: {name} has shape {tuple(t.shape)}, the head expects "
                    f"{tuple(param.shape)} (a head for another target?)"
                )
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(t)
            else:
                loader(param, t.to(param.dtype), shard)
            loaded.add(target)
        missing = set(params) - loaded
        if "d2t" in buffers and "d2t" not in loaded:
            missing.add("d2t (the draft vocabulary of draft_vocab_size)")
        if missing:
            raise ValueError(f"draft checkpoint is missing tensors: {sorted(missing)[:8]}")

    stacked_params = LlamaForCausalLM.stacked_params


def build_eagle_head(config, target: nn.Module, dtype: torch.dtype, device) -> EagleHead:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(config, target)
    finally:
        torch.set_default_dtype(previous)
    return head


def load_eagle_head(path: str | Path, target: nn.Module, dtype: torch.dtype, device) -> EagleHead:
    """Load a published-layout EAGLE / EAGLE-3 folder (config.json + *.safetensors or
    pytorch_model.bin) for `target`."""
    config = read_head_config(path)
    if config.hidden_size != target.config.hidden_size and config.architectures[0].endswith(
        "Eagle"
    ):
        raise ValueError(
            f"speculative_draft_model_path: head hidden_size {config.hidden_size} != target "
            f"{target.config.hidden_size}"
        )
    tensors = _read_tensors(Path(path))
    config.fc_bias = "fc.bias" in tensors  # EAGLE-1 heads have one, later ones not
    head = build_eagle_head(config, target, dtype, device)
    head.load_tensors(tensors)
    return head.eval()


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if files:
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    bins = sorted(folder.glob("*.bin"))
    if not bins:
        raise ValueError(f"speculative_draft_model_path: no weights in {folder}")
    out = {}
    for f in bins:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


def save_eagle_head(head: EagleHead, folder: str | Path, extra_config: dict | None = None) -> None:
    """Write `head` as a published-layout folder (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = head.config.to_diff_dict()  # what differs from LlamaConfig's defaults
    cfg.update(extra_config or {})
    for key in ("transformers_version", "_name_or_path"):
        cfg.pop(key, None)
    cfg["architectures"] = head.config.architectures
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    save_file(head.checkpoint_tensors(), str(folder / "model.safetensors"))
    (folder / "model.safetensors").chmod(0o644)


def head_config(target_config, variant: str, **overrides):
    """A head config for `target_config`: one Llama layer of the target's width and heads."""
    import transformers

    tc = target_config
    arch = "LlamaForCausalLMEagle3" if variant == "eagle3" else "LlamaForCausalLMEagle"
    cfg = dict(
        architectures=[arch],
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
        head_dim=head_dim_of(tc),
        num_hidden_layers=1,
        rms_norm_eps=tc.rms_norm_eps,
        max_position_embeddings=tc.max_position_embeddings,
        rope_theta=getattr(tc, "rope_theta", 10000.0),
        vocab_size=tc.vocab_size,
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
    )
    cfg.update(overrides)
    return transformers.LlamaConfig(**cfg)
