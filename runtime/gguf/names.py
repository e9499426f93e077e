"""llama.cpp's tensor names -> loom's (Hugging Face) names, and the value fixes on the way.

The one place that knows how llama.cpp's converter (convert_hf_to_gguf.py) changed a Hugging
Face checkpoint, so that reading a GGUF file undoes exactly that:
- llama-family q/k projections: the converter permuted their rows from HF's rotate-half
  layout to ggml's interleaved rope (`permute`); `unpermute_rows` is its inverse, the same as
  transformers' GGUF loader applies. Rows only, so raw block-quantized rows permute too.
- Gemma's RMSNorm weights: HF computes x * (1 + w), the converter stores 1 + w; HF gets w.
"""

from __future__ import annotations

import re

import numpy as np

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<suffix> -> model.layers.N.<name>; one table for all families (a name a family lacks
# never appears in its files)
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# where the families differ: the norm after attention and around the MLP
_LAYER_BY_ARCH = {
    "llama": {"ffn_norm": "post_attention_layernorm"},
    "gemma3": {
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
SUPPORTED_ARCHS = tuple(_LAYER_BY_ARCH)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(arch: str, name: str) -> str:
    """The HF name of GGUF tensor `name`."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    if name == "rope_freqs.weight":  # llama3-style rope scaling, precomputed per frequency
        raise ValueError(
            f"model_path: GGUF tensor {name!r} (rope frequency factors) is not supported yet"
        )
    m = _BLOCK.match(name)
    if m is None:
        return _unknown(arch, name)
    layer, part, kind = m.groups()
    table = {**_LAYER, **_LAYER_BY_ARCH[arch]}
    if part not in table:
        return _unknown(arch, name)
    return f"model.layers.{layer}.{table[part]}.{kind}"


def _unknown(arch: str, name: str):
    raise ValueError(f"model_path: GGUF tensor {name!r} has no place in a {arch} model")


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k `permute` (per head: rows [r0, r2, ..., r1, r3, ...] back
    from the interleaved order) over the first axis; works on float rows and raw block rows."""
    head_dim = rows.shape[0] // n_head
    w = rows.reshape(n_head, head_dim // 2, 2, *rows.shape[1:])
    return w.swapaxes(1, 2).reshape(rows.shape)


def fix_values(arch: str, hf: str, rows: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """Undo the converter's row permutation (any dtype) for one tensor."""
    if arch == "llama" and hf.endswith("q_proj.weight"):
        return unpermute_rows(rows, heads)
    if arch == "llama" and hf.endswith("k_proj.weight"):
        return unpermute_rows(rows, kv_heads)
    return rows


def fix_float(arch: str, hf: str, values: np.ndarray) -> np.ndarray:
    """Undo the converter's value shift (float tensors only: norms are never quantized)."""
    if arch == "gemma3" and hf.endswith("norm.weight"):
        return values - 1.0
    return values
