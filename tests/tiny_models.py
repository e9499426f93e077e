"""Tiny random-weight checkpoints of each supported family, built at test time.

Each folder is a real Hugging Face checkpoint (config.json, model.safetensors, tokenizer)
written by `transformers` itself, so loom's loader and models are checked against HF.
The tokenizer is a byte-level BPE trained here on a fixed text; the model vocabulary is
padded past the tokenizer's (as real checkpoints often are).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TOKENIZER_VOCAB = 320
MODEL_VOCAB = 384

_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    'Berlin is the capital of Germany. {"name": "Alice", "age": 31} [1, 2, 3] '
    "def add(a, b): return a + b  # numbers 0123456789 "
    "Thought: I should search. Action: search Observation: ok Final Answer: yes "
    "héllo wörld ünïcode — “quotes” 你好 世界 😀 "
) * 20

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHATML,
                "model_max_length": 4096,
            }
        )
    )


def _config(family: str):
    import transformers as tf

    common = dict(
        vocab_size=MODEL_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=None,
        pad_token_id=0,
    )
    if family == "llama":
        return tf.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        )
    if family == "llama-mha":  # one query head per kv head (GQA group 1)
        return tf.LlamaConfig(**{**common, "num_key_value_heads": 4})
    if family == "llama-mqa":
        return tf.LlamaConfig(**{**common, "num_key_value_heads": 1}, tie_word_embeddings=True)
    if family == "llama-d64":  # head_dim 64, GQA group 3 (SmolLM2's attention shape)
        return tf.LlamaConfig(**{**common, "hidden_size": 96, "num_attention_heads": 3,
                                 "num_key_value_heads": 1}, head_dim=64)  # fmt: skip
    if family == "llama-d128":  # head_dim 128, GQA group 2
        return tf.LlamaConfig(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1},
                              head_dim=128)  # fmt: skip
    if family == "llama-d256":  # head_dim 256, GQA group 4 (Gemma 3 270M's attention shape)
        return tf.LlamaConfig(**{**common, "num_attention_heads": 4, "num_key_value_heads": 1},
                              head_dim=256)  # fmt: skip
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen2-moe":  # layer 0 sparse, layer 1 dense (mlp_only_layers)
        return tf.Qwen2MoeConfig(
            **common, **moe, shared_expert_intermediate_size=48, mlp_only_layers=[1]
        )
    if family in ("qwen3-moe", "qwen3-moe-fused", "sharded"):  # layer 0 dense, 1 sparse
        return tf.Qwen3MoeConfig(
            **common, **moe, head_dim=32, norm_topk_prob=True, decoder_sparse_step=2
        )
    if family in ("mixtral", "mixtral-bf16"):
        return tf.MixtralConfig(
            **{**common, "intermediate_size": 32}, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "gemma3":  # one sliding layer (window 8, shorter than the prompts), one global
        return tf.Gemma3TextConfig(
            **common,
            head_dim=32,
            query_pre_attn_scalar=24,  # not head_dim: the query scale must come from the config
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=3.0,  # tight enough to change the logits
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
        )
    raise KeyError(family)


FAMILIES = [
    "llama",
    "llama-mqa",
    "llama-mha",
    "qwen2",
    "qwen3",
    "qwen2-moe",
    "qwen3-moe",
    "mixtral",
    "sharded",  # qwen3-moe written as an index json + several safetensors files
    "qwen3-moe-fused",  # qwen3-moe's weights as transformers-v5 stacked experts.gate_up_proj
    "mixtral-bf16",  # saved in bfloat16 (dtype "auto" resolves to it)
    "gemma3",
]


def _save_in_memory_names(model, folder: Path) -> None:
    """Write the transformers-v5 in-memory names (stacked experts), as v5-native checkpoints do."""
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def random_model(config):
    """An f32 model of `config` with N(0, 0.08) matrices (seed the torch RNG first): larger
    weights than the default init, so logits are sharper and less often tied."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # 3-D: stacked experts
                p.normal_(0, 0.08)
    return model


def build_tiny_model(family: str, folder: Path, seed: int = 0) -> Path:
    """Write a tiny `family` checkpoint with a tokenizer into `folder` (created)."""

    folder.mkdir(parents=True, exist_ok=True)
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(seed + (family == "sharded"))  # not a copy of qwen3-moe's weights
    model = random_model(_config(family))
    if family == "gemma3":  # Gemma's norms scale by 1 + weight: make the weights matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    if family.endswith("-bf16"):
        model = model.to(torch.bfloat16)
    if family.endswith("-fused"):
        _save_in_memory_names(model, folder)
    else:
        shards = {"max_shard_size": "100KB"} if family == "sharded" else {}
        model.save_pretrained(folder, **shards)
    build_tokenizer(folder)
    return folder


def build_llama3_vocab_model(folder: Path) -> str:
    """A random one-layer Llama checkpoint whose vocabulary is Llama 3's tokenizer (128,256
    ids, tests/real_tokenizers.py: from the llama-models wheel): a real vocabulary's grammar
    tables at a tiny model's cost."""
    import os
    import shutil

    import transformers as tf

    from tests.real_tokenizers import llama3_tokenizer, llama3_tokenizer_path

    tok = llama3_tokenizer()
    config = tf.LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(llama3_tokenizer_path(), name), folder / name)
    return str(folder)
