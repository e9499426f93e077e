"""Hugging Face weight-only quantized checkpoints (GPTQ, AWQ and compressed-tensors
`quantization_config`) read into the ggml block types loom's quantized layers keep
(runtime/layers/quant_linear.py).

A quantized linear `p` is stored as p.qweight (int32-packed codes), p.qzeros (int32-packed zero
points), p.scales (f16, one per group of `group_size` input columns and output row) and, for
GPTQ, p.g_idx; the weight is w[n, k] = scales[g, n] * (q[n, k] - zero[g, n]), g = k // group.
  GPTQ  qweight [K / (32 / bits), N]: code k of column n in word k // (32 / bits) at bit
        bits * (k % (32 / bits)); qzeros [K / group, N / (32 / bits)] packed along N the same
        way, stored minus one ("gptq" v1 format; "gptq_v2" stores the zero itself).
  AWQ   qweight [K, N / 8], qzeros [K / group, N / 8]: 4-bit, packed along N in the order
        0, 2, 4, 6, 1, 3, 5, 7 (nibble i of a word holds column _AWQ_ORDER[i] of its eight).
Mapped per block of 32 (the group size must be a multiple of 32), no requantization:
  8-bit, every zero 128         -> Q8_0, d = scale, code - 128: exact;
  4-bit, every zero 8 (sym)     -> Q4_0, d = scale, the codes: exact;
  4-bit with zero points (AWQ)  -> Q4_1, d = scale, m = -scale * zero rounded to f16 (the one
                                   inexact step: at most half an f16 ulp of m).
An activation-order GPTQ checkpoint (g_idx not k // group) and 8-bit zero points other than
128 are refused with the field named.

compressed-tensors (llm-compressor's `pack-quantized` format, vLLM's W4A16 / W8A16 checkpoints):
p.weight_packed [N, K * bits / 32] int32, element k of row n at bit bits * k of the row (dense,
little-endian), stored as q + 2^(bits - 1) for the signed code q; p.weight_scale [N, K / group]
("group"), [N, 1] ("channel") or [1] ("tensor"); asymmetric schemes add p.weight_zero_point,
packed the same way along N. w = scale * (q - zero_point), so the stored unsigned values are the
codes and zero_point + 2^(bits - 1) the zeros of the formula above. Only weight-only integer
schemes of 4 or 8 bits are read; activation quantization, sparsity, transforms and other
formats are refused by field. A scale that is not f16 is rounded to f16 for the block
(exact for bf16 scales in f16's normal range; relative 2^-11 for f32).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from loom.runtime.layers.quant_types import QuantizedTensor

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quant_method(config) -> dict | None:
    """The checkpoint's quantization_config when it is GPTQ or AWQ, else None."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return qc
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return qc
    raise ValueError(
        f"quantization_config: quant_method {method!r} is not supported "
        "(gptq, awq, compressed-tensors)"
    )


def _check_compressed_tensors(qc: dict) -> None:
    """Refuse, by field, what loom's blocks cannot hold exactly as the checkpoint means it."""
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise ValueError(f"quantization_config: {field} is not supported")
    if qc.get("kv_cache_scheme"):
        raise ValueError("quantization_config: kv_cache_scheme is not supported")
    for name, group in (qc.get("config_groups") or {}).items():
        where = f"quantization_config: config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"{where}.format {fmt!r} is not supported (pack-quantized)")
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(
                f"{where}.input_activations: activation quantization is not supported "
                "(weight-only schemes such as W4A16 / W8A16)"
            )
        w = group.get("weights") or {}
        if w.get("type") != "int" or int(w.get("num_bits", 0)) not in (4, 8):
            raise ValueError(f"{where}.weights: int with num_bits 4 or 8 only, got {w}")
        if w.get("strategy") not in ("group", "channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy {w.get('strategy')!r} is not supported")
        if w.get("dynamic"):
            raise ValueError(f"{where}.weights.dynamic is not supported")


def _ct_scheme(qc: dict, module: str) -> dict:
    """The `weights` arguments of the first config group whose targets name `module`
    ("Linear" matches every packed linear, "re:..." is a regular expression, else the name)."""
    for group in qc["config_groups"].values():
        for t in group.get("targets", ()):
            if t == "Linear" or (t.startswith("re:") and re.match(t[3:], module)) or t == module:
                return group["weights"]
    raise ValueError(f"quantization_config: no config_groups target matches {module}")


def ct_unpack(parts: dict[str, torch.Tensor], w: dict) -> tuple[torch.Tensor, ...]:
    """compressed-tensors parts -> (codes [N, K], zeros [N, K / group], scales, bits, group)."""
    bits = int(w["num_bits"])
    n, k = (int(x) for x in parts["weight_shape"].tolist())
    codes = _unpack_cols(parts["weight_packed"], bits, None)[:, :k]  # dense, along K
    scales = (
        parts["weight_scale"].float().reshape(n if parts["weight_scale"].numel() > 1 else 1, -1)
    )
    scales = scales.expand(n, scales.shape[1]).contiguous()
    group = k // scales.shape[1] if w["strategy"] == "group" else k
    if w["strategy"] == "group" and int(w.get("group_size") or 0) != group:
        raise ValueError(f"quantization_config: group_size {w.get('group_size')} for [{n}, {k}]")
    zp = parts.get("weight_zero_point")
    if zp is not None and w["strategy"] != "tensor":  # asymmetric: packed along N
        zeros = _unpack_cols(zp.T.contiguous(), bits, None)[:, :n].T.contiguous()
    elif zp is not None:  # one signed zero point, unpacked
        zeros = torch.full_like(
            scales, int(zp.reshape(-1)[0]) + (1 << (bits - 1)), dtype=torch.int64
        )
    elif w.get("symmetric", True):
        zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int64)
    else:
        raise ValueError(
            "model_path: an asymmetric compressed-tensors weight lacks weight_zero_point"
        )
    if group % 32 or k % group:
        raise ValueError(
            f"quantization_config: group_size {group} must be a multiple of 32 dividing {k}"
        )
    return codes.contiguous(), zeros.reshape(n, -1), scales, bits, group


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] -> int64 codes [R * (32 / bits), C], packed along rows (GPTQ qweight)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)
    return codes.reshape(-1, words.shape[1])


