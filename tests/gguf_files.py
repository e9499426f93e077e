"""Tiny GGUF files written at test time with gguf.GGUFWriter, the way llama.cpp's converter
writes them: its tensor names, q/k rows permuted to ggml's rope order (llama), Gemma's norm
weights stored as 1 + w, the tokenizer as vocabulary metadata. The name table here is written
out independently of runtime/gguf/names.py, so a wrong mapping there fails the round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

LAYER_NAMES = {  # HF suffix -> llama.cpp suffix
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
LLAMA_NAMES = {"post_attention_layernorm": "ffn_norm"}
GEMMA3_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half -> interleaved)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(arch: str, hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in glob:
        return glob[hf]
    _, _, layer, rest = hf.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    table = {**LAYER_NAMES, **(LLAMA_NAMES if arch == "llama" else GEMMA3_NAMES)}
    return f"blk.{layer}.{table[part]}.{kind}"


def write_tokenizer(writer, folder: Path) -> None:
    import gguf

    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    vocab.update(specials)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[cfg["eos_token"]])
    writer.add_pad_token_id(vocab[cfg["pad_token"]])
    writer.add_add_bos_token(False)
    writer.add_chat_template(cfg["chat_template"])


def write_gguf(folder: Path, out: Path, qtype: str = "F32") -> Path:
    """The HF checkpoint in `folder` (llama or gemma3 family) as a GGUF file; 2-D weights other
    than the embedding stored as `qtype` (F32, or one gguf.quants.quantize implements)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "config.json").read_text())
    arch = {"llama": "llama", "gemma3_text": "gemma3"}[cfg["model_type"]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "llama":
        w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    else:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    write_tokenizer(w, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tied = cfg.get("tie_word_embeddings", False)
    for hf, value in tensors.items():
        if tied and hf == "lm_head.weight":
            continue
        value = value.astype(np.float32)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            value = permute(value, heads)
        if arch == "llama" and hf.endswith("k_proj.weight"):
            value = permute(value, kv_heads)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            value = value + 1.0
        if value.ndim == 2 and qtype != "F32" and "embed_tokens" not in hf:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name(arch, hf), gguf.quants.quantize(value, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(arch, hf), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
