"""A GGUF file's metadata -> the Hugging Face config loom's model classes read."""

from __future__ import annotations

from typing import Any

from loom.runtime.gguf.file import metadata, open_reader
from loom.runtime.gguf.names import SUPPORTED_ARCHS


def gguf_config(path: str):
    meta = metadata(path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"model_path: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHS)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    names = {t.name for t in open_reader(path).tensors}
    common = dict(
        vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length", hidden // heads),
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        # llama.cpp's converter drops output.weight when the head is the embedding
        tie_word_embeddings="output.weight" not in names,
    )
    if arch == "llama":
        return LlamaGGUFConfig(common, _rope(get, "rope_theta"))
    else:
        import transformers

        config = transformers.Gemma3TextConfig(
            **common,
            sliding_window=get("attention.sliding_window", 4096),
            # llama.cpp scales queries by head_dim ** -0.5 (what the released models use)
            query_pre_attn_scalar=get("attention.key_length", hidden // heads),
            hidden_activation="gelu_pytorch_tanh",
            final_logit_softcapping=get("final_logit_softcapping"),
        )
        _set_gemma_rope(config, get)
        config.layer_types = _layer_types(get("attention.sliding_window_pattern"), config)
        config.architectures = ["Gemma3ForCausalLM"]
    return config


class LlamaGGUFConfig:
    """The Llama config of a GGUF file: the fields (and values) of transformers'
    LlamaConfig(**fields).to_dict() that describe the model, as a plain object. Importing
    LlamaConfig costs ~65 MB of resident memory (transformers' configuration chain reaches
    torch.distributed.tensor) in the scheduler and in the owner process, which has no torch
    otherwise; tests/test_gguf_files.py checks every field against LlamaConfig's."""

    model_type = "llama"

    def __init__(self, common: dict[str, Any], rope: dict[str, Any]):
        theta = rope.get("rope_theta", 10000.0)
        scaling = dict(rope.get("rope_scaling") or {"rope_type": "default"})
        fields = dict(
            architectures=["LlamaForCausalLM"],
            dtype=None,
            hidden_act="silu",
            initializer_range=0.02,
            use_cache=True,
            pretraining_tp=1,
            rope_parameters={"rope_theta": theta, **scaling},
            attention_bias=False,
            attention_dropout=0.0,
            mlp_bias=False,
            **common,
        )
        self.__dict__.update(fields)

    @property
    def rope_scaling(self) -> dict[str, Any]:  # transformers >= 5 spells it rope_parameters
        return self.rope_parameters

    @property
    def torch_dtype(self):
        return self.dtype

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items()}, "model_type": self.model_type}

    def __repr__(self) -> str:
        return f"LlamaGGUFConfig({self.to_dict()})"


def _rope(get, theta_name: str) -> dict[str, Any]:
    theta = get("rope.freq_base", 10000.0)
    factor, kind = get("rope.scaling.factor"), get("rope.scaling.type")
    if factor and kind == "linear":
        return {theta_name: theta, "rope_scaling": {"rope_type": "linear", "factor": factor}}
    return {theta_name: theta}


def _layer_types(pattern, config) -> list[str]:
    """Which layers slide: the file's per-layer flags (True = sliding), or its period (every
    n-th layer global), or Gemma 3's period of 6 that older files leave unsaid."""
    n = config.num_hidden_layers
    if isinstance(pattern, list):
        slides = [bool(p) for p in pattern]
    else:
        period = int(pattern or 6)
        slides = [bool((i + 1) % period) for i in range(n)]
    return ["sliding_attention" if s else "full_attention" for s in slides]


def _set_gemma_rope(config, get) -> None:
    """The global layers take the file's base (and linear scaling); the local ones the file's
    `rope.freq_base_swa`, which older files do not record: then Gemma 3's 10000."""
    theta = float(get("rope.freq_base", 1_000_000.0))
    local = float(get("rope.freq_base_swa", 10000.0))
    factor = get("rope.scaling.factor")
    scaling = {"rope_type": "linear", "factor": float(factor)} if factor else None
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params:  # transformers >= 5
        full = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            full.update(scaling)
        params["full_attention"] = full
        params["sliding_attention"] = {"rope_type": "default", "rope_theta": local}
    else:
        config.rope_theta = theta
        config.rope_scaling = scaling
        config.rope_local_base_freq = local