def _unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] -> int64 codes [R, C * (32 / bits)], packed along columns."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    codes = (words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    if order is not None:  # nibble i holds column order[i]
        codes = codes[..., torch.argsort(torch.tensor(order))]
    return codes.reshape(words.shape[0], -1)


def unpack(parts: dict[str, torch.Tensor], qc: dict) -> tuple[torch.Tensor, ...]:
    """(codes int64 [N, K], zeros int64 [N, K / group], scales float32 [N, K / group])."""
    method, bits = qc["quant_method"].lower(), int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        if bits != 4:
            raise ValueError(f"quantization_config: AWQ bits {bits} (4 only)")
        codes = _unpack_cols(parts["qweight"], 4, _AWQ_ORDER).T
        zeros = _unpack_cols(parts["qzeros"], 4, _AWQ_ORDER).T
    else:
        if bits not in (4, 8):
            raise ValueError(f"quantization_config: GPTQ bits {bits} (4 or 8)")
        codes = _unpack_rows(parts["qweight"], bits).T
        zeros = _unpack_cols(parts["qzeros"], bits, None).T
        if qc.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = zeros + 1
        k = codes.shape[1]
        g_idx = parts.get("g_idx")
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // group):
            raise ValueError(
                "quantization_config: desc_act (g_idx not k // group_size) is not supported"
            )
    scales = parts["scales"].float().T.contiguous()
    n, k = codes.shape
    if group == -1:
        group = k
    if group % 32 or k % group or scales.shape != (n, k // group):
        raise ValueError(
            f"quantization_config: group_size {group} must be a multiple of 32 dividing {k}"
        )
    return codes.contiguous(), zeros[:n].contiguous(), scales, bits, group


def to_blocks(codes, zeros, scales, bits: int, group: int) -> QuantizedTensor:
    """The weight as ggml blocks of 32 (see the module docstring for which type)."""
    n, k = codes.shape
    rep = group // 32
    d = scales.repeat_interleave(rep, dim=1).reshape(-1).to(torch.float16)  # per block of 32
    z = zeros.repeat_interleave(rep, dim=1).reshape(-1)
    c = codes.reshape(-1, 32)
    f16 = lambda t: t.to(torch.float16).view(torch.uint8).view(-1, 2)  # noqa: E731
    if bits == 8:
        if not bool((z == 128).all()):
            raise ValueError("quantization_config: 8-bit zero points other than 128")
        q = (c - 128).to(torch.int8).view(torch.uint8)
        data = torch.cat([f16(d), q], 1)
        qtype = "Q8_0"
    else:
        nib = (c[:, :16] | (c[:, 16:] << 4)).to(torch.uint8)
        if bool((z == 8).all()):
            data, qtype = torch.cat([f16(d), nib], 1), "Q4_0"
        else:
            m = -(d.float() * z.float())
            data, qtype = torch.cat([f16(d), f16(m), nib], 1), "Q4_1"
    return QuantizedTensor(qtype, (n, k), data.reshape(n, -1).contiguous())


def dequantize(codes, zeros, scales, group: int) -> torch.Tensor:
    """float32 [N, K]: the checkpoint's own formula (the reference the blocks are held to)."""
    z = zeros.repeat_interleave(group, dim=1).float()
    s = scales.to(torch.float16).float().repeat_interleave(group, dim=1)
    return s * (codes.float() - z)


def hf_quantized_weights(
    weights: Iterable[tuple[str, torch.Tensor]], qc: dict
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The checkpoint's tensors with every packed linear (prefix.qweight / qzeros / scales /
    g_idx, or compressed-tensors' prefix.weight_packed / weight_scale / ...) replaced by one
    `prefix.weight` QuantizedTensor; other tensors pass through."""
    ct = qc["quant_method"].lower() == "compressed-tensors"
    leaves = _CT_PARTS if ct else _PARTS
    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf in leaves:
            packed.setdefault(prefix, {})[leaf] = t
        else:
            yield name, t
    for prefix, parts in packed.items():
        if ct:
            missing = {"weight_packed", "weight_scale", "weight_shape"} - set(parts)
            if missing:
                raise ValueError(f"model_path: {prefix} lacks {sorted(missing)}")
            yield f"{prefix}.weight", to_blocks(*ct_unpack(parts, _ct_scheme(qc, prefix)))
            continue
        missing = {"qweight", "qzeros", "scales"} - set(parts)
        if missing:
            raise ValueError(f"model_path: {prefix} lacks {sorted(missing)}")
        codes, zeros, scales, bits, group = unpack(parts, qc)
        yield f"{prefix}.weight", to_blocks(codes, zeros, scales, bits, group)
